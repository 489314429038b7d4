"""Why a restore ends where it does: `match` reads the facts where its plan ends, `why.explain` names the
reason. Pure: a fake view says where blocks lie (as in test_restore_plan.py); no engine, no MLX."""

from __future__ import annotations

import subprocess
import sys
import threading

from omlx.cache.block.hashing import block_keys, chain_key
from omlx.cache.interface import NoCache
from omlx.cache.plan import why
from omlx.cache.plan.fingerprints import PER_MODEL, FingerprintBook
from omlx.cache.plan.planner import Planner
from omlx.cache.plan.restore_plan import Tier
from omlx.cache.plan.tail_index import TailIndex
from omlx.cache.plan.why import Outcome, Reason
from omlx.cache.tiers.residency import GONE_KEYS, BlockDirectory, Residency
from tests.unit.test_restore_plan import BLOCK, FP, B, View, measured, plan_for, tokens

FP2 = "e" * 64


def reason_of(view: View, prompt: list[int], **kw) -> why.CacheReport:
    return why.explain(Planner(view, FP, B, **kw).match(prompt, measured()))


def test_a_new_prompt_has_no_prefix_and_a_whole_hit_computes_only_its_last_token() -> None:
    prompt = tokens(3, extra=5)
    fresh = reason_of(View(), prompt)
    assert (fresh.reason, fresh.cached, fresh.tiers) == (Reason.NO_PREFIX, 0, {})
    keys = block_keys(FP, prompt, B)
    tail = chain_key(FP, keys[2], prompt[3 * B : 3 * B + 4])
    hit = reason_of(View(device=set(keys[:3]) | {tail}), prompt)
    assert (hit.reason, hit.cached, hit.computed) == (Reason.NONE, 3 * B + 4, 1)
    assert hit.tiers == {"hot": why.TierShare(3 * B + 4)}


def test_tokens_per_tier_follow_the_plan_runs() -> None:
    prompt = tokens(4, extra=3)
    keys = block_keys(FP, prompt, B)
    view = View(device={keys[0]}, ram={keys[1]: BLOCK}, ssd={keys[2]})
    report = reason_of(view, prompt)
    assert report.tiers == {"hot": why.TierShare(B), "ram": why.TierShare(B), "ssd": why.TierShare(B)}
    assert (report.reason, report.cached) == (Reason.NO_PREFIX, 3 * B)


def test_a_run_judged_slower_is_the_reason_with_its_numbers() -> None:
    prompt = tokens(6, extra=2)
    keys = block_keys(FP, prompt, B)
    view = View(device={keys[0]}, ram={k: BLOCK for k in keys[1:]})
    plan = plan_for(view, prompt, measured(recompute_s=1e-9, copy=1e6, move=1e6))
    report = why.explain(plan)
    assert (report.reason, report.cached) == (Reason.SLOWER, B)
    assert "ram" in report.detail and "judged slower" in report.detail


def test_a_block_let_go_is_evicted_not_absent() -> None:
    prompt = tokens(3, extra=2)
    keys = block_keys(FP, prompt, B)
    report = reason_of(View(device={keys[0]}, gone={keys[1]}), prompt)
    assert (report.reason, report.cached) == (Reason.EVICTED, B)
    assert reason_of(View(device={keys[0]}), prompt).reason is Reason.NO_PREFIX


def test_a_cached_prompt_that_goes_on_differently_is_a_divergence() -> None:
    prompt = tokens(1, extra=12)
    keys = block_keys(FP, prompt, B)
    index = TailIndex()
    other = chain_key(FP, keys[0], prompt[B : B + 6] + [999, 998])  # shares 6 tokens, then differs
    index.remember(keys[0], other, prompt[B : B + 6] + [999, 998])
    report = reason_of(View(device={keys[0], other}), prompt, tails=index)
    assert (report.reason, report.cached) == (Reason.DIVERGED, B + 6) and f"from token {B + 6}" in report.detail
    # the same continuation let go: the shared tokens were cached and evicted
    gone = reason_of(View(device={keys[0]}), prompt, tails=index)
    assert (gone.reason, gone.cached) == (Reason.EVICTED, B)


def test_a_divergence_is_named_only_where_the_restore_ends() -> None:
    prompt = tokens(1, extra=12)
    keys = block_keys(FP, prompt, B)
    exact = chain_key(FP, keys[0], prompt[B : B + 10])  # a tail found by its key (say, stored before a restart)
    index = TailIndex()
    other = chain_key(FP, keys[0], prompt[B : B + 4] + [999])
    index.remember(keys[0], other, prompt[B : B + 4] + [999])  # parts from the prompt earlier than that
    report = reason_of(View(device={keys[0], exact, other}), prompt, tails=index)
    assert (report.reason, report.cached) == (Reason.NO_PREFIX, B + 10)


def test_a_stateful_model_without_a_state_where_the_tokens_differ() -> None:
    prompt = tokens(1, extra=12)
    keys = block_keys(FP, prompt, B)
    index = TailIndex()
    other = chain_key(FP, keys[0], prompt[B : B + 6] + [999, 998])
    index.remember(keys[0], other, prompt[B : B + 6] + [999, 998])
    report = reason_of(View(device={keys[0], other}), prompt, tails=index, whole_tails=True, kv_only=True)
    assert (report.reason, report.cached) == (Reason.NO_STATE, B)
    assert str(B + 8) in report.detail  # where that block's state is


def test_a_few_shared_tokens_alone_are_below_the_grain() -> None:
    prompt = tokens(0, extra=12)
    index = TailIndex()
    other = chain_key(FP, None, prompt[:9] + [999])
    index.remember(None, other, prompt[:9] + [999])  # 9 tokens: under MIN_TAIL_ONLY_TOKENS
    report = reason_of(View(device={other}), prompt, tails=index)
    assert (report.reason, report.cached) == (Reason.GRAIN, 0)


def test_blocks_of_another_build_of_the_model_are_a_changed_fingerprint() -> None:
    prompt = tokens(2, extra=3)
    theirs = block_keys(FP2, prompt, B)
    report = reason_of(View(ssd={theirs[0]}), prompt, others=lambda: [(FP2, B)])
    assert (report.reason, report.cached) == (Reason.FINGERPRINT, 0)
    assert reason_of(View(ssd={theirs[0]}), prompt).reason is Reason.NO_PREFIX  # no other build known


def test_a_restore_that_fell_short_of_its_plan_says_why() -> None:
    prompt = tokens(4, extra=2)
    keys = block_keys(FP, prompt, B)
    plan = plan_for(View(device=set(keys[:2]), ssd=set(keys[2:4])), prompt, measured())
    parts = ((Tier.DEVICE, B, BLOCK), (Tier.DEVICE, B, BLOCK), (Tier.SSD, B, BLOCK))
    cut = why.explain(plan, Outcome(parts, 3 * B, cut=True, seconds=((Tier.SSD, 0.5),)), 3 * B)
    assert (cut.reason, cut.cached) == (Reason.SLOWER, 3 * B) and "cut short" in cut.detail
    assert cut.tiers == {"hot": why.TierShare(2 * B, 2 * BLOCK), "ssd": why.TierShare(B, BLOCK, 0.5)}
    assert why.explain(plan, Outcome(parts, 3 * B, no_state=True), 3 * B).reason is Reason.NO_STATE
    assert why.explain(plan, Outcome(parts, 3 * B, probed_slower=True), 3 * B).reason is Reason.SLOWER
    assert why.explain(plan, Outcome(parts, 3 * B), 3 * B).reason is Reason.GONE
    whole = parts + ((Tier.SSD, B, BLOCK),)
    grid = why.explain(plan, Outcome(whole, 4 * B), 3 * B + 5)
    assert (grid.reason, grid.cached) == (Reason.GRID, 3 * B + 5)
    assert grid.tiers["ssd"] == why.TierShare(B + 5, 2 * BLOCK)  # the bytes read, the tokens used


def test_a_model_without_the_cache_is_disabled() -> None:
    report = why.explain(NoCache().match([1, 2, 3]))
    assert (report.reason, report.cached, report.computed) == (Reason.DISABLED, 0, 3)


def test_the_report_as_json_and_as_log_fields() -> None:
    tiers = {"hot": why.TierShare(40, 400), "ssd": why.TierShare(20, 200, 0.25)}
    report = why.CacheReport(100, 60, tiers, Reason.EVICTED, "x")
    assert report.to_dict() == {
        "cached_tokens": 60, "computed_tokens": 40, "reason": "evicted", "detail": "x",
        "tiers": {"hot": {"tokens": 40, "bytes": 400, "seconds": None}, "ssd": {"tokens": 20, "bytes": 200, "seconds": 0.25}},
    }  # fmt: skip
    assert report.log_fields() == "restored=hot:40,ssd:20 computed=40:evicted"
    assert why.CacheReport(5, 0).log_fields() == "restored=- computed=5:none"


def test_the_directory_remembers_keys_let_go_within_a_bound() -> None:
    directory = BlockDirectory(threading.RLock())
    directory.mark("a", Residency.HOT)
    assert not directory.evicted("a")
    directory.unmark("a", Residency.HOT)
    assert directory.evicted("a")
    directory.mark("a", Residency.SSD)  # stored again
    assert not directory.evicted("a")
    directory.unmark("a", Residency.SSD)
    directory.forget_gone()  # a clear: not let go for room
    assert not directory.evicted("a")
    for i in range(GONE_KEYS + 1):
        directory.mark(f"k{i}", Residency.HOT)
        directory.unmark(f"k{i}", Residency.HOT)
    assert not directory.evicted("k0") and directory.evicted("k1") and directory.evicted(f"k{GONE_KEYS}")


def test_a_models_builds_are_kept_across_restarts_newest_first(tmp_path) -> None:
    path = tmp_path / "fingerprints.json"
    book = FingerprintBook(path)
    for i in range(PER_MODEL + 2):
        book.add("m", f"fp{i}", 64)
    book.add("m", "fp3", 64)  # a build seen again moves to the end
    book.add("other", "x", 256)
    again = FingerprintBook(path)
    newest = f"fp{PER_MODEL + 1}"
    assert again.others("m", newest) == [("fp3", 64), ("fp4", 64), ("fp2", 64)][: PER_MODEL - 1]
    assert again.others("other", "y") == [("x", 256)] and again.others("none", "x") == []
    path.write_text("{not json")
    assert FingerprintBook(path).others("m", "z") == []  # a bad file costs only the reason
    memory = FingerprintBook(None)  # no SSD: kept in memory only
    memory.add("m", "a", 64)
    assert memory.others("m", "b") == [("a", 64)]


def test_the_reasons_import_no_mlx() -> None:
    code = ("import sys, omlx.cache.plan.why, omlx.cache.plan.miss_facts, omlx.cache.plan.fingerprints;"
            " print([m for m in sys.modules if m.startswith('mlx')])")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_metrics_add_up_each_requests_report_by_tier_and_reason() -> None:
    from omlx.admin.metrics import RequestMetrics
    from omlx.server.prometheus import restore_families

    metrics = RequestMetrics()
    hit = why.CacheReport(300, 299, {"hot": why.TierShare(200, 2000), "ssd": why.TierShare(99, 990, 0.5)})
    miss = why.CacheReport(100, 0, {}, Reason.NO_PREFIX)
    for report in (hit, hit, miss):
        metrics.record("m", {"request_id": "chatcmpl-1", "finish_reason": "stop", "prompt_tokens": report.prompt_tokens,
                             "cached_tokens": report.cached, "completion_tokens": 1, "cache": report})  # fmt: skip
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in restore_families(metrics.series()) for s in family.samples}  # fmt: skip
    assert samples[("omlx_prefix_cache_restored_tokens_total", (("model", "m"), ("tier", "ssd")))] == 198
    assert samples[("omlx_prefix_cache_restored_bytes_total", (("model", "m"), ("tier", "hot")))] == 4000
    assert samples[("omlx_prefix_cache_restore_seconds_total", (("model", "m"), ("tier", "ssd")))] == 1.0
    assert ("omlx_prefix_cache_restore_seconds_total", (("model", "m"), ("tier", "hot"))) not in samples
    assert samples[("omlx_prefix_cache_requests_total", (("model", "m"), ("reason", "none")))] == 2
    assert samples[("omlx_prefix_cache_computed_tokens_total", (("model", "m"), ("reason", "no_prefix")))] == 100
