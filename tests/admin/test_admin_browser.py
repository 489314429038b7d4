"""The dashboard end to end in a real headless Chromium (Debian's `chromium`, driven by Playwright).

One server with an API key, a model dir of its own and the loopback hub; one browser page
walks through login, models, chat, settings, downloads, benchmark and logs, taking a
screenshot of each page (kept in the test's tmp dir and copied to /tmp/omlx-screens/).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import httpx
import pytest

from tests.admin.conftest import API_KEY, HUB_REPO, needs_chromium, start_server, writable_model_dir

pytestmark = needs_chromium


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, fake_hub, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("admin-ui")
    models = writable_model_dir(tiny_model_dir, root)
    srv = start_server(root / "home", models, "--api-key", API_KEY, env={"OMLX_HF_ENDPOINT": fake_hub.url})
    yield srv
    srv.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def page(browser, server):
    context = browser.new_context(viewport={"width": 1360, "height": 860})
    p = context.new_page()
    p.set_default_timeout(30_000)
    p.problems = []  # console errors, CSP violations, failed requests to other hosts
    p.on("console", lambda m: p.problems.append(m.text) if m.type == "error" else None)
    p.on("pageerror", lambda e: p.problems.append(str(e)))
    p.on("request", lambda r: p.problems.append(f"external request {r.url}")
         if not r.url.startswith((server.base_url, "data:")) else None)
    yield p
    context.close()


def shot(page, screens: Path, name: str) -> None:
    page.wait_for_timeout(300)  # let bars and toasts settle
    page.screenshot(path=str(screens / f"{name}.png"), full_page=False)


def go(page, server, name: str) -> None:
    page.goto(f"{server.base_url}/admin#/{name}")
    page.wait_for_selector(f"#view[data-page='{name}']")


def test_01_login_is_required_and_works(page, server, screens):
    page.goto(server.base_url + "/admin")
    page.wait_for_selector("#login-form")
    assert page.is_visible("#login") and not page.is_visible("#shell")
    shot(page, screens, "01-login")
    page.fill("#login-key", "wrong-key")
    page.click("#login-submit")
    page.wait_for_selector("#login-error:has-text('not right')")
    page.fill("#login-key", API_KEY)
    page.click("#login-submit")
    page.wait_for_selector("#shell:not(.hidden)")
    page.wait_for_selector(".card-value")
    cookie = next(c for c in page.context.cookies() if c["name"] == "omlx_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert page.evaluate("document.cookie") == ""  # invisible to scripts
    page.wait_for_selector("text=Cache hit rate")
    shot(page, screens, "02-overview")


def test_02_load_a_model_and_edit_its_settings(page, server, screens):
    go(page, server, "models")
    row = page.locator("tr[data-model='tiny-llama']")
    row.locator("[data-action=load]").click()
    row.locator("text=loaded").wait_for()
    row.locator("[data-action=unload]").wait_for()
    shot(page, screens, "03-models")
    row.locator("[data-action=settings]").click()
    page.fill("input[name=temperature]", "0.3")
    page.fill("input[name=aliases]", "tiny, small-*")
    shot(page, screens, "04-model-settings")
    page.click("[data-action=save-model-settings]")
    page.wait_for_selector(".modal", state="detached")
    settings = json.loads((server.home / "model_settings.json").read_text())
    assert settings["tiny-llama"]["temperature"] == 0.3
    assert settings["tiny-llama"]["aliases"] == ["tiny", "small-*"]
    # Pin via the switch.
    row.locator(".switch span").click()
    page.wait_for_selector(".toast:has-text('pinned')")
    assert json.loads((server.home / "model_settings.json").read_text())["tiny-llama"]["pinned"] is True


def test_03_chat_streams_an_answer_with_stats(page, server, screens):
    """The chat itself is tested in test_chat_browser.py; here: it works behind the login."""
    go(page, server, "chat")
    page.wait_for_selector("select[name=model] option", state="attached")
    page.select_option("select[name=model]", "tiny-llama")
    page.fill("textarea[name=system]", "You are terse.")
    page.fill("input[name=max_tokens]", "40")
    page.fill("textarea[name=prompt]", "Write **bold** text and a `code` span.")
    page.click("[data-action=send]")
    answer = page.locator(".msg.assistant").last
    answer.locator(".meta:has-text('tok/s')").wait_for()
    meta = answer.locator(".meta").inner_text()
    assert re.match(r"\d+ tokens · prefill [\d.]+ tok/s · decode [\d.]+ tok/s · TTFT [\d.]+ m?s · 0 of \d+ prompt tokens cached", meta), meta
    assert answer.locator(".bubble").inner_text().strip()
    assert page.locator(".msg.user .bubble").first.inner_text() == "Write **bold** text and a `code` span."
    # A second turn resends the first: the prefix cache restores it.
    page.fill("textarea[name=prompt]", "And again.")
    page.click("[data-action=send]")
    page.locator(".msg.assistant").nth(1).locator(".meta:has-text('tok/s')").wait_for()
    second = page.locator(".msg.assistant").nth(1).locator(".meta").inner_text()
    assert not re.search(r" 0 of \d+ prompt", second), second
    shot(page, screens, "05-chat")


def test_04_markdown_escapes_html_and_highlights_code(page, server):
    html = page.evaluate("Markdown.render('<img src=x onerror=alert(1)> **b** `c`\\n\\n```python\\ndef f(x):\\n    return \"s\"  # c\\n```')")
    assert "<img" not in html and "&lt;img" in html
    assert "<strong>b</strong>" in html and "<code>c</code>" in html
    assert '<span class="hljs-keyword">def</span>' in html and '<span class="hljs-string">"s"</span>' in html
    assert '<span class="hljs-comment"># c</span>' in html
    assert "javascript:" not in page.evaluate("Markdown.render('[x](javascript:alert(1))')")
    link = page.evaluate("Markdown.render('[x](https://example.org/a)')")
    assert 'target="_blank"' in link and 'rel="noopener noreferrer"' in link
    streaming = page.evaluate("Markdown.render('```js\\nlet a = 1')")  # a fence not closed yet
    assert '<span class="hljs-keyword">let</span>' in streaming


def test_05_settings_persist_after_reload(page, server, screens):
    go(page, server, "settings")
    row = page.locator("[data-setting=default_max_tokens]")
    row.locator("input").fill("333")
    page.locator("[data-setting=cache_block_size] input").fill("128")
    page.click("[data-action=save-settings]")
    page.wait_for_selector(".notice.warn:has-text('cache_block_size')")
    on_disk = json.loads((server.home / "settings.json").read_text())
    assert on_disk["default_max_tokens"] == 333 and on_disk["cache_block_size"] == 128
    page.reload()
    page.wait_for_selector("[data-setting=default_max_tokens] input")
    assert page.input_value("[data-setting=default_max_tokens] input") == "333"
    assert page.input_value("[data-setting=cache_block_size] input") == "128"
    assert "restart pending" in page.locator("[data-setting=cache_block_size]").inner_text()
    # A sub-key, shown once.
    page.fill("input[name=key_name]", "laptop")
    page.click("[data-action=create-key]")
    key = page.locator("[data-new-key]").inner_text()
    assert key.startswith("omlx-sk-")
    shot(page, screens, "07-new-key")
    page.locator(".modal .btn:has-text('Close')").last.click()
    page.wait_for_selector("td:has-text('laptop')")
    page.locator("[data-setting=default_max_tokens]").scroll_into_view_if_needed()
    page.evaluate("window.scrollTo(0, 0)")
    shot(page, screens, "06-settings")


def test_06_download_from_the_loopback_hub(page, server, screens):
    go(page, server, "downloads")
    page.fill("input[name=q]", "tiny")
    page.click("[data-action=search]")
    result = page.locator(f"tr[data-repo='{HUB_REPO}']")
    result.wait_for()
    result.locator("[data-action=download]").click()
    page.locator("tr[data-job][data-state=completed]").wait_for(timeout=120_000)
    assert "100%" in page.locator("tr[data-job]").first.inner_text() or "9.4 MB" in page.locator("tr[data-job]").first.inner_text()
    shot(page, screens, "08-downloads")
    go(page, server, "models")
    page.locator(f"tr[data-model='{HUB_REPO}']").wait_for()


def test_07_benchmark_runs_cold_then_warm(page, server, screens):
    go(page, server, "bench")
    page.select_option("select[name=model]", "tiny-llama")
    page.fill("input[name=prompt_tokens]", "300")
    page.fill("input[name=max_tokens]", "16")
    page.fill("input[name=concurrency]", "2")
    page.click("[data-action=run]")
    page.wait_for_selector("#view .badge:has-text('completed')", timeout=120_000)
    table = page.locator("table[data-results]")
    table.locator("td:has-text('Time to first token (avg)')").wait_for()
    text = table.inner_text()
    assert "warm (cached)" in text.lower() and "×" in text and "598 of 600" in text
    shot(page, screens, "09-bench")


def test_08_logs_tail_and_overview(page, server, screens):
    go(page, server, "logs")
    page.wait_for_selector(".logline:has-text('benchmark')")
    page.select_option("select[name=level]", "WARNING")
    page.select_option("select[name=level]", "DEBUG")
    shot(page, screens, "10-logs")
    go(page, server, "overview")
    page.wait_for_selector("td:has-text('All models')")
    assert "tiny-llama" in page.locator("#view").inner_text()
    shot(page, screens, "02-overview-after")


def metric_samples(server) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.base_url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_09_charts_show_what_metrics_count(page, server, screens):
    """After the traffic above (chats, a cancelled chat, the benchmark), all finished."""
    go(page, server, "overview")
    page.wait_for_function("window.omlxHistory && document.querySelector('[data-latest=mem_hot]').textContent !== '—'")
    history = page.evaluate("window.omlxHistory")
    m = metric_samples(server)

    def total(name: str, **labels: str) -> float:
        return sum(v for (n, ls), v in m.items() if n == name and set(labels.items()) <= set(ls))

    points = history["points"]
    assert history["kept_across_restarts"] and points[-1]["live"]
    assert sum(p["requests"] for p in points) == total("omlx_request_success_total") >= 5
    assert sum(p["generation_tokens"] for p in points) == total("omlx_generation_tokens_total")
    assert sum(p["prompt_tokens"] for p in points) == total("omlx_prompt_tokens_total")
    assert sum(p["ttft_count"] for p in points) == total("omlx_time_to_first_token_seconds_count")
    hits, misses = (sum(p[k]["hot"] for p in points) for k in ("hits", "misses"))
    assert (hits, misses) == (total("omlx_cache_tier_hits_total", tier="hot"), total("omlx_cache_tier_misses_total", tier="hot"))
    # the latest values as shown
    hot_bytes = total("omlx_cache_bytes", tier="hot")
    assert points[-1]["bytes"]["hot"] == hot_bytes > 0
    assert page.inner_text("[data-latest=mem_hot]") == page.evaluate(f"fmt.bytes({hot_bytes})")
    assert page.inner_text("[data-latest=hit_hot]") != "—"
    p95 = next(p["ttft_p95"] for p in reversed(points) if p["ttft_p95"] is not None)
    assert page.inner_text("[data-latest=ttft_p95]") == page.evaluate(f"fmt.secs({p95})")
    buckets = sorted((float(dict(ls)["le"]), v) for (n, ls), v in m.items()
                     if n == "omlx_time_to_first_token_seconds_bucket")
    count = total("omlx_time_to_first_token_seconds_count")
    slowest = min(le for le, v in buckets if sum(c for b, c in buckets if b == le) == count)
    assert 0 < p95 <= slowest  # within the histogram's observations
    assert page.locator(".chart canvas").count() == 5
    page.locator(".chart-grid").scroll_into_view_if_needed()
    shot(page, screens, "11-overview-charts")


def test_10_no_console_errors_and_nothing_fetched_from_outside(page):
    # The one expected error: the browser logs the 401 of the deliberate wrong login.
    problems = [p for p in page.problems if "status of 401" not in p]
    assert problems == []
    assert len(page.problems) - len(problems) <= 1


def test_11_sign_out(page, server):
    page.click("#logout")
    page.wait_for_selector("#login:not(.hidden)")
    page.goto(server.base_url + "/admin#/settings")
    page.wait_for_selector("#login-form")
    assert not page.is_visible("#shell")
