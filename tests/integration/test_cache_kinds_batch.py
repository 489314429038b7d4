"""Hit == miss for stateful kinds with requests that provably share a decode batch: a restored
sequence and a miss decode in the same `BatchGenerator` steps (the runner's own step outputs say
so), and each answers as it does alone without the cache (CPU float32, greedy)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from omlx.cache.block.hashing import model_fingerprint
from omlx.cache.block.kinds import model_kinds
from omlx.cache.prefix_cache import PrefixCache
from omlx.engine.llm_engine import LLMEngine
from omlx.engine.request import GenerationRequest, SamplingParams
from omlx.engine.runner import Runner
from tests.support.cache_parts import make_tiers
from tests.support.tiny_kinds import ARCHS, build_tiny_arch

B = 16
# a sliding window smaller than a block, a recurrent hybrid, recurrent layers alone, a CacheList hybrid
CASES = [("gpt_oss", 8), ("qwen3_next", 0), ("mamba2", 0), ("falcon_h1", 0)]


@pytest.fixture(params=CASES, ids=lambda c: c[0])
def folder(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    name, window = request.param
    return build_tiny_arch(tmp_path_factory.mktemp(name) / name, ARCHS[name](window))


def engine_on(folder: Path, cached: bool) -> LLMEngine:
    """An engine on the tiny model, with a stateful prefix cache in memory (or none)."""

    def loader() -> SimpleNamespace:
        from mlx_lm import load

        model, tokenizer = load(str(folder))
        return SimpleNamespace(model=model, tokenizer=tokenizer, context_length=4096, draft=None)

    def factory(loaded: SimpleNamespace) -> PrefixCache:
        kinds, why = model_kinds(loaded.model)
        assert kinds is not None and kinds.stateful, why
        fp = model_fingerprint("tiny", "weights", "float32", kinds.kv_format(), B)
        return PrefixCache(make_tiers(B), fp, len(kinds.leaves), "tiny", kinds=kinds)

    return LLMEngine("tiny", loader, max_concurrent=4, prefix_cache_factory=factory if cached else None)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def request(rid: str, tokens: list[int], n: int = 12) -> GenerationRequest:
    return GenerationRequest(rid, tokens, n, SamplingParams(temperature=0.0, logit_bias={0: -100.0, 1: -100.0, 2: -100.0}))


async def answer(engine: LLMEngine, rid: str, tokens: list[int]) -> tuple[list[int], int]:
    got, cached = [], 0
    async for ev in engine.generate(request(rid, tokens)):
        got += ev.token_ids
        cached = ev.cached_tokens or cached
    return got, cached


def test_a_hit_and_a_miss_decoding_in_one_batch_each_answer_as_alone(folder: Path, monkeypatch) -> None:
    shared, other = prompt(1, 3 * B + 5), prompt(2, 2 * B + 7)
    steps: list[set[str]] = []  # the requests each BatchGenerator step made a token for
    real_step = Runner.batch_step

    def recorded(self: Runner, single: bool) -> Any:
        ended, outs = real_step(self, single)
        steps.append({out.state.id for out in outs})
        return ended, outs

    monkeypatch.setattr(Runner, "batch_step", recorded)

    async def alone() -> list[list[int]]:
        engine = engine_on(folder, cached=False)
        try:
            await engine.wait_ready()
            return [(await answer(engine, rid, tokens))[0] for rid, tokens in (("a", shared), ("b", other))]
        finally:
            engine.shutdown()

    async def together() -> tuple[tuple[list[int], int], tuple[list[int], int]]:
        engine = engine_on(folder, cached=True)
        try:
            await engine.wait_ready()
            await answer(engine, "first", shared)  # stores the prompt's blocks and states
            await engine.call(lambda: None)
            steps.clear()
            return tuple(await asyncio.gather(answer(engine, "hit", shared), answer(engine, "miss", other)))
        finally:
            engine.shutdown()

    expected = asyncio.run(alone())
    (hit, hit_cached), (miss, miss_cached) = asyncio.run(together())
    shared_steps = [s for s in steps if {"hit", "miss"} <= s]
    assert len(shared_steps) >= 5, steps  # they decoded side by side in one batch, step after step
    assert hit_cached >= 3 * B and miss_cached == 0  # one restored, the other computed
    assert [hit, miss] == expected  # each as it answers alone, without the cache
