"""After a restart, a restore judged on a wrong saved rate costs a bounded share of recomputing.

A real engine on the tiny model over a real SSD directory. Its SSD reads are slowed on purpose
(`SSDTier._load`, the reads' test hook) and the rate saved beside the blocks is made far too fast,
as when the page cache served every read the last process measured. Recomputing is made to look
as slow as on a large model (a second per 1,000 tokens), so the slowed disk is the slower path:
the read-ahead is cut short and the rest recomputed, and the next conversation is recomputed
without reading. With the disk at its own speed the SSD is the faster path and wins.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from omlx.cache.plan.restore_plan import PrefillEstimate
from omlx.cache.prefix_cache import PrefixCache
from omlx.cache.tiers.ssd.tier import SSDTier
from omlx.engine.llm_engine import LLMEngine
from omlx.engine.request import GenerationRequest, SamplingParams
from tests.support.cache_parts import make_tiers

B = 16
BLOCKS = 40
FP = "c" * 64
READ_S = 1.0  # a slowed block read: 40 blocks on 4 reader threads take 10 s


def conversation(seed: int) -> list[int]:
    return [5 + (i * seed) % 390 for i in range(BLOCKS * B)]


def request(rid: str, prompt: list[int]) -> GenerationRequest:
    return GenerationRequest(rid, prompt, 6, SamplingParams(temperature=0.0, logit_bias={0: -100.0, 1: -100.0, 2: -100.0}))


class Server:
    """An engine over the SSD directory `root`, as a process started on it would have."""

    def __init__(self, model_dir: Path, root: Path, monkeypatch: pytest.MonkeyPatch, seconds_per_token: float) -> None:
        self.caches: list[PrefixCache] = []
        self.reports: dict[str, dict] = {}  # request id -> its restore report (the usage's `omlx.cache`)
        self.tiers = store = make_tiers(B, 1 << 30, ssd=root)

        def loader() -> SimpleNamespace:
            from mlx_lm import load

            model, tokenizer = load(str(model_dir / "tiny-llama"))
            return SimpleNamespace(model=model, tokenizer=tokenizer, context_length=4096, draft=None)

        def factory(loaded: SimpleNamespace) -> PrefixCache:
            cache = PrefixCache(store, FP, len(loaded.model.layers), "m")
            # recomputing costs what it would on a large model, whatever the tiny one's prefills show
            monkeypatch.setattr(cache.costs.prefill, "estimate", lambda: PrefillEstimate((0.0, seconds_per_token, 0.0)))
            self.caches.append(cache)
            return cache

        self.engine = LLMEngine("m", loader, max_concurrent=4, prefix_cache_factory=factory)

    async def ask(self, rid: str, prompt: list[int]) -> tuple[list[int], float, int]:
        """(tokens, seconds to the first token, cached tokens)."""
        await self.engine.wait_ready()
        tic = time.perf_counter()
        tokens, ttft, cached = [], 0.0, 0
        async for ev in self.engine.generate(request(rid, prompt)):
            if ev.token_ids and not tokens:
                ttft = time.perf_counter() - tic
            tokens += ev.token_ids
            cached = ev.cached_tokens or cached
            if ev.cache is not None:
                self.reports[rid] = ev.cache
        return tokens, ttft, cached

    def stop(self) -> None:
        self.engine.shutdown()
        self.tiers.close()


@pytest.fixture()
def stored(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[int, list[int]]:
    """Two conversations on the SSD tier, each conversation's greedy answer by its seed."""
    server = Server(tiny_model_dir, tmp_path, monkeypatch, 1e-3)

    async def run() -> dict[int, list[int]]:
        return {seed: (await server.ask(f"s{seed}", conversation(seed)))[0] for seed in (7, 11)}

    try:
        answers = asyncio.run(run())
    finally:
        server.stop()  # writes their blocks and the measurements
    return answers


def saved_rate_made(root: Path, bytes_per_second: float) -> None:
    """The SSD rate in the saved measurements set to `bytes_per_second`, as if measured so."""
    (path,) = (root / "costs").glob(f"{FP}-*.json")
    state = json.loads(path.read_text())
    state["ssd_restores"] = [bytes_per_second * 10, 10.0, 3.0]
    path.write_text(json.dumps(state))


def test_a_restore_on_a_wrong_saved_rate_is_cut_short_and_the_next_one_recomputes(
    stored: dict[int, list[int]], tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved_rate_made(tmp_path, 1e12)  # the disk was "measured" at 1 TB/s
    reads: list[str] = []
    real_load = SSDTier._load

    def slow_load(self, path, key, fp, part):
        reads.append(key)
        time.sleep(READ_S)
        return real_load(self, path, key, fp, part)

    monkeypatch.setattr(SSDTier, "_load", slow_load)
    # read ahead as a real model's run would be (its 40 blocks here are 2.6 MB, not gigabytes)
    monkeypatch.setattr("omlx.cache.plan.planner.AHEAD_MIN_BYTES", 1)
    server = Server(tiny_model_dir, tmp_path, monkeypatch, 1e-3)

    async def run() -> list[tuple[list[int], float, int]]:
        return [await server.ask(r, conversation(seed)) for r, seed in (("cold", 13), ("a", 7), ("b", 11))]

    try:
        (_, cold_ttft, _), (first, first_ttft, first_cached), (second, _, second_cached) = asyncio.run(run())
        cache = server.caches[-1]
    finally:
        server.stop()
    cut_s = 0.1 * BLOCKS * B * 1e-3
    assert first == stored[7] and second == stored[11]  # the answers of the first process
    # cut at a tenth of recomputing (0.064 s): a few blocks at most were read, not the 40, and the
    # answer came about as soon as a fresh prompt's of the same length (cold): neither after the
    # 10 s of a full restore nor after the second the four reads under way at the cut still took
    assert first_cached < 8 * B and len(reads) < 8
    assert first_ttft < cold_ttft + cut_s + 0.3 < cold_ttft + READ_S
    assert cache.costs.ssd_rate.value < 1e8  # the reads' own rate replaced the wrong one...
    assert second_cached == 0 and len(reads) < 8  # ...so the next conversation recomputes unread
    # and each request says so (docs/design/cache-explain.md)
    cut, judged = server.reports["a"], server.reports["b"]
    assert (cut["reason"], cut["cached_tokens"]) == ("slower", first_cached) and "cut short" in cut["detail"]
    assert (judged["reason"], judged["cached_tokens"], judged["tiers"]) == ("slower", 0, {})
    assert "judged slower" in judged["detail"]


def test_where_the_ssd_is_the_faster_path_it_restores_the_whole_run(
    stored: dict[int, list[int]], tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the disk at its own speed (a few ms for 40 small blocks) against 0.64 s of recomputing
    saved_rate_made(tmp_path, 1e12)
    monkeypatch.setattr("omlx.cache.plan.planner.AHEAD_MIN_BYTES", 1)
    server = Server(tiny_model_dir, tmp_path, monkeypatch, 1e-3)
    try:
        answer, _, cached = asyncio.run(server.ask("a", conversation(7)))
        cache = server.caches[-1]
    finally:
        server.stop()
    assert answer == stored[7] and cached >= (BLOCKS - 1) * B
    assert cache.tiers.stats()["skipped_restores"] == 0
    report = server.reports["a"]
    assert report["tiers"]["ssd"]["tokens"] + report["tiers"].get("hot", {}).get("tokens", 0) == cached
    assert report["tiers"]["ssd"]["seconds"] > 0 and report["tiers"]["ssd"]["bytes"] > 0
