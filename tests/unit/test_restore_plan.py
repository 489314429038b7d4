"""Restore or recompute as pure functions of a plan and measured rates: no engine, no MLX, no
tiers, no clock. A fake view says where each block lies; `match` and `decide` say what to do."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field

from omlx.cache.block.hashing import block_keys, chain_key
from omlx.cache.plan import decide
from omlx.cache.plan.decide import Costs, Rate
from omlx.cache.plan.planner import AHEAD_MIN_BYTES, Measured, Planner
from omlx.cache.plan.restore_plan import PrefillEstimate, RestorePlan, Tier
from omlx.cache.plan.tail_index import TailIndex
from omlx.cache.plan.tails import MIN_TAIL_ONLY_TOKENS

B = 16
FP = "f" * 64
PER_TOKEN = 1000  # KV bytes per token
BLOCK = B * PER_TOKEN


@dataclass
class View:
    """Where blocks lie: keys per tier (RAM with its bytes), a device budget."""

    device: set[str] = field(default_factory=set)
    kv_only: set[str] = field(default_factory=set)
    ram: dict[str, int] = field(default_factory=dict)
    ssd: set[str] = field(default_factory=set)
    capacity: int = 1 << 40
    ram_on: bool = True
    ssd_on: bool = True
    gone: set[str] = field(default_factory=set)  # let go by every tier

    def on_device(self, key: str, whole: bool = False) -> bool:
        return key in self.device and not (whole and key in self.kv_only)

    def ram_bytes(self, key: str) -> int:
        return self.ram.get(key, 0)

    def on_ssd(self, key: str, fingerprint: str) -> bool:
        return key in self.ssd

    def device_can_hold(self, nbytes: int) -> bool:
        return 0 < self.capacity and nbytes <= self.capacity

    def device_bytes(self) -> int:
        return self.capacity

    def has_ram(self) -> bool:
        return self.ram_on

    def has_ssd(self) -> bool:
        return self.ssd_on

    def held(self, keys: list[str]) -> set[str] | None:
        return {k for k in keys if k in self.device or k in self.ram or k in self.ssd}

    def evicted(self, key: str) -> bool:
        return key in self.gone

    def tier_of(self, key: str, fingerprint: str, device_only: bool = False) -> Tier | None:
        if self.on_device(key, whole=True):
            return Tier.DEVICE
        if device_only:
            return None
        return Tier.RAM if key in self.ram else Tier.SSD if key in self.ssd else None


def per_token(seconds: float) -> PrefillEstimate:
    """Recomputing costs `seconds` a token, no attention term."""
    return PrefillEstimate((0.0, seconds, 0.0))


def measured(recompute_s: float | None = 1e-3, ssd: float | None = None, move: float | None = None,
             copy: float | None = None, **costs: int) -> Measured:
    prefill = per_token(recompute_s) if recompute_s is not None else PrefillEstimate()

    def rate(value: float | None, grows: bool = False) -> Rate:
        return Rate(value, stale=value is None, mean_bytes=1e12 if grows and value else None)

    return Measured(Costs(prefill, costs.get("bytes_per_token", PER_TOKEN)), rate(ssd), rate(move, True), rate(copy),
                    block_bytes=costs.get("block_bytes", BLOCK))  # fmt: skip


def tokens(n_blocks: int, extra: int = 1) -> list[int]:
    return list(range(10, 10 + n_blocks * B + extra))


def plan_for(view: View, prompt: list[int], m: Measured, grid: int = 0, **kw: bool) -> RestorePlan:
    return Planner(view, FP, B, **kw).match(prompt, m, grid)


# ----- the verdict --------------------------------------------------------------------------
def test_a_run_is_restored_only_when_it_beats_recomputing_by_the_margin() -> None:
    costs = Costs(per_token(1e-3), PER_TOKEN)
    recompute = 100 * 1e-3
    for restore_s, expected in ((0.9 * recompute, False), (0.7 * recompute, True)):
        rate = Rate(100 * PER_TOKEN / restore_s, stale=False)
        v = decide.verdict(100, 0, rate, costs)
        assert v.restore is expected and abs(v.restore_s - restore_s) < 1e-9 and v.recompute_s == recompute


def test_the_verdict_weighs_recomputing_where_the_run_lies() -> None:
    # t = a·n + b·n·(d + n/2): behind 12 blocks the same run costs more to recompute
    costs = Costs(PrefillEstimate((0.0, 1e-3, 1e-5)), PER_TOKEN)
    rate = Rate(64 * PER_TOKEN / 0.1, stale=False)  # 0.1 s to restore 64 tokens
    assert not decide.verdict(64, 0, rate, costs).restore  # 0.064 + 0.02 s to recompute at the root
    assert decide.verdict(64, 12 * B, rate, costs).restore  # + 0.12 s of attention behind 192 tokens


def test_nothing_measured_restores_and_a_large_ram_move_extrapolates() -> None:
    costs = Costs(per_token(1e-9), PER_TOKEN)
    assert decide.verdict(100, 0, Rate(), costs).reason == "unmeasured"
    assert decide.verdict(100, 0, Rate(1.0, stale=False), Costs(PrefillEstimate(), PER_TOKEN)).restore
    moves = Rate(1.0, stale=False, mean_bytes=100.0)  # measured on tiny moves: far slower per byte
    v = decide.verdict(100, 0, moves, costs)
    assert v.restore and v.reason == "extrapolated"


def test_a_stateful_run_is_charged_its_kv_and_one_state() -> None:
    costs = Costs(per_token(1e-3), PER_TOKEN, state_bytes=50 * PER_TOKEN, stateful=True)
    assert costs.restore_bytes(4 * B) == 4 * B * PER_TOKEN + 50 * PER_TOKEN  # not a state per block
    assert costs.restore_bytes(0) == 0


def test_a_tier_is_probed_when_stale_and_recomputing_is_known() -> None:
    known = Costs(per_token(1e-3), PER_TOKEN)
    assert decide.due_probe(Rate(), known) and not decide.due_probe(Rate(), Costs())
    assert not decide.due_probe(Rate(1e9, stale=False), known)
    assert decide.probe_blocks(16) == 2 and decide.probe_blocks(3) == 1
    assert decide.probe_budget(100, 0, known) == decide.PROBE_SHARE * 0.1
    assert decide.next_probe_group(0.01, 1, 2, budget=0.03) and not decide.next_probe_group(0.01, 1, 2, budget=0.02)


def test_reads_under_way_go_on_unless_the_rest_is_slower_than_recomputing() -> None:
    assert decide.keeps_reading(1.0, 1.0) and decide.keeps_reading(0.99, 1.0)
    assert not decide.keeps_reading(1.01, 1.0)


# ----- match ----------------------------------------------------------------------------------
def test_runs_follow_the_tiers_from_the_root_and_each_is_judged_once() -> None:
    prompt = tokens(8)
    keys = block_keys(FP, prompt, B)
    view = View(device=set(keys[:2]), ram={k: BLOCK for k in keys[2:5]}, ssd=set(keys[5:]))
    plan = plan_for(view, prompt, measured(recompute_s=1.0, ssd=1e9, move=1e9, copy=1e9))
    assert [(r.tier, r.first, r.blocks) for r in plan.runs] == [(Tier.DEVICE, 0, 2), (Tier.RAM, 2, 3), (Tier.SSD, 5, 3)]
    assert all(r.verdict.restore for r in plan.runs) and plan.tokens == 8 * B and plan.keys == tuple(keys)
    assert plan.run_in(Tier.RAM).move and not plan.ahead  # small runs: restored in line


def test_a_run_judged_slower_ends_the_plan_and_the_tail_comes_only_from_device_memory() -> None:
    prompt = tokens(6) + [7, 7]
    keys = block_keys(FP, prompt, B)
    view = View(ram={k: BLOCK for k in keys}, ssd=set(keys))
    plan = plan_for(view, prompt, measured(recompute_s=1e-9, ssd=1e9, copy=1e6, move=1e6))
    assert [(r.tier, r.verdict.restore) for r in plan.runs] == [(Tier.RAM, False)]  # no SSD run after it
    assert plan.tokens == 0 and plan.tails == ()
    tail = chain_key(FP, None, prompt[: B - 1])
    view.ram[tail] = BLOCK  # a tail in RAM is not fetched after a RAM run judged slower
    assert plan_for(view, prompt, measured(recompute_s=1e-9, copy=1e6, move=1e6)).tails == ()


def test_an_unmeasured_tier_is_probed_in_line_never_ahead() -> None:
    prompt = tokens(64)
    keys = block_keys(FP, prompt, B)
    plan = plan_for(View(ssd=set(keys)), prompt, measured(recompute_s=1.0))
    (run,) = plan.runs
    assert run.probe and run.verdict.restore and run.verdict.reason == "probe" and not plan.ahead


def test_large_measured_runs_are_made_ready_ahead() -> None:
    blocks = AHEAD_MIN_BYTES // BLOCK + 2
    prompt = tokens(2 * blocks)
    keys = block_keys(FP, prompt, B)
    view = View(ram={k: BLOCK for k in keys[:blocks]}, ssd=set(keys[blocks:]), capacity=4 * blocks * BLOCK)
    plan = plan_for(view, prompt, measured(recompute_s=1.0, ssd=1e9, move=1e9, copy=1e9))
    ram, ssd = plan.runs
    assert (ram.ahead, ssd.ahead) == (blocks, blocks) and plan.ahead
    # at most half the hot tier moves ahead: the rest is restored in line
    view.capacity = blocks * BLOCK
    ram = plan_for(view, prompt, measured(recompute_s=1.0, ssd=1e9, move=1e9, copy=1e9)).runs[0]
    assert ram.ahead == blocks // 2 and ram.move
    # recomputing faster: nothing ahead, nothing restored
    plan = plan_for(view, prompt, measured(recompute_s=1e-12, ssd=1e9, move=1e9, copy=1e9))
    assert not plan.ahead and plan.tokens == 0


def test_a_ram_run_the_hot_tier_cannot_keep_is_copied_and_judged_at_the_copy_rate() -> None:
    prompt = tokens(4)
    keys = block_keys(FP, prompt, B)
    view = View(ram={k: BLOCK for k in keys}, capacity=2 * BLOCK)
    slow_copies = measured(recompute_s=1e-3, move=1e12, copy=1.0)
    (run,) = plan_for(view, prompt, slow_copies).runs
    assert not run.move and not run.verdict.restore and run.verdict.rate == 1.0
    view.capacity = 1 << 40
    (run,) = plan_for(view, prompt, slow_copies).runs
    assert run.move and run.verdict.restore


def test_a_stateful_model_copies_its_ram_run_kv_only_and_never_ahead() -> None:
    blocks = AHEAD_MIN_BYTES // BLOCK + 2
    prompt = tokens(blocks)
    keys = block_keys(FP, prompt, B)
    plan = plan_for(View(ram={k: BLOCK for k in keys}), prompt, measured(recompute_s=1.0, move=1e9, copy=1e9),
                    kv_only=True, whole_tails=True)  # fmt: skip
    (run,) = plan.runs
    assert plan.kv_only and not run.move and run.ahead == 0 and run.verdict.restore


def test_a_prompt_leaves_at_least_one_token_to_compute() -> None:
    prompt = tokens(4, extra=0)  # exactly four blocks: the last one is recomputed
    keys = block_keys(FP, prompt, B)
    plan = plan_for(View(device=set(keys)), prompt, measured())
    assert plan.tokens == 3 * B


def test_the_longest_stored_tail_is_first_and_one_alone_needs_enough_tokens() -> None:
    prompt = tokens(2, extra=10)
    keys = block_keys(FP, prompt, B)
    tail = chain_key(FP, keys[-1], prompt[2 * B : 2 * B + 9])
    plan = plan_for(View(device={*keys, tail}), prompt, measured())
    assert plan.tails[0].key == tail and plan.tails[0].tokens == 9 and plan.tokens == 2 * B + 9
    # on a grid of whole blocks a tail is never used, so never fetched
    assert plan_for(View(device={*keys, tail}), prompt, measured(), grid=B).tails == ()
    # a tail alone (no full block before it) only from MIN_TAIL_ONLY_TOKENS on
    short = list(range(500, 500 + 10))
    alone = chain_key(FP, None, short[:9])
    assert plan_for(View(device={alone}), short, measured()).tails == ()
    assert MIN_TAIL_ONLY_TOKENS > 9


def test_a_tail_stored_by_this_process_is_found_token_by_token() -> None:
    prompt = tokens(1, extra=12)
    keys = block_keys(FP, prompt, B)
    index = TailIndex()
    other = chain_key(FP, keys[0], prompt[B : B + 6] + [999, 998])  # shares 6 tokens, then differs
    index.remember(keys[0], other, prompt[B : B + 6] + [999, 998])
    planner = Planner(View(device={keys[0], other}), FP, B, tails=index)
    plan = planner.match(prompt, measured())
    assert [(t.key, t.tokens) for t in plan.tails] == [(other, 6)]
    whole = Planner(View(device={keys[0], other}), FP, B, whole_tails=True, tails=index)
    assert whole.match(prompt, measured()).tails == ()  # a stateful model uses a tail whole or not at all


def test_the_plan_says_whether_a_prompt_is_stored_after_its_prefill() -> None:
    prompt = tokens(4)
    plan = plan_for(View(capacity=BLOCK // 2), prompt, measured())  # only RAM would keep its blocks
    assert not plan.stores_after_prefill and not plan.worth_storing(4 * B, 0)
    plan = plan_for(View(), prompt, measured())
    assert plan.worth_storing(4 * B, 3 * B) and not plan.worth_storing(4 * B, 3 * B + 1)


def test_the_plan_carries_the_recompute_estimate_it_was_judged_on() -> None:
    plan = plan_for(View(), tokens(2), measured(recompute_s=2e-3))
    assert plan.recompute_seconds(100, 0) == 0.2
    assert plan_for(View(), tokens(2), measured(recompute_s=None)).recompute_seconds(100, 0) is None


def test_the_plan_and_its_decisions_import_no_mlx() -> None:
    code = ("import sys, omlx.cache.plan.planner, omlx.cache.plan.decide, omlx.cache.plan.tails;"
            " print([m for m in sys.modules if m.startswith('mlx')])")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
