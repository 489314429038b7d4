"""Why a request missed the prefix cache, through a real server: `POST /api/cache/explain` predicts what
the request then restores, the usage's `omlx` field (read by the official SDKs) and the log line say
the same, /metrics counts it, and each reason the cache can tell is named."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from omlx.cache.plan.why import Reason
from omlx.platform_info import discrete_gpu
from tests.support.server import ServerProcess

MODEL = "tiny-llama"
BLOCK = 64
SYSTEM = "You are a careful assistant. " + " ".join(f"rule {i}: answer plainly." for i in range(12))


def messages(user: str, system: str = SYSTEM) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def start(home: Path, model_dir: Path, *extra: str) -> ServerProcess:
    server = ServerProcess(home, ["--model-dir", str(model_dir), "--model", MODEL, "--cache-block-size", str(BLOCK), *extra])
    server.start()
    return server


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """No SSD and a hot tier of 8 blocks (256 KiB each): blocks pushed out are gone."""
    home = tmp_path_factory.mktemp("explain")
    s = start(home, tiny_model_dir, "--hot-cache-only", "--hot-cache-max-size", "2MiB")
    yield s
    s.stop()
    shutil.rmtree(home, ignore_errors=True)


def explain(server: ServerProcess, headers: dict | None = None, **body) -> httpx.Response:
    return httpx.post(server.base_url + "/api/cache/explain", json={"model": MODEL, **body}, headers=headers, timeout=60)


def chat(server: ServerProcess, user: str, system: str = SYSTEM) -> openai.types.chat.ChatCompletion:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    return client.chat.completions.create(model=MODEL, messages=messages(user, system), max_tokens=4, temperature=0)


def omlx_of(usage) -> dict:
    """The usage's extra field as the SDK parsed it (pydantic keeps unknown fields)."""
    return usage.model_extra["omlx"]["cache"]


def scrape(server: ServerProcess) -> dict[tuple[str, tuple], float]:
    text = httpx.get(server.base_url + "/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("omlx_prefix_cache")
    }


def log_line(server: ServerProcess, request_id: str, timeout: float = 10.0) -> str:
    deadline = time.time() + timeout
    while True:
        found = [line for line in server.log().splitlines() if f"request={request_id} " in line]
        if found or time.time() > deadline:
            assert found, f"no log line for {request_id}"
            return found[0]
        time.sleep(0.05)


def test_explain_predicts_what_the_request_then_restores(server: ServerProcess) -> None:
    user = "the first question"
    before = explain(server, messages=messages(user)).json()
    assert (before["reason"], before["cached_tokens"], before["tiers"]) == ("no_prefix", 0, {})
    first = chat(server, user)
    assert omlx_of(first.usage) == {k: v for k, v in before.items() if k not in ("model", "prompt_tokens", "plan")}
    predicted = explain(server, messages=messages(user)).json()
    assert predicted["prompt_tokens"] == first.usage.prompt_tokens
    assert predicted["plan"]["runs"][0] == {**predicted["plan"]["runs"][0], "tier": "hot", "restore": True}
    if not discrete_gpu():  # a CUDA GPU restores whole blocks only (the prefill grid): not all but one token
        assert predicted["reason"] == "none" and predicted["cached_tokens"] == first.usage.prompt_tokens - 1
    metrics_before = scrape(server)
    again = chat(server, user)
    report = omlx_of(again.usage)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == predicted["cached_tokens"] == report["cached_tokens"] > 0
    assert report["reason"] == predicted["reason"] and report["tiers"]["hot"]["tokens"] == cached
    assert report["tiers"]["hot"]["bytes"] > 0 and report["computed_tokens"] == again.usage.prompt_tokens - cached
    # the log line says the same (written on the engine thread just after the last event left it)
    line = log_line(server, again.id)
    assert f"restored=hot:{cached} computed={again.usage.prompt_tokens - cached}:{report['reason']}" in line
    # /metrics counted it, by tier and by reason (recorded right after the log line)
    tier = (("model", MODEL), ("tier", "hot"))
    reason = (("model", MODEL), ("reason", report["reason"]))
    counted = ("omlx_prefix_cache_requests_total", reason)
    deadline = time.time() + 10
    while (after := scrape(server)).get(counted, 0) == metrics_before.get(counted, 0) and time.time() < deadline:
        time.sleep(0.05)
    assert after[("omlx_prefix_cache_restored_tokens_total", tier)] - metrics_before.get(
        ("omlx_prefix_cache_restored_tokens_total", tier), 0) == cached  # fmt: skip
    assert after[("omlx_prefix_cache_restored_bytes_total", tier)] - metrics_before.get(
        ("omlx_prefix_cache_restored_bytes_total", tier), 0) == report["tiers"]["hot"]["bytes"]  # fmt: skip
    assert after[("omlx_prefix_cache_requests_total", reason)] - metrics_before.get(
        ("omlx_prefix_cache_requests_total", reason), 0) == 1  # fmt: skip


def test_a_changed_history_is_a_divergence_at_the_first_differing_token(server: ServerProcess) -> None:
    chat(server, "alpha beta gamma delta")
    report = explain(server, messages=messages("alpha beta GAMMA delta")).json()
    assert report["reason"] == "diverged", report
    assert 0 < report["cached_tokens"] < report["prompt_tokens"] - 1
    assert f"from token {report['cached_tokens']} with other tokens" in report["detail"]


def test_the_anthropic_sdk_a_stream_and_the_responses_api_carry_the_field(server: ServerProcess) -> None:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused")
    user = "an anthropic question"
    first = client.messages.create(model=MODEL, max_tokens=4, system=SYSTEM, messages=[{"role": "user", "content": user}])
    again = client.messages.create(model=MODEL, max_tokens=4, system=SYSTEM, messages=[{"role": "user", "content": user}])
    assert omlx_of(first.usage)["cached_tokens"] == first.usage.cache_read_input_tokens
    assert omlx_of(again.usage)["cached_tokens"] == again.usage.cache_read_input_tokens > 0
    oai = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    chunks = list(oai.chat.completions.create(
        model=MODEL, messages=messages(user), max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    usage = chunks[-1].usage
    assert omlx_of(usage)["cached_tokens"] == usage.prompt_tokens_details.cached_tokens > 0
    response = oai.responses.create(model=MODEL, instructions=SYSTEM, input=user, max_output_tokens=4, temperature=0)
    assert omlx_of(response.usage)["cached_tokens"] == response.usage.input_tokens_details.cached_tokens
    assert omlx_of(response.usage)["reason"] in {r.value for r in Reason}


def test_blocks_pushed_out_of_every_tier_are_evicted(server: ServerProcess) -> None:
    system = "A system prompt of its own. " + "Keep it. " * 30
    chat(server, "remember me", system=system)
    for i in range(4):  # each ~4 blocks: the 8-block hot tier lets the first prompt go
        chat(server, f"question {i}", system=f"variant {i} of another system prompt. " * 12)
    report = explain(server, messages=messages("remember me", system)).json()
    assert (report["reason"], report["cached_tokens"]) == ("evicted", 0), report


def test_bad_input_is_a_400_that_names_the_field(server: ServerProcess) -> None:
    for body, field in (({}, "messages"), ({"prompt": "x", "messages": messages("x")}, "messages"),
                        ({"prompt": [10**9]}, "prompt"), ({"prompt": ""}, "prompt")):  # fmt: skip
        r = explain(server, **body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)
    r = httpx.post(server.base_url + "/api/cache/explain", json={"prompt": "x"}, timeout=10)
    assert r.status_code == 400 and "model" in r.json()["error"]["message"]
    assert explain(server, model="no-such-model", prompt="x").status_code == 404
    text = explain(server, prompt="plain text to complete").json()
    assert text["prompt_tokens"] > 0 and text["reason"] in {"no_prefix", "diverged", "grain"}


def test_a_changed_build_is_named_after_a_restart(tiny_model_dir: Path, tmp_path: Path) -> None:
    key = {"Authorization": "Bearer sekrit"}
    first = start(tmp_path / "home", tiny_model_dir, "--api-key", "sekrit")
    try:
        body = {"model": MODEL, "messages": messages("kept on the SSD"), "max_tokens": 2, "temperature": 0}
        assert httpx.post(first.base_url + "/v1/chat/completions", json=body, headers=key, timeout=60).status_code == 200
        deadline = time.time() + 30
        while httpx.get(first.base_url + "/api/cache/stats", headers=key).json()["ssd"]["blocks"] < 1:
            assert time.time() < deadline, "no block reached the SSD"
            time.sleep(0.1)
    finally:
        first.stop()
    # another block size is another build: the old blocks can never be served
    second = ServerProcess(tmp_path / "home", ["--model-dir", str(tiny_model_dir), "--model", MODEL,
                                               "--cache-block-size", str(BLOCK // 2), "--api-key", "sekrit"])  # fmt: skip
    second.start()
    try:
        assert explain(second, messages=messages("kept on the SSD")).status_code == 401  # the admin API's auth
        report = explain(second, headers=key, messages=messages("kept on the SSD")).json()
        assert (report["reason"], report["cached_tokens"]) == ("fingerprint", 0), report
        assert re.search(r"another build of this model", report["detail"])
    finally:
        second.stop()
