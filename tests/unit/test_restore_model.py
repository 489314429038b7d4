"""The restore-or-recompute model on its own: no MLX, no tiers, no model.

Whether a run on a slower tier is restored is decided from numbers only (the tier's measured
rate, the fitted prefill cost, the depth of the run), so it is tested with numbers only.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest

from omlx.cache.plan import cost_file, decide, prefill_cost, read_watch, restore_model
from omlx.cache.plan.cost_file import CostFile
from omlx.cache.plan.decide import REPROBE_AFTER, RESTORE_MARGIN
from omlx.cache.plan.prefill_cost import PrefillCost
from omlx.cache.plan.read_watch import ReadWatch
from omlx.cache.plan.restore_model import RestoreModel, Throughput
from omlx.cache.plan.restore_plan import Verdict

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", [restore_model, prefill_cost, cost_file, read_watch, decide])
def test_the_model_imports_no_mlx(module) -> None:
    tree = ast.parse(Path(module.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n == "mlx" or n.startswith(("mlx.", "mlx_lm"))]


def test_the_model_loads_in_a_process_without_mlx() -> None:
    code = "import sys, omlx.cache.plan.restore_model, omlx.cache.plan.cost_file; print([m for m in sys.modules if m.startswith('mlx')])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def judge(model: RestoreModel, tokens: int, depth: int, rate: Throughput) -> Verdict:
    """The verdict `match` gives a run of `tokens` at `depth` from the tier of `rate`, on `model`'s numbers."""
    return decide.verdict(tokens, depth, rate.snapshot(), model.costs())


def model_of(seconds_per_token: float, bytes_per_token: int = 1000) -> RestoreModel:
    model = RestoreModel("m")
    model.prefill.observe(1000, 0, 1000 * seconds_per_token)
    model.bytes_per_token = bytes_per_token
    return model


def test_without_measurements_restoring_is_how_one_gets_them() -> None:
    model = RestoreModel("m")
    assert judge(model, 1000, 0, model.ssd_rate) == Verdict(True, reason="unmeasured")  # nothing known
    model.prefill.observe(1000, 0, 1.0)
    assert judge(model, 1000, 0, model.ssd_rate).restore  # the tier unmeasured
    model.ssd_rate.observe(1e6, 1.0)
    assert judge(model, 1000, 0, model.ssd_rate).restore  # bytes per token unknown


def test_a_tier_faster_than_recomputing_by_the_margin_is_restored() -> None:
    model = model_of(1e-3)  # 1,000 tokens: 1 s to recompute, 1 MB to restore
    model.ssd_rate.observe(1e6, 1.0 * RESTORE_MARGIN * 0.9)  # a little inside the margin
    assert judge(model, 1000, 0, model.ssd_rate).restore
    model.ram_move_rate.observe(1e6, 1.0 * RESTORE_MARGIN * 1.1)  # a little outside: a close call
    assert not judge(model, 1000, 0, model.ram_move_rate).restore


def test_a_run_deep_in_the_context_costs_more_to_recompute() -> None:
    # the attention over the tokens before a run is part of recomputing it
    model = RestoreModel("m", attention=1e-3)
    for n, depth in ((1000, 0), (2000, 0), (1000, 4000), (500, 8000)):
        model.prefill.observe(n, depth, 1e-3 * n + 1e-6 * n * (depth + n / 2))
    model.bytes_per_token = 1000
    root = model.prefill.seconds(1000, 0)
    deep = model.prefill.seconds(1000, 20_000)
    assert deep > root
    restore_s = (root + deep) / 2  # between the two: worth it only deep in
    model.ssd_rate.observe(1000 * 1000, restore_s / RESTORE_MARGIN * 1.01)
    assert not judge(model, 1000, 0, model.ssd_rate).restore
    assert judge(model, 1000, 20_000, model.ssd_rate).restore


def test_a_tier_is_probed_when_never_measured_or_skipped_many_times() -> None:
    model = RestoreModel("m")
    def due() -> bool:
        return decide.due_probe(model.ssd_rate.snapshot(), model.costs())

    assert model.ssd_rate.stale and not due()  # nothing to weigh against
    model.prefill.observe(1000, 0, 1.0)
    assert due()
    model.ssd_rate.observe(1e6, 1.0)
    assert not due()
    model.ssd_rate.skipped = REPROBE_AFTER
    assert due()
    model.ssd_rate.observe(1e6, 1.0)  # a new measurement starts the count again
    assert model.ssd_rate.skipped == 0


def test_a_probe_may_take_a_share_of_recomputing_the_run() -> None:
    model = model_of(1e-3)
    assert decide.probe_budget(1000, 0, model.costs()) == pytest.approx(decide.PROBE_SHARE * 1.0)
    assert decide.probe_budget(1000, 0, RestoreModel("m").costs()) == 0.0


def test_a_rate_weighs_each_restore_by_its_size_and_forgets_on_a_probe() -> None:
    rate = Throughput()
    rate.observe(1e6, 1e6 / 8e9)  # a small probe, fast per byte
    rate.observe(4e9, 4e9 / 2e9)  # a whole run
    assert rate.value < 2.1e9
    rate.forget()
    assert rate.value is None


def test_the_size_is_learnt_from_the_first_block_only() -> None:
    model = RestoreModel("m")
    model.learn_size(4096, 16)
    model.learn_size(1, 1)
    assert model.bytes_per_token == 256


def test_a_stateful_run_reads_one_state_whatever_its_length() -> None:
    model = model_of(1e-3, bytes_per_token=100)
    model.stateful = True
    model.state_bytes = 50_000  # a whole recurrent state, in every block
    assert [model.restore_bytes(16 * n) for n in (1, 10, 125)] == [1_600 + 50_000, 16_000 + 50_000, 200_000 + 50_000]
    model.ssd_rate.observe(100_000, 1.0)  # 100 kB/s
    # one block: 0.52 s to restore against 0.016 s to recompute; ten blocks: 0.66 s against 0.16 s;
    # 125 blocks: 2.5 s against 2 s, all recomputed here; at 1 MB/s the long run restores (0.25 s)
    # where the short one still recomputes (0.05 s), as a state per block (6.45 s for 125 blocks) would not
    assert not any(judge(model, 16 * n, 0, model.ssd_rate).restore for n in (1, 10, 125))
    model.ssd_rate.forget()
    model.ssd_rate.observe(1_000_000, 1.0)
    assert judge(model, 16 * 125, 0, model.ssd_rate).restore and not judge(model, 16, 0, model.ssd_rate).restore
    assert (16 * 125 * 100 + 125 * 50_000) / 1e6 > RESTORE_MARGIN * model.prefill.seconds(16 * 125, 0)


def test_the_state_s_size_is_learnt_apart_from_the_kv_s() -> None:
    model = RestoreModel("m", stateful=True)
    model.learn_size(16 * 100 + 50_000, 16, state_bytes=50_000)  # a whole block
    assert model.bytes_per_token == 100 and model.state_bytes == 50_000
    assert model.restore_bytes(32) == 3_200 + 50_000


def test_the_debug_line_names_the_tier_and_the_verdict(caplog: pytest.LogCaptureFixture) -> None:
    model = model_of(1e-3)
    model.ram_copy_rate.observe(1e6, 10.0)
    with caplog.at_level("DEBUG", logger="omlx.cache"):
        verdict = judge(model, 1000, 0, model.ram_copy_rate)
        model.log_verdict(1000, 0, model.ram_copy_rate, verdict)
        assert not verdict.restore
    assert "from RAM copies" in caplog.text and ": recompute" in caplog.text


def test_measurements_survive_in_their_file(tmp_path: Path) -> None:
    model = model_of(1e-3)
    model.ssd_rate.observe(1e6, 0.5)
    model.ram_move_rate.observe(2e6, 0.5)
    file = CostFile(tmp_path / "costs" / "fp-cpu.json")
    file.save(model, force=True, wait=True)
    again = RestoreModel("m")
    file.load(again)
    assert again.state() == model.state()
    assert again.prefill.seconds(1000) == pytest.approx(model.prefill.seconds(1000))


def test_an_older_file_s_ram_restores_count_as_copies(tmp_path: Path) -> None:
    path = tmp_path / "fp-cpu.json"
    state = model_of(1e-3).state()
    state.pop("warm_moves"), state.pop("warm_copies")
    path.write_text(json.dumps({**state, "warm_restores": [1.7e9, 1.0]}))
    model = RestoreModel("m")
    CostFile(path).load(model)
    assert model.ram_move_rate.value is None and model.ram_copy_rate.value == 1.7e9


def test_a_bad_file_only_costs_the_history(tmp_path: Path) -> None:
    path = tmp_path / "fp-cpu.json"
    path.write_text("{not json")
    model = RestoreModel("m")
    CostFile(path).load(model)
    CostFile(tmp_path / "missing.json").load(model)
    assert model.prefill.observations == 0


def test_saves_between_forced_ones_are_spaced_out(tmp_path: Path) -> None:
    file = CostFile(tmp_path / "fp-cpu.json")
    model = model_of(1e-3)
    file.save(model, force=True, wait=True)
    model.prefill.observe(1000, 0, 2.0)
    file.save(model, wait=True)  # within SAVE_EVERY_S of the last: not written
    assert json.loads(file.path.read_text())["prefill"]["observations"] == 1
    file.save(model, force=True, wait=True)
    assert json.loads(file.path.read_text())["prefill"]["observations"] == 2


def test_prefill_cost_fits_a_fixed_part_per_token_and_attention() -> None:
    cost = PrefillCost()
    for n, depth in ((64, 0), (1000, 0), (4000, 0), (1000, 8000), (2000, 16000)):
        cost.observe(n, depth, 0.02 + 1e-4 * n + 1e-9 * n * (depth + n / 2))
    c, a, b = cost.terms()
    assert c == pytest.approx(0.02, rel=1e-3) and a == pytest.approx(1e-4, rel=1e-3)
    assert b == pytest.approx(1e-9, rel=1e-2)
    assert cost.seconds(1000, 0) == pytest.approx(1e-4 * 1000 + 1e-9 * 1000 * 500, rel=1e-2)


def test_the_model_files_hold_no_machine_names_or_dates() -> None:
    for module in (restore_model, prefill_cost, cost_file):
        text = Path(module.__file__).read_text()
        assert "H200" not in text and "2026" not in text


def test_a_ram_move_far_larger_than_those_measured_is_restored() -> None:
    # moves of one block ran at 0.97 GB/s on an H200, of 4 GB at 5-6: judged at the one-block
    # rate, 51,200 tokens of an 8B model (6.7 GB) were recomputed (6.4 s predicted, ~20 s taken)
    # where restoring them takes ~1.2 s
    model = model_of(1e-4, bytes_per_token=131_072)
    for _ in range(10):
        model.ram_move_rate.observe(33.5e6, 33.5e6 / 0.97e9)  # one 256-token block at a time
    assert not judge(model, 256, 0, model.ram_move_rate).restore  # a block: 0.035 s against 0.026
    assert judge(model, 51_200, 0, model.ram_move_rate).restore  # 200 blocks: measured by restoring them
    model.ram_move_rate.observe(6.7e9, 1.2)
    assert not model.ram_move_rate.extrapolates(6.7e9) and model.ram_move_rate.value > 4e9
    model.ssd_rate.observe(33.5e6, 33.5e6 / 0.97e9)  # the SSD's rate does not grow so: judged
    assert not model.ssd_rate.extrapolates(6.7e9) and not judge(model, 51_200, 0, model.ssd_rate).restore


def test_a_rate_saved_without_its_count_loads_as_one_restore() -> None:
    rate = Throughput(grows_with_size=True)
    rate.load([1e9, 0.5])
    assert rate.value == 2e9 and not rate.extrapolates(8e9) and rate.extrapolates(9e9)
    assert len(rate.state()) == 3


def test_a_large_restore_far_slower_than_the_estimate_replaces_the_history() -> None:
    # restores served by the page cache, then the disk's own rate after a restart: a byte-weighted
    # history of large fast restores would have kept the estimate at ~2 GB/s after a 0.67 GB/s one
    rate = Throughput()
    for _ in range(5):
        rate.observe(8e9, 1.6)  # 5 GB/s
    rate.observe(6.3e9, 9.4)
    assert rate.value == pytest.approx(6.3e9 / 9.4)
    rate.observe(4e6, 1.0)  # a small read, slow: its fixed costs, not the disk's rate
    assert rate.value > 5e8  # weighed in, not the new estimate
    moves = Throughput(grows_with_size=True)  # RAM moves: small ones are slow per byte anyway
    moves.observe(8e9, 1.6)
    moves.observe(6.3e9, 9.4)
    assert moves.value > (8e9 + 6.3e9) / (1.6 + 9.4) * 0.99 * 0.7


def finished(nbytes: int) -> Future:
    from types import SimpleNamespace

    from omlx.cache.tiers.ssd.reads import TimedRead

    future: Future = Future()
    future.set_result(TimedRead(SimpleNamespace(nbytes=nbytes), 0.0, 0.0))
    return future


def test_reads_ahead_going_as_judged_are_never_cut() -> None:
    futures = [Future() for _ in range(8)]
    watch = ReadWatch(futures, 100, [8.0 - k for k in range(9)], workers=4, expected_rate=100.0, start=0.0)
    for i in range(4):
        futures[i] = watch.futures[i] = finished(100)
    assert not watch.check(now=1.0)  # 400 bytes in 1 s: 4 blocks left, 4 s against 4 s to recompute them
    assert not watch.cut and not any(f.cancelled() for f in futures[4:])


def test_reads_ahead_slower_than_recomputing_are_cut_short_and_the_rest_cancelled() -> None:
    cuts: list[int] = []
    futures = [finished(100) for _ in range(4)] + [Future() for _ in range(8)]
    futures[4].set_running_or_notify_cancel()  # being read: it finishes, its block unused
    watch = ReadWatch(futures, 100, [(12.0 - k) / 2 for k in range(13)], workers=4, expected_rate=1000.0,
                      on_cut=lambda: cuts.append(1), start=0.0)  # fmt: skip
    assert watch.check(now=4.0)  # 400 bytes in 4 s: 8 blocks left, 8 s against 4 s to recompute
    assert watch.cut and watch.read_bytes == 400 and watch.cut_after == 4.0 and cuts == [1]
    assert not futures[4].cancelled() and all(f.cancelled() for f in futures[5:])
    assert not watch.check(now=5.0) and cuts == [1]  # judged once


def test_a_stalled_disk_is_cut_at_the_deadline() -> None:
    # nothing finished after a tenth of recomputing the run (10 s): the request recomputes
    futures = [Future() for _ in range(8)]
    watch = ReadWatch(futures, 100, [10.0] * 9, workers=4, expected_rate=1e6, start=0.0)
    assert watch.deadline == pytest.approx(read_watch.CUT_SHARE * 10.0)
    assert not watch.check(now=0.5)  # too early to tell
    assert watch.check(now=1.5) and all(f.cancelled() for f in futures)


def test_a_short_run_waits_for_the_time_its_first_reads_should_take() -> None:
    # recompute 0.01 s, but the first four reads were expected to take 0.4 s: not judged before 0.8 s
    watch = ReadWatch([Future() for _ in range(4)], 100, [0.01] * 5, workers=4, expected_rate=1000.0, start=0.0)
    assert watch.deadline == pytest.approx(read_watch.FIRST_READS_SLACK * 0.4)
    assert not watch.check(now=0.5) and watch.check(now=0.9)


def test_the_deadline_is_judged_without_a_read_finishing() -> None:
    cuts = threading.Event()
    futures = [Future() for _ in range(4)]
    watch = ReadWatch(futures, 100, [0.2] * 5, workers=4, on_cut=cuts.set)
    watch.begin()
    assert cuts.wait(5) and watch.cut and all(f.cancelled() for f in futures)
    assert watch.cut_after < 1.0


def test_blocks_a_cut_read_ahead_read_are_taken_only_where_moving_them_in_beats_recomputing() -> None:
    # an 8B-shaped GPU: 33.5 MB a block at 2 GB/s into device memory (17 ms) against 8 ms to recompute it
    assert not decide.takes_what_was_read(4 * 33_554_432, 2e9, 4 * 0.008)
    assert decide.takes_what_was_read(4 * 33_554_432, 50e9, 4 * 0.008)  # pinned copies
    assert decide.takes_what_was_read(4 * 33_554_432, None, 4 * 0.008)  # never measured: take them
    assert decide.takes_what_was_read(4 * 33_554_432, 2e9, None)
