"""`SpecBatch` on a tiny random Llama (CPU float32): rows of different lengths verify drafts of their
own (right, wrong from some token on, none) in one forward pass, and each row's tokens, logprobs and
cache are what the row decoded alone gives, step after step; rows join, leave and finish mid-draft."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from omlx.engine.request import GenerationRequest, SamplingParams
from omlx.engine.request_state import RequestState
from omlx.engine.spec_batch import SpecBatch
from omlx.engine.verify_cost import VerifyCost

N = 14  # tokens each row generates


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path):
    from mlx_lm import load

    return load(str(tiny_model_dir / "tiny-llama"))[0]


def prompt(seed: int, n: int) -> list[int]:
    """Token ids inside the tiny model's vocabulary (408 ids: one past it reads outside the
    embedding table, whatever memory lies there)."""
    return [(seed * 31 + i * 17) % 400 + 3 for i in range(n)]


def alone(model, tokens: list[int], n: int) -> tuple[list[int], list[mx.array]]:
    """Greedy tokens and logprobs of `tokens` decoded alone, one token a step."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([tokens]), cache=cache)[0, -1]
    out, lps = [], []
    for _ in range(n):
        lp = logits - mx.logsumexp(logits)
        out.append(int(mx.argmax(lp).item()))
        lps.append(lp)
        logits = model(mx.array([[out[-1]]]), cache=cache)[0, -1]
    return out, lps


def prefilled(model, tokens: list[int]) -> list:
    cache = make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


class Scripted:
    """A `PromptLookup` stand-in: drafts the row's true continuation, `length` long, wrong from
    `wrong` on (None: right), or nothing (`length` 0)."""

    def __init__(self, prompt: list[int], truth: list[int], length: int, wrong: int | None) -> None:
        self.tokens: list[int] = list(prompt[:-1])
        self.prompt_len, self.truth, self.length, self.wrong = len(prompt), truth, length, wrong
        self.resting = length == 0
        self.drafted = self.kept = 0

    def extend(self, tokens: list[int]) -> None:
        self.tokens += tokens

    def draft(self, limit: int) -> list[int]:
        at = len(self.tokens) - self.prompt_len  # the truth index of the token after the unfed one
        draft = self.truth[at : at + min(limit, self.length)]
        if self.wrong is not None and self.wrong < len(draft):
            draft[self.wrong] = (draft[self.wrong] + 1) % 400 + 3
        return draft

    def accepted(self, drafted: int, kept: int) -> None:
        self.drafted += drafted
        self.kept += kept


class Unpriced(VerifyCost):
    """Every draft verified whole, whatever the steps cost."""

    def cap(self, rows: list[tuple[float, int]]) -> int:
        return max((n for _, n in rows), default=0)


def spec_batch(model, eos_ids: list[int]) -> SpecBatch:
    return SpecBatch(lambda: model, eos_ids, draft_max=8, cost=Unpriced())


def state(rid: str, tokens: list[int], max_tokens: int = N) -> RequestState:
    s = RequestState(GenerationRequest(rid, tokens, max_tokens, SamplingParams(temperature=0.0)))
    s.spec_aside = None
    return s


def run(batch: SpecBatch, got: dict[str, list]) -> None:
    """Step until every row finished; each token's (token, logprobs, finish, cache, all tokens)."""
    while batch:
        for out in batch.step():
            out.state.completion_tokens += 1
            got[out.state.id].append(out)


def test_rows_with_and_without_drafts_roll_back_their_own_rejected_tokens(model) -> None:
    # (prompt length, draft length, first wrong draft token): all right, wrong at once, wrong later, none
    plans = [(7, 4, None), (3, 3, 0), (12, 5, 2), (5, 0, None), (9, 8, 5)]
    prompts = [prompt(i, n) for i, (n, _, _) in enumerate(plans)]
    truths = [alone(model, p, N + 1) for p in prompts]
    batch = spec_batch(model, [])
    got: dict[str, list] = {}
    for i, (p, (_, length, wrong)) in enumerate(zip(prompts, plans, strict=True)):
        got[f"r{i}"] = []
        lookup = Scripted(p, truths[i][0], length, wrong)
        batch.add(state(f"r{i}", p), prefilled(model, p[:-1]), p[:-1], p[-1], lookup)  # type: ignore[arg-type]
    steps = {key: 0 for key in got}  # the steps that made tokens for each row
    while batch:
        outs = batch.step()
        for key in {out.state.id for out in outs}:
            steps[key] += 1
        for out in outs:
            out.state.completion_tokens += 1
            got[out.state.id].append(out)
    assert steps["r3"] == N and steps["r0"] < N / 2 and steps["r1"] == N  # drafts accepted where right
    for i, p in enumerate(prompts):
        outs = got[f"r{i}"]
        tokens, lps = truths[i]
        assert [o.token for o in outs] == tokens[:N], i
        for o, lp in zip(outs, lps, strict=False):
            assert mx.allclose(o.logprobs, lp, atol=1e-4).item(), i
        last = outs[-1]
        assert last.finish_reason == "length" and all(o.finish_reason is None for o in outs[:-1])
        # the finished row's cache holds the tokens before its last one, as computed alone
        assert last.all_tokens == p + tokens[: N - 1]
        ref = prefilled(model, last.all_tokens)
        for c, r in zip(last.prompt_cache, ref, strict=True):
            assert c.offset == len(last.all_tokens)
            n = c.offset
            assert mx.allclose(c.keys[..., :n, :], r.keys[..., :n, :], atol=1e-4).item()
            assert mx.allclose(c.values[..., :n, :], r.values[..., :n, :], atol=1e-4).item()


def test_a_stop_token_inside_an_accepted_draft_ends_the_row_there(model) -> None:
    p, q = prompt(1, 6), prompt(2, 10)
    truth_p, truth_q = alone(model, p, N)[0], alone(model, q, N)[0]
    stop_at = 5  # the row's sixth token ends it, in the middle of an accepted draft
    batch = spec_batch(model, [truth_p[stop_at]])
    assert truth_p[stop_at] not in truth_p[:stop_at]
    batch.add(state("p", p), prefilled(model, p[:-1]), p[:-1], p[-1], Scripted(p, truth_p, 8, None))  # type: ignore[arg-type]
    batch.add(state("q", q), prefilled(model, q[:-1]), q[:-1], q[-1], Scripted(q, truth_q, 2, 1))  # type: ignore[arg-type]
    got: dict[str, list] = {"p": [], "q": []}
    run(batch, got)
    assert [o.token for o in got["p"]] == truth_p[: stop_at + 1]
    assert got["p"][-1].finish_reason == "stop" and got["p"][-1].all_tokens == p + truth_p[:stop_at]
    assert [o.token for o in got["q"]] == truth_q[:N]


def test_rows_join_and_leave_between_steps_and_go_on_alone_where_they_stopped(model) -> None:
    p, q, r = prompt(3, 8), prompt(4, 4), prompt(5, 11)
    truths = {k: alone(model, v, N)[0] for k, v in (("p", p), ("q", q), ("r", r))}
    batch = spec_batch(model, [])
    states = {"p": state("p", p), "q": state("q", q), "r": state("r", r)}
    got: dict[str, list] = {"p": [], "q": [], "r": []}
    for key, tokens, length, wrong in (("p", p, 3, 1), ("q", q, 4, None)):
        batch.add(states[key], prefilled(model, tokens[:-1]), tokens[:-1], tokens[-1], Scripted(tokens, truths[key], length, wrong))  # type: ignore[arg-type]
    for _ in range(2):
        for out in batch.step():
            out.state.completion_tokens += 1
            got[out.state.id].append(out)
    batch.add(states["r"], prefilled(model, r[:-1]), r[:-1], r[-1], Scripted(r, truths["r"], 6, 3))  # type: ignore[arg-type]
    for out in batch.step():
        out.state.completion_tokens += 1
        got[out.state.id].append(out)
    found = batch.remove(states["p"])
    assert found is not None and batch.remove(states["p"]) is None
    cache, fed, unfed = found
    done = [o.token for o in got["p"]]
    assert fed == p + done[:-1] and unfed == done[-1] and cache[0].offset == len(fed)
    # the row goes on alone from its cache, as if it had never been batched
    logits = model(mx.array([[unfed]]), cache=cache)[0, -1]
    assert int(mx.argmax(logits).item()) == truths["p"][len(done)]
    run(batch, got)
    assert [o.token for o in got["q"]] == truths["q"]
    assert [o.token for o in got["r"]] == truths["r"]


def test_drafts_are_verified_only_as_long_as_a_wider_step_pays() -> None:
    cost = VerifyCost()
    rows = [(0.8, 8)] * 4  # four rows drafting 8 tokens, 80 % accepted
    assert cost.cap(rows) == 0  # a plain step is measured first
    cost.observe(4, 1, 1.0)
    assert cost.cap(rows) == 8  # then a wide one
    cost.observe(4, 9, 9.0)  # each token more costs as much as the first: nothing pays
    assert cost.cap(rows) == 0
    flat = VerifyCost()
    flat.observe(4, 1, 1.0)
    flat.observe(4, 9, 1.4)  # 5 % more per token: the whole draft pays
    assert flat.cap(rows) == 8
    assert flat.cap([(0.2, 8)] * 4) in (1, 2)  # little accepted: short drafts
    assert flat.cap([(0.8, 0)] * 4) == 0  # nothing drafted


def test_plain_and_wide_steps_are_measured_again_as_the_batch_goes_on() -> None:
    from omlx.engine.verify_cost import EXPLORE, REFRESH

    cost = VerifyCost()
    rows = [(0.9, 4)] * 2
    cost.observe(2, 1, 1.0)
    cost.observe(2, 5, 5.0)
    caps = []
    for _ in range(EXPLORE + 1):  # drafting does not pay: plain steps, then one wide again
        caps.append(cost.cap(rows))
        cost.observe(2, 1 + caps[-1], 1.0 + caps[-1])
    assert caps[:-1] == [0] * EXPLORE and caps[-1] == 4
    cheap = VerifyCost()
    cheap.observe(2, 1, 1.0)
    cheap.observe(2, 5, 1.1)
    caps = []
    for _ in range(REFRESH + 1):  # drafting pays: wide steps, and a plain one now and then
        caps.append(cheap.cap(rows))
        cheap.observe(2, 1 + caps[-1], 1.0 if caps[-1] == 0 else 1.1)
    assert caps.count(0) == 1 and caps[-2] == 0
    assert cheap.cap([(0.9, 4)] * 3) == 0  # another batch size is measured on its own


def test_rows_joining_together_decode_as_each_alone(model) -> None:
    prompts = [prompt(6, 5), prompt(7, 13), prompt(8, 9)]
    truths = [alone(model, p, N)[0] for p in prompts]
    batch = spec_batch(model, [])
    batch.add_rows([
        (state(f"j{i}", p), prefilled(model, p[:-1]), p[:-1], p[-1], Scripted(p, truths[i], 3, i - 1 if i else None))
        for i, p in enumerate(prompts)
    ])  # type: ignore[misc]
    got: dict[str, list] = {f"j{i}": [] for i in range(3)}
    run(batch, got)
    assert [[o.token for o in got[f"j{i}"]] for i in range(3)] == truths


SAMPLED_ROWS = 1000  # samples per side: a draft accepted always (or never) moves the counts far past the bound
SAMPLED_TOKENS = 4


@pytest.fixture(scope="module")
def narrow(tmp_path_factory: pytest.TempPathFactory):
    """A narrower tiny Llama: many rows sampled at little cost."""
    from mlx_lm import load

    from tests.support.tiny_model import build_tiny_llama

    return load(str(build_tiny_llama(tmp_path_factory.mktemp("narrow") / "m", hidden=64, layers=2, heads=2, kv_heads=1)))[0]


def test_sampled_rows_accept_drafts_by_rejection_sampling_and_keep_the_distribution(narrow) -> None:
    """Rows sampled at temperature 0.7 with drafts of the greedy continuation (accepted often, not
    always): per output position, the tokens' frequencies match rows decoded one token a step
    with the same sampler, by a chi-square test of homogeneity at p > 0.001 (identical
    distributions fail it once in a thousand runs; the PRNG is seeded, so the test is repeatable)."""
    from scipy.stats import chi2_contingency

    from omlx.engine.sampling import build_sampler

    params = SamplingParams(temperature=0.7)
    p = prompt(0, 7)
    truth, _ = alone(narrow, p, SAMPLED_TOKENS + 8)
    mx.random.seed(1)
    cache = make_prompt_cache(narrow)  # one token a step, every row the same prompt: a plain batch
    logits = narrow(mx.array([p] * SAMPLED_ROWS), cache=cache)[:, -1]
    sampler, plain = build_sampler(params), []
    for _ in range(SAMPLED_TOKENS):
        plain.append(sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True)))
        logits = narrow(plain[-1][:, None], cache=cache)[:, -1]
    want = mx.stack(plain, axis=1).tolist()

    batch, rows, cache = spec_batch(narrow, []), [], prefilled(narrow, p[:-1])
    for i in range(SAMPLED_ROWS):  # they share one sampler, as unseeded requests with one parameter set do
        s = RequestState(GenerationRequest(f"r{i}", p, SAMPLED_TOKENS, params))
        s.spec_aside, s.sampler = None, sampler
        rows.append((s, cache, p[:-1], p[-1], Scripted(p, truth, 4, None)))  # the batch merges copies
    batch.add_rows(rows)  # type: ignore[arg-type]
    got: dict[str, list] = {s.id: [] for s, *_ in rows}
    run(batch, got)
    drawn = [[o.token for o in got[s.id]] for s, *_ in rows]
    lookups = [lookup for *_, lookup in rows]
    drafted, kept = sum(lk.drafted for lk in lookups), sum(lk.kept for lk in lookups)
    assert 0.2 < kept / drafted < 0.9, (drafted, kept)  # drafts both accepted and rejected
    for at in range(SAMPLED_TOKENS):
        counts: dict[int, list[int]] = {}
        for side, seqs in enumerate((want, drawn)):
            for seq in seqs:
                counts.setdefault(seq[at], [0, 0])[side] += 1
        table = [c for c in counts.values() if sum(c) >= 10]
        rare = [sum(c[side] for c in counts.values() if sum(c) < 10) for side in (0, 1)]
        if sum(rare):
            table.append(rare)
        assert chi2_contingency(table).pvalue > 1e-3, (at, counts)
