"""The dashboard's chat end to end in a real headless Chromium (Playwright), against one real
`omlx serve`: SmolLM2, a tiny random Llama, a tiny reasoning model, a tiny VLM and the tests'
MCP server.

Each test drives the page and checks what it shows, what the browser sent (the request bodies)
and what the server did (its log, its files, its status API). Screenshots at desktop and phone
width in light and dark are kept in the pytest tmp dir (and copied to /tmp/omlx-screens/).
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from omlx.models.default_model import provision_default_model
from tests.admin.conftest import needs_chromium, start_server, writable_model_dir
from tests.support.tiny_model import build_tiny_llama

LLM, THINKER, VLM = "tiny-llama", "tiny-thinker", "tiny-vlm"
SMOL = "SmolLM2-135M-Instruct"  # the real model: an answer that makes sense
MCP_SERVER = Path(__file__).resolve().parents[1] / "support" / "mcp_servers.py"
pytestmark = needs_chromium


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("chat-ui")
    models = writable_model_dir(tiny_model_dir, root)
    build_tiny_llama(models / THINKER, thinking=True, seed=1)
    provision_default_model(models)
    try:
        from tests.support.tiny_vlm import build_tiny_qwen2_vl

        build_tiny_qwen2_vl(models / VLM)
    except ImportError:  # without mlx-vlm: the image test skips
        pass
    config = root / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {"local": {"command": sys.executable, "args": [str(MCP_SERVER), "stdio"]}}}))
    srv = start_server(root / "home", models, "--model", LLM, "--mcp-config", str(config), "--prefill-step-size", "64")
    yield srv
    srv.stop()
    shutil.rmtree(root, ignore_errors=True)


def new_page(browser, server, **context_args):
    context = browser.new_context(viewport={"width": 1360, "height": 860}, **context_args)
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.base_url)
    p = context.new_page()
    p.set_default_timeout(30_000)
    p.problems = []  # console errors, page errors, requests to other hosts
    p.sent = []  # the chat completion bodies the page sent
    p.on("console", lambda m: p.problems.append(m.text) if m.type == "error" else None)
    p.on("pageerror", lambda e: p.problems.append(str(e)))

    def on_request(r):
        if not r.url.startswith((server.base_url, "data:", "blob:")):
            p.problems.append(f"external request {r.url}")
        if r.url.endswith("/v1/chat/completions"):
            p.sent.append(r.post_data_json)

    p.on("request", on_request)
    return p


@pytest.fixture(scope="module")
def page(browser, server):
    p = new_page(browser, server)
    yield p
    p.context.close()


def shot(page, screens: Path, name: str) -> None:
    page.wait_for_timeout(200)
    page.screenshot(path=str(screens / f"chat-{name}.png"))


def open_chat(page, server) -> None:
    page.goto(f"{server.base_url}/admin#/chat")
    page.wait_for_selector("#view[data-page='chat'] textarea[name=prompt]")
    page.wait_for_selector("select[name=model] option", state="attached")


def set_field(page, name: str, value: str) -> None:
    page.fill(f"[name={name}]", value)


def send(page, text: str) -> None:
    n = page.locator(".msg.assistant .meta").count()
    page.fill("textarea[name=prompt]", text)
    page.click("[data-action=send]")
    page.locator(".msg.assistant").nth(n).wait_for()
    wait_idle(page)


def wait_idle(page) -> None:
    page.locator("[data-action=send]").wait_for(timeout=60_000)


def answers(page) -> list[str]:
    return page.locator(".msg.assistant .bubble").all_inner_texts()


def raw_answers(page) -> list[str]:
    """The current chat's answers as generated (markdown), from the page's store."""
    return page.evaluate("""() => { const d = JSON.parse(localStorage.getItem(ChatStore.KEY));
      return ChatStore.path(d.chats.find((c) => c.id === d.current)).map((t) => t.variant.answer.content); }""")


FIRST = "Count from 1 to 20, separated by commas."


def test_chats_are_kept_in_the_browser_with_their_settings(page, server, screens):
    open_chat(page, server)
    page.select_option("select[name=model]", SMOL)
    set_field(page, "system", "You are terse.")
    set_field(page, "max_tokens", "12")
    set_field(page, "temperature", "0")
    send(page, FIRST)
    meta = page.locator(".msg.assistant .meta").last.inner_text()
    assert re.fullmatch(r"12 tokens · prefill [\d.]+ tok/s · decode [\d.]+ tok/s · TTFT [\d.]+ m?s · 0 of \d+ prompt tokens cached", meta), meta
    assert re.match(r"1\D+2", answers(page)[0]), answers(page)  # SmolLM2 counting, as the page shows it
    body = page.sent[-1]
    assert body["model"] == SMOL and body["max_tokens"] == 12 and body["temperature"] == 0 and body["stream"] is True
    assert body["messages"] == [{"role": "system", "content": "You are terse."}, {"role": "user", "content": FIRST}]
    assert "top_p" not in body  # blank: the model's default
    # a second turn resends the first as generated: the prefix cache restores it
    send(page, "and more")
    second = page.locator(".msg.assistant .meta").last.inner_text()
    cached = int(re.search(r"(\d+) of (\d+) prompt tokens cached", second).group(1))
    assert cached > 0, second
    assert page.sent[-1]["messages"][2] == {"role": "assistant", "content": raw_answers(page)[0]}
    # a second chat with other settings
    page.click("[data-action=new-chat]")
    page.wait_for_selector(".chat-empty")
    set_field(page, "system", "You are the second.")
    set_field(page, "max_tokens", "5")
    send(page, "second chat about zebras")
    assert page.sent[-1]["max_tokens"] == 5
    assert page.locator(".chat-items li").count() == 2
    # rename the first, search, delete the second
    first = page.locator(".chat-items li", has_text=FIRST)
    first.hover()
    first.locator("[data-action=rename-chat]").click()
    page.fill("input[name=chat-title]", "Renamed chat")
    page.press("input[name=chat-title]", "Enter")
    page.wait_for_selector(".chat-items li:has-text('Renamed chat')")
    page.fill("input[name=chat-search]", "zebras")
    assert page.locator(".chat-items li").all_inner_texts()[0].startswith("second chat about zebras")
    assert page.locator(".chat-items li").count() == 1
    page.fill("input[name=chat-search]", "")
    shot(page, screens, "desktop-light")
    # survive a reload: both chats, each with its own model, system prompt and settings
    page.reload()
    page.wait_for_selector(".chat-items li:has-text('Renamed chat')")
    assert page.input_value("textarea[name=system]") == "You are the second."
    assert page.input_value("input[name=max_tokens]") == "5"
    page.locator(".chat-items li:has-text('Renamed chat') .chat-item").click()
    page.wait_for_selector(f".msg.user:has-text('{FIRST}')")
    assert page.input_value("textarea[name=system]") == "You are terse."
    assert page.input_value("input[name=max_tokens]") == "12"
    assert page.input_value("select[name=model]") == SMOL
    assert len(answers(page)) == 2
    zebra = page.locator(".chat-items li", has_text="zebras")
    zebra.hover()
    zebra.locator("[data-action=delete-chat]").click()
    page.click("[data-confirm=yes]")
    page.wait_for_selector(".chat-items li:has-text('zebras')", state="detached")
    stored = page.evaluate("JSON.parse(localStorage.getItem(ChatStore.KEY))")
    assert [c["title"] for c in stored["chats"]] == ["Renamed chat"]


def test_turns_regenerate_edit_stop_and_copy(page, server):
    open_chat(page, server)
    page.locator(".chat-items li:has-text('Renamed chat') .chat-item").click()
    page.wait_for_selector(".msg.user:has-text('and more')")
    set_field(page, "temperature", "1.5")  # sampled: a regenerated answer differs
    before = answers(page)
    sent = len(page.sent)
    page.locator(".turn").nth(1).locator("[data-action=regenerate]").click()
    wait_idle(page)
    first_time = next(b for b in page.sent if b["messages"][-1]["content"] == "and more")
    assert page.sent[sent]["messages"] == first_time["messages"]  # the same conversation again
    tabs = page.locator(".turn").nth(1).locator(".variant-tabs [role=tab]")
    assert tabs.count() == 2 and tabs.nth(1).get_attribute("aria-selected") == "true"
    regenerated = answers(page)[1]
    tabs.nth(0).click()
    assert answers(page)[1] == before[1]
    tabs.nth(1).click()
    assert answers(page)[1] == regenerated
    # edit the first user message: a new variant of turn 0; the old branch (both turns) is kept
    page.locator(".turn").nth(0).locator("[data-action=edit]").click()
    assert page.input_value("textarea[name=prompt]") == FIRST
    page.fill("textarea[name=prompt]", "edited question")
    page.click("[data-action=send]")
    wait_idle(page)
    assert page.sent[-1]["messages"][-1] == {"role": "user", "content": "edited question"}
    assert len(page.sent[-1]["messages"]) == 2  # system + the edited message: nothing after it
    assert page.locator(".turn").count() == 1
    tabs0 = page.locator(".turn").nth(0).locator(".variant-tabs [role=tab]")
    assert tabs0.count() == 2
    tabs0.nth(0).click()
    assert page.locator(".turn").count() == 2 and page.locator(".msg.user .bubble").first.inner_text() == FIRST
    tabs0.nth(1).click()
    assert page.locator(".msg.user .bubble").first.inner_text() == "edited question"
    # copy an answer as markdown
    page.locator(".turn").nth(0).locator("[data-action=copy-answer]").click()
    page.wait_for_selector("[data-action=copy-answer]:has-text('Copied')")
    raw = page.evaluate("""() => { const d = JSON.parse(localStorage.getItem(ChatStore.KEY));
      return ChatStore.path(d.chats.find((c) => c.id === d.current))[0].variant.answer.content; }""")
    assert page.evaluate("navigator.clipboard.readText()") == raw  # the markdown, not the rendered text
    # stop a long answer: the page says so and the server cancels the request
    set_field(page, "max_tokens", "1900")
    set_field(page, "system", "You are terse and precise. " * 50)
    page.fill("textarea[name=prompt]", "Go on for a long time.")
    page.click("[data-action=send]")
    page.click("[data-action=stop]", timeout=5000)
    page.locator(".msg.assistant .meta:has-text('stopped')").wait_for()
    for _ in range(100):
        if "finish=cancelled" in server.log():
            break
        page.wait_for_timeout(100)
    assert "finish=cancelled" in server.log()
    # a stored answer with a fenced code block: rendered with a copy button that copies the code
    page.evaluate("""() => {
      const data = JSON.parse(localStorage.getItem(ChatStore.KEY));
      const chat = ChatStore.blank('tiny-llama');
      chat.title = 'code sample';
      const v = ChatStore.addTurn(chat, {text: 'show code', images: [], docs: []});
      Object.assign(v.answer, {content: 'Here:\\n\\n```python\\nprint(1)\\n```', streaming: false});
      data.chats.unshift(chat); data.current = chat.id;
      localStorage.setItem(ChatStore.KEY, JSON.stringify(data));
    }""")
    page.reload()
    page.wait_for_selector(".codeblock")
    page.click(".codeblock [data-copy]")
    page.wait_for_selector(".codeblock [data-copy]:has-text('Copied')")
    assert page.evaluate("navigator.clipboard.readText()") == "print(1)"
    assert page.locator(".codeblock .hljs-built_in, .codeblock .hljs-keyword").count() >= 1


def test_thinking_modes_figures_and_prefill_progress(page, server, screens):
    open_chat(page, server)
    page.click("[data-action=new-chat]")
    page.select_option("select[name=model]", THINKER)
    set_field(page, "system", "")
    set_field(page, "max_tokens", "24")
    page.select_option("select[name=thinking]", "budget")
    set_field(page, "thinking_budget", "8")
    send(page, "think about it")
    body = page.sent[-1]
    assert body["model"] == THINKER and body["thinking_budget"] == 8
    assert body["chat_template_kwargs"] == {"enable_thinking": True}
    answer = page.locator(".msg.assistant").last
    block = answer.locator("details.thinking")
    assert re.fullmatch(r"Thought for [\d.]+ m?s", block.locator("summary").inner_text()), block.inner_text()
    assert block.get_attribute("open") is None  # collapsed once the answer came
    block.locator("summary").click()
    assert block.locator(".thinking-text").inner_text().strip()
    meta = answer.locator(".meta").inner_text()
    assert re.search(r"^\d+ tokens · prefill [\d.]+ tok/s · decode [\d.]+ tok/s · TTFT .* · thinking [\d.]+ m?s$", meta), meta
    shot(page, screens, "thinking")
    # off: no thinking at all (the end marker forced at once)
    page.select_option("select[name=thinking]", "off")
    send(page, "do not think")
    assert page.sent[-1]["thinking_budget"] == 0 and page.sent[-1]["chat_template_kwargs"] == {"enable_thinking": False}
    assert page.locator(".msg.assistant").last.locator("details.thinking").count() == 0
    page.select_option("select[name=thinking]", "auto")
    send(page, "as you like")
    assert "thinking_budget" not in page.sent[-1] and "chat_template_kwargs" not in page.sent[-1]
    # a long prompt: its prefill position, polled from the status API, shows while it is computed
    page.select_option("select[name=model]", LLM)
    page.click("[data-action=new-chat]")
    set_field(page, "max_tokens", "2")
    seen: list[dict] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for m in httpx.get(server.base_url + "/v1/models/status", timeout=10).json()["data"]:
                seen.extend(m["requests"])
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        page.fill("textarea[name=prompt]", "ab " * 600)
        page.click("[data-action=send]")
        progress = page.locator(".msg.assistant .meta:has-text('tokens processed')")
        progress.wait_for(timeout=20_000)
        shown = progress.inner_text()
        wait_idle(page)
    finally:
        done.set()
        watcher.join()
    done_, total = (int(x.replace(",", "")) for x in re.fullmatch(r"Prompt: ([\d,]+) of ([\d,]+) tokens processed", shown).groups())
    assert 0 <= done_ < total
    mid = [r for r in seen if r["state"] == "prefilling" and 0 < r["prefilled_tokens"] < r["prompt_tokens"]]
    assert mid, seen[-5:]
    assert all(r["id"].startswith("chatcmpl-") and r["cached_tokens"] <= r["prefilled_tokens"] for r in mid)


def test_prompt_presets_are_profiles_stored_on_the_server(page, browser, server):
    open_chat(page, server)
    page.click("[data-action=new-chat]")
    page.select_option("select[name=model]", LLM)
    set_field(page, "system", "You translate to French.")
    set_field(page, "temperature", "0.3")
    set_field(page, "max_tokens", "4")
    page.click("[data-action=save-preset]")
    page.fill("input[name=preset-name]", "french")
    page.click("[data-action=preset-ok]")
    page.wait_for_selector(".toast:has-text('Preset french saved')")
    settings_file = server.home / "model_settings.json"
    profile = json.loads(settings_file.read_text())[LLM]["profiles"]["french"]
    assert profile == {"system_prompt": "You translate to French.", "temperature": 0.3, "max_tokens": 4}
    assert page.input_value("select[name=preset]") == "french"
    send(page, "bonjour")
    assert page.sent[-1]["model"] == f"{LLM}:french"
    assert page.sent[-1]["messages"][0] == {"role": "system", "content": "You translate to French."}
    # rename in place; "System default" is the model's own settings (no system prompt here)
    page.click("[data-action=rename-preset]")
    page.fill("input[name=preset-name]", "fr")
    page.click("[data-action=preset-ok]")
    page.wait_for_selector("select[name=preset] option[value=fr]", state="attached")
    assert list(json.loads(settings_file.read_text())[LLM]["profiles"]) == ["fr"]
    page.select_option("select[name=preset]", "")
    assert page.input_value("textarea[name=system]") == ""
    page.select_option("select[name=preset]", "fr")
    assert page.input_value("textarea[name=system]") == "You translate to French."
    # the server applies a profile's system prompt to any request that sends none
    def prompt_tokens(body: dict) -> int:
        r = httpx.post(server.base_url + "/api/cache/explain", json=body, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["prompt_tokens"]

    user = {"role": "user", "content": "bonjour"}
    with_profile = prompt_tokens({"model": f"{LLM}:fr", "messages": [user]})
    assert with_profile == prompt_tokens({"model": LLM, "messages": [{"role": "system", "content": "You translate to French."}, user]})
    assert with_profile > prompt_tokens({"model": LLM, "messages": [user]})
    # another browser sees it
    other = new_page(browser, server)
    try:
        open_chat(other, server)
        other.select_option("select[name=model]", LLM)
        other.wait_for_selector("select[name=preset] option[value=fr]", state="attached")
        assert other.locator(".chat-items li").count() == 1  # chats stay in their own browser
    finally:
        other.context.close()
    page.click("[data-action=delete-preset]")
    page.click("[data-confirm=yes]")
    page.wait_for_selector(".toast:has-text('Preset fr deleted')")
    assert json.loads(settings_file.read_text())[LLM].get("profiles", {}) == {}
    assert page.input_value("select[name=preset]") == ""


def test_theme_follows_the_system_or_the_choice_and_the_chat_fits_a_phone(browser, server, screens):
    p = new_page(browser, server, color_scheme="dark")
    try:
        open_chat(p, server)
        theme = lambda: p.evaluate("[document.documentElement.dataset.theme, document.getElementById('theme').textContent]")  # noqa: E731
        assert theme() == ["dark", "Theme: auto"]  # auto follows the system's dark scheme
        p.select_option("select[name=model]", LLM)
        set_field(p, "max_tokens", "16")
        send(p, "hello in the dark")
        shot(p, screens, "desktop-dark")
        bg = p.evaluate("getComputedStyle(document.querySelector('.chat-main')).backgroundColor")
        p.click("[data-action=theme]")
        assert theme() == ["light", "Theme: light"]
        assert p.evaluate("getComputedStyle(document.querySelector('.chat-main')).backgroundColor") != bg
        p.click("[data-action=theme]")
        assert theme() == ["dark", "Theme: dark"]
        p.emulate_media(color_scheme="light")
        p.reload()
        p.wait_for_selector("textarea[name=prompt]")
        assert theme() == ["dark", "Theme: dark"]  # the choice is kept, whatever the system says
        # phone width: the conversation alone; the chat list and the settings open over it
        p.set_viewport_size({"width": 390, "height": 844})
        p.wait_for_timeout(200)
        assert not p.is_visible(".chat-list") and not p.is_visible(".chat-settings")
        assert p.evaluate("document.documentElement.scrollWidth") <= 390  # nothing wider than the screen
        shot(p, screens, "phone-dark")
        p.click("[data-action=show-list]")
        assert p.is_visible(".chat-list") and p.is_visible(".chat-items li:has-text('hello in the dark')")
        shot(p, screens, "phone-dark-list")
        p.click("[data-action=show-list]")
        p.click("[data-action=show-settings]")
        assert p.is_visible("select[name=model]")
        p.click("[data-action=show-settings]")
        p.click("[data-action=theme]")  # auto again, the system now light
        assert theme() == ["light", "Theme: auto"]
        send(p, "hello on a phone")
        box = p.locator(".msg.assistant").last.bounding_box()
        assert box["x"] >= 0 and box["x"] + box["width"] <= 390
        shot(p, screens, "phone-light")
        assert [x for x in p.problems] == []
    finally:
        p.context.close()


def files(page, *items: tuple[str, str, bytes]) -> None:
    page.set_input_files("input[name=attach]", [{"name": n, "mimeType": t, "buffer": b} for n, t, b in items])


def test_images_and_documents_attached(page, server, screens):
    from tests.support.tiny_vlm import draw_png

    if not (server.home.parent / "models" / VLM).exists():
        pytest.skip("needs mlx-vlm (the vision extra) for the tiny VLM")
    pytest.importorskip("markitdown", reason="the documents extra (the test extra installs it)")
    from tests.admin.test_chat_api import tiny_pdf

    open_chat(page, server)
    page.click("[data-action=new-chat]")
    page.select_option("select[name=model]", LLM)
    png = draw_png("circle")
    files(page, ("circle.png", "image/png", png))  # a text model: refused in the page
    page.wait_for_selector(".toast:has-text('cannot read images')")
    assert page.locator(".composer .thumb").count() == 0
    page.select_option("select[name=model]", VLM)
    set_field(page, "max_tokens", "6")
    set_field(page, "system", "")
    files(page, ("circle.png", "image/png", png), ("square.png", "image/png", draw_png("square")))
    page.wait_for_selector(".composer .thumb >> nth=1")
    # a document by the picker, another dropped on the composer; an unreadable one is refused
    files(page, ("report.pdf", "application/pdf", tiny_pdf("Quarterly numbers rose")))
    page.wait_for_selector(".composer .doc-chip:has-text('report.pdf')")
    dropped = page.evaluate_handle("""() => { const dt = new DataTransfer();
      dt.items.add(new File(['# Dropped notes'], 'notes.md', {type: 'text/markdown'})); return dt; }""")
    page.dispatch_event(".composer", "drop", {"dataTransfer": dropped})
    page.wait_for_selector(".composer .doc-chip:has-text('notes.md')")
    files(page, ("broken.pdf", "application/pdf", b"%PDF-1.4 not really"))
    page.wait_for_selector(".toast:has-text('broken.pdf: Could not read broken.pdf as PDF')")
    shot(page, screens, "attachments")
    pasted = page.evaluate_handle("""b64 => { const dt = new DataTransfer();
      const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
      dt.items.add(new File([bytes], 'pasted.png', {type: 'image/png'})); return dt; }""", base64.b64encode(png).decode())
    page.evaluate("dt => document.querySelector('textarea[name=prompt]').dispatchEvent(new ClipboardEvent('paste', {clipboardData: dt, bubbles: true, cancelable: true}))", pasted)
    page.wait_for_selector(".composer .thumb >> nth=2")
    page.locator(".composer .thumb-x").nth(2).click()  # and removed again
    page.wait_for_selector(".composer .thumb >> nth=2", state="detached")
    send(page, "what is drawn?")
    content = page.sent[-1]["messages"][-1]["content"]
    assert [p["type"] for p in content] == ["text", "image_url", "image_url"]
    assert content[0]["text"].startswith('<document name="report.pdf">\nQuarterly numbers rose')
    assert '<document name="notes.md">\n# Dropped notes\n</document>' in content[0]["text"]
    assert content[0]["text"].endswith("what is drawn?")
    assert content[1]["image_url"]["url"].startswith("data:image/png;base64,")
    answer = page.locator(".msg.assistant").last
    assert answer.locator(".bubble.error").count() == 0 and "6 tokens" in answer.locator(".meta").inner_text()
    assert page.locator(".msg.user .thumb").count() == 2 and page.locator(".msg.user .doc-chip").count() == 2
    # edit it: the images and documents come along, one image removed
    page.locator(".turn").last.locator("[data-action=edit]").click()
    assert page.locator(".composer .thumb").count() == 2
    page.locator(".composer .thumb-x").first.click()
    page.fill("textarea[name=prompt]", "and now?")
    page.click("[data-action=send]")
    wait_idle(page)
    edited = page.sent[-1]["messages"][-1]["content"]
    assert [p["type"] for p in edited] == ["text", "image_url"] and edited[0]["text"].endswith("and now?")
    assert edited[1]["image_url"]["url"] == content[2]["image_url"]["url"]  # the square kept
    # at most 10 images a message
    files(page, *[(f"c{i}.png", "image/png", png) for i in range(11)])
    page.wait_for_selector(".toast:has-text('At most 10 images')")
    assert page.locator(".composer .thumb").count() == 10


def test_mcp_tools_called_through_the_server_loop(page, server, screens):
    open_chat(page, server)
    page.click("[data-action=new-chat]")
    page.select_option("select[name=model]", LLM)
    set_field(page, "max_tokens", "128")  # a forced call in the tiny model's small tokens
    page.wait_for_selector("input[name=tool-pick]", state="attached")
    listed = page.locator(".tool-list li").all_inner_texts()
    assert any(t.startswith("pick") and "Pick a color" in t for t in listed)
    page.check("input[name=tools]")
    for name in ("echo", "slow", "fail", "crash"):
        page.uncheck(f"input[name=tool-{name}]")
    page.check("input[name=tools_require]")
    send(page, "pick a color")
    body = page.sent[-1]
    assert body["mcp"] == {"tools": ["pick"]} and body["tool_choice"] == "required"
    call = page.locator(".msg.assistant").last.locator("details.tool-call[data-tool=pick]")
    call.locator("summary").click()
    assert json.loads(call.locator(".tool-part pre").first.inner_text())["color"] in ("red", "green")
    result = call.locator(".tool-result").inner_text()
    assert re.fullmatch(r"picked (red|green) at \d+", result), result
    assert page.locator(".msg.assistant").last.locator(".bubble.error").count() == 0
    shot(page, screens, "tools")
    # the next turn sends the round the server ran before the answer
    page.uncheck("input[name=tools]")
    set_field(page, "max_tokens", "4")
    send(page, "thanks")
    msgs = page.sent[-1]["messages"]
    kinds = [(m["role"], bool(m.get("tool_calls"))) for m in msgs]
    assert kinds[:3] == [("user", False), ("assistant", True), ("tool", False)], kinds
    assert msgs[2]["content"] == result and "mcp" not in page.sent[-1]


def test_no_console_errors_and_nothing_fetched_from_outside(page):
    # expected: the browser logs the 400 of the unreadable PDF the attachment test sent
    problems = [p for p in page.problems if "status of 400" not in p]
    assert problems == []
