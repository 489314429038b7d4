"""Prompt-lookup speculation through a real `omlx serve` on the real SmolLM2 in float32: greedy
and seeded sampled output, logprobs, stop strings, `max_tokens` and streams are what the same
server gives without speculation, alone and in a batch, while drafts are verified and accepted
(docs/design/speculation.md)."""

from __future__ import annotations

import re
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.support.server import ServerProcess
from tests.support.tiny_model import build_tiny_draft

SMOL = "SmolLM2-135M-Instruct"
DRAFT = "smol-draft"  # tiny, random weights, SmolLM2's tokenizer
# prompts whose answers repeat the prompt (drafts accepted) and one that does not
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\nRename the function add to plus and return the whole code."
COUNT = "Count from 1 to 40, separated by commas."
FRUIT = (
    "Here is a list:\n1. apples\n2. bananas\n3. cherries\n4. dates\n5. elderberries\n"
    "Rewrite the list in the same order, adding the word 'fresh' before each fruit."
)
FREE = "What is the capital of France?"
PROMPTS = [CODE, COUNT, FRUIT, FREE]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    """(with speculation and the hot prefix cache, without speculation and without a cache)."""
    from omlx.models.default_model import provision_default_model

    root = tmp_path_factory.mktemp("spec-models")
    provision_default_model(root)
    build_tiny_draft(root / DRAFT, root / SMOL)  # a draft model with SmolLM2's tokenizer
    homes = [tmp_path_factory.mktemp("spec-home"), tmp_path_factory.mktemp("plain-home")]
    spec = ServerProcess(homes[0], ["--model-dir", str(root), "--model", SMOL, "--hot-cache-only", "--draft-max", "8",
                                    "--log-level", "debug"])  # fmt: skip
    plain = ServerProcess(homes[1], ["--model-dir", str(root), "--model", SMOL, "--no-cache", "--no-speculation"])
    spec.start()
    plain.start()
    yield spec, plain
    spec.stop()
    plain.stop()
    for home in homes:
        shutil.rmtree(home, ignore_errors=True)


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=300)


def ask(server: ServerProcess, prompt: str, **kwargs) -> tuple[str, list[str], list[float], str]:
    """(text, tokens, their logprobs, finish reason) of a greedy chat answer."""
    kwargs = {"max_tokens": 80, **kwargs}
    r = client(server).chat.completions.create(
        model=SMOL, messages=[{"role": "user", "content": prompt}], temperature=0, logprobs=True, **kwargs
    )
    choice = r.choices[0]
    content = choice.logprobs.content if choice.logprobs is not None and choice.logprobs.content else []
    return choice.message.content, [t.token for t in content], [t.logprob for t in content], choice.finish_reason


def spec_counters(server: ServerProcess) -> tuple[float, float]:
    text = httpx.get(server.base_url + "/metrics").text

    def value(name: str) -> float:  # a model's series starts with its first finished request
        assert f"# HELP {name}" in text
        m = re.search(rf'^{name}_total{{model="{SMOL}"}} (\S+)$', text, re.M)
        return float(m.group(1)) if m is not None else 0.0

    return value("omlx_spec_decode_num_draft_tokens"), value("omlx_spec_decode_num_accepted_tokens")


def test_greedy_answers_and_logprobs_are_unchanged_while_drafts_are_accepted(servers):
    spec, plain = servers
    before = spec_counters(spec)
    for prompt in PROMPTS:
        text, tokens, logprobs, finish = ask(spec, prompt)
        ref_text, ref_tokens, ref_logprobs, ref_finish = ask(plain, prompt)
        assert (text, tokens, finish) == (ref_text, ref_tokens, ref_finish), prompt
        assert logprobs == pytest.approx(ref_logprobs, abs=2e-3)
    drafted, accepted = (a - b for a, b in zip(spec_counters(spec), before, strict=True))
    assert drafted > 0 and accepted > drafted / 3, (drafted, accepted)
    assert spec_counters(plain) == (0, 0)
    lines = [line for line in spec.log().splitlines() if "request=" in line and " drafted=" in line]
    assert lines and all(re.search(r" drafted=\d+ accepted=\d+", line) for line in lines)


def test_stop_strings_and_max_tokens_end_where_they_would_without_speculation(servers):
    spec, plain = servers
    for kwargs in ({"max_tokens": 1}, {"max_tokens": 2}, {"max_tokens": 7}, {"max_tokens": 33}, {"stop": ["15"]}, {"stop": [", 2"]}):
        got = ask(spec, COUNT, **kwargs)
        want = ask(plain, COUNT, **kwargs)
        assert (got[0], got[1], got[3]) == (want[0], want[1], want[3]), kwargs


def test_a_stream_carries_the_accepted_tokens_several_per_event(servers):
    spec, plain = servers
    chunks = list(
        client(spec).chat.completions.create(
            model=SMOL, messages=[{"role": "user", "content": COUNT}], temperature=0, max_tokens=80,
            logprobs=True, stream=True,
        )
    )  # fmt: skip
    per_event = [len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs]
    assert max(per_event) > 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ask(plain, COUNT)[0]


def test_mixed_batches_and_cached_turns_answer_as_without_speculation(servers):
    spec, plain = servers
    want = {p: ask(plain, p)[:2] for p in PROMPTS}
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # one speculates alone, then all share the batch
        got = dict(zip(PROMPTS, pool.map(lambda p: ask(spec, p)[:2], PROMPTS), strict=True))
    assert got == want
    # a next turn restores the previous answer from the prefix cache: only accepted tokens were stored
    turn = [{"role": "user", "content": CODE}, {"role": "assistant", "content": want[CODE][0]},
            {"role": "user", "content": "Now rename sub to minus and return the whole code."}]  # fmt: skip
    answers = [
        client(s).chat.completions.create(model=SMOL, messages=turn, temperature=0, max_tokens=60) for s in (spec, plain)
    ]
    assert answers[0].usage.prompt_tokens_details.cached_tokens > 0
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content


def test_biased_requests_step_aside(servers):
    spec, _ = servers
    before = spec_counters(spec)
    r = client(spec).chat.completions.create(
        model=SMOL, messages=[{"role": "user", "content": COUNT}], max_tokens=40, temperature=0, logit_bias={"11": 1.0}
    )
    assert r.usage.completion_tokens > 0
    assert spec_counters(spec) == before


def sampled(server: ServerProcess, prompt: str, **kwargs) -> str:
    r = client(server).chat.completions.create(
        model=SMOL, messages=[{"role": "user", "content": prompt}], max_tokens=60, **kwargs
    )
    return r.choices[0].message.content


def test_seeded_sampled_answers_are_those_without_speculation_alone_and_in_a_batch(servers):
    """A seeded request draws each output position with a key of its own, so its answer does not
    depend on how speculation grouped the tokens: the plain server's answer, while drafts were
    accepted (rejection sampling; the distribution's test is tests/unit/test_spec_batch.py)."""
    spec, plain = servers
    asks = [(prompt, {"temperature": 0.7, "top_p": 0.95, "seed": seed}) for prompt in (CODE, FRUIT, COUNT) for seed in (1, 2)]
    want = [sampled(plain, prompt, **kw) for prompt, kw in asks]
    before = spec_counters(spec)
    assert [sampled(spec, prompt, **kw) for prompt, kw in asks] == want  # alone: the solo path
    drafted, accepted = (a - b for a, b in zip(spec_counters(spec), before, strict=True))
    assert drafted > 0 and accepted > 0, (drafted, accepted)
    with ThreadPoolExecutor(len(asks)) as pool:  # together: rows of the batch's verify
        assert list(pool.map(lambda a: sampled(spec, a[0], **a[1]), asks)) == want


def test_top_p_and_min_p_change_sampled_output(servers):
    """With one seed, a hot temperature wanders from the greedy answer; top_p or min_p that keep
    only the likeliest token bring it back."""
    _, plain = servers
    greedy = sampled(plain, FREE, temperature=0)
    hot = {"temperature": 1.5, "seed": 7}
    assert sampled(plain, FREE, **hot) != greedy
    assert sampled(plain, FREE, **hot, top_p=0.01) == greedy
    assert sampled(plain, FREE, **hot, extra_body={"min_p": 0.99}) == greedy


def test_a_models_own_setting_turns_speculation_off_at_its_next_load(servers):
    spec, _ = servers
    base = spec.base_url
    r = httpx.put(f"{base}/api/models/{SMOL}/settings", json={"speculation": False}, timeout=10)
    assert r.status_code == 200 and r.json()["settings"]["speculation"] is False
    try:
        reload(spec)
        before = spec_counters(spec)
        assert ask(spec, COUNT, max_tokens=40)[3] == "length"
        assert spec_counters(spec) == before
    finally:
        httpx.put(f"{base}/api/models/{SMOL}/settings", json={"speculation": None}, timeout=10)
        reload(spec)
    before = spec_counters(spec)
    ask(spec, COUNT, max_tokens=40)
    assert spec_counters(spec)[0] > before[0]


def step_counts(server: ServerProcess) -> dict:
    """The model's decode-step counters (`step_times` in /v1/models/status)."""
    data = httpx.get(server.base_url + "/v1/models/status", timeout=30).json()["data"]
    return next(m for m in data if m["id"] == SMOL)["step_times"]


LETTERS = "Write the letters of the alphabet from A to Z, one per line, each followed by a dot."
LIST = "Repeat this list twice: red, green, blue, yellow, purple, orange."


def test_batch_rows_verify_their_drafts_in_shared_steps_and_answer_as_without_speculation(servers):
    """Rows with and without drafts decode side by side; each verified its own draft and rolled back
    its own rejected tokens, so each answers as the plain server answers it alone."""
    spec, plain = servers
    prompts = [*PROMPTS, LETTERS, LIST]
    want = {p: ask(plain, p)[:2] for p in prompts}
    before = step_counts(spec)
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = dict(zip(prompts, pool.map(lambda p: ask(spec, p)[:2], prompts), strict=True))
    after = step_counts(spec)
    assert got == want
    d = {k: after[k] - before[k] for k in ("loops", "rows", "verify_loops", "verify_rows")}
    assert d["rows"] / d["loops"] >= 2, d  # the requests shared decode steps (some answers are short)
    assert d["verify_loops"] >= 3 and d["verify_rows"] / d["verify_loops"] >= 2, d  # drafts verified in shared steps
    # the verify loops' own split of their time is part of the whole one's
    verify = {p: after[f"verify_{p}_s"] - before[f"verify_{p}_s"] for p in ("graph_build", "device_wait", "host")}
    whole = {p: after[f"{p}_s"] - before[f"{p}_s"] for p in verify}
    assert all(0 < verify[p] <= whole[p] for p in ("graph_build", "device_wait")), (verify, whole)
    assert verify["host"] <= whole["host"], (verify, whole)


def test_a_biased_row_joining_the_batch_leaves_the_greedy_rows_answers_unchanged(servers):
    """A request with a logit bias (which does not speculate) arriving mid-way sends the rows
    decoding with drafts back to mlx-lm's batch until it ends, then they draft again; the greedy
    rows answer as they do alone."""
    spec, plain = servers
    greedy = [COUNT, LETTERS, LIST]
    want = {p: ask(plain, p)[:2] for p in greedy}
    seen = len(spec.log_path.read_text(errors="replace"))
    started = threading.Event()

    def streamed(prompt: str) -> tuple[str, list[str]]:
        """The greedy answer, streamed; `started` once it is well under way."""
        text, tokens = "", []
        for chunk in client(spec).chat.completions.create(
            model=SMOL, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=80,
            logprobs=True, stream=True,
        ):  # fmt: skip
            if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
                text += chunk.choices[0].delta.content or ""
                tokens += [t.token for t in chunk.choices[0].logprobs.content]
                if len(tokens) >= 12:
                    started.set()
        return text, tokens

    def biased() -> int:
        assert started.wait(120)
        r = client(spec).chat.completions.create(
            model=SMOL, messages=[{"role": "user", "content": CODE}], temperature=0, logit_bias={"11": 1.0}, max_tokens=8
        )
        return r.usage.completion_tokens

    with ThreadPoolExecutor(len(greedy) + 1) as pool:
        late = pool.submit(biased)
        got = dict(zip(greedy, pool.map(streamed, greedy), strict=True))
        assert late.result() > 0
    assert got == want
    after = spec.log_path.read_text(errors="replace")[seen:]
    back = after.find("batch rows stop drafting")  # the biased row sent them back
    assert back >= 0 and "batch rows move to the SpecBatch" in after[back:]  # and they returned


def reload(server: ServerProcess) -> None:
    assert httpx.post(f"{server.base_url}/v1/models/{SMOL}/unload", timeout=60).status_code == 200
    assert httpx.post(f"{server.base_url}/v1/models/{SMOL}/load", timeout=120).status_code == 200


def set_draft(server: ServerProcess, name: str | None) -> None:
    r = httpx.put(f"{server.base_url}/api/models/{SMOL}/settings", json={"draft_model": name}, timeout=10)
    assert r.status_code == 200 and r.json()["settings"]["draft_model"] == name, r.text


def drafting_model(server: ServerProcess) -> str | None:
    data = httpx.get(server.base_url + "/v1/models/status", timeout=30).json()["data"]
    return next(m for m in data if m["id"] == SMOL)["draft_model"]


def test_a_draft_model_keeps_the_answers_and_drafting_for_itself_accepts_its_drafts(servers):
    """`draft_model`: a tiny random draft (mostly rejected) and the model drafting for itself
    (every greedy draft accepted: the method's own overhead) leave greedy and seeded answers as
    the server without speculation gives them; a setting naming no model is a 400 at load."""
    spec, plain = servers
    greedy = {p: ask(plain, p, max_tokens=40)[:2] for p in (CODE, FREE)}
    seeded = {"temperature": 0.7, "seed": 4}
    want_sampled = sampled(plain, CODE, **seeded)
    try:
        for draft in (DRAFT, SMOL):
            set_draft(spec, draft)
            reload(spec)
            assert drafting_model(spec) == draft
            before = spec_counters(spec)
            assert {p: ask(spec, p, max_tokens=40)[:2] for p in greedy} == greedy, draft
            drafted, accepted = (a - b for a, b in zip(spec_counters(spec), before, strict=True))
            assert sampled(spec, CODE, **seeded) == want_sampled, draft
            assert drafted > 0, draft
            if draft == SMOL:
                assert accepted >= 0.95 * drafted, (drafted, accepted)  # near-ties aside, all of them
            else:
                assert accepted < 0.5 * drafted, (drafted, accepted)
        set_draft(spec, "no-such-model")
        assert httpx.post(f"{spec.base_url}/v1/models/{SMOL}/unload", timeout=60).status_code == 200
        r = httpx.post(f"{spec.base_url}/v1/chat/completions", timeout=60,
                       json={"model": SMOL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})  # fmt: skip
        assert r.status_code == 400 and "draft_model 'no-such-model'" in r.json()["error"]["message"], r.text
    finally:
        set_draft(spec, None)
        reload(spec)
    assert drafting_model(spec) is None
