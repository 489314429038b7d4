"""A lone request's prompt is stored a piece at a time while it decodes, within a share of the
engine's time: its whole store at once held up the tokens right after a long prompt (0.5-0.9x of
`--no-cache` over 16 tokens on the H200, docs/design/write-back.md, "Prompt stores")."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from omlx.cache.hot_tier import HotTier
from omlx.cache.prefix_cache import PrefixCache
from omlx.cache.store import CacheStore
from omlx.engine import runner_stores
from omlx.engine.llm_engine import LLMEngine
from omlx.engine.request import GenerationRequest, SamplingParams

B = 16
FP = "d" * 64
SAMPLING = SamplingParams(temperature=0.0, logit_bias={0: -100.0, 1: -100.0, 2: -100.0})


def test_a_lone_prompt_is_stored_a_piece_at_a_time_while_it_decodes(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def loader() -> SimpleNamespace:
        from mlx_lm import load

        model, tokenizer = load(str(tiny_model_dir / "tiny-llama"))
        return SimpleNamespace(model=model, tokenizer=tokenizer, context_length=2048)

    hot = HotTier(1 << 30)
    caches: list[PrefixCache] = []

    def factory(loaded: SimpleNamespace) -> PrefixCache:
        caches.append(PrefixCache(CacheStore(hot, None, B), FP, len(loaded.model.layers), "m"))
        return caches[-1]

    engine = LLMEngine("m", loader, max_concurrent=4, prefix_cache_factory=factory)
    prompt = [5 + (i * 7) % 390 for i in range(12 * B + 3)]

    async def run() -> list[int]:
        await engine.wait_ready()
        # a block a piece (the tiny model's blocks are 64 KB; a real model's tens of MB)
        monkeypatch.setattr(runner_stores, "PROMPT_STORE_PIECE", 1)
        seen = []
        async for _ev in engine.generate(GenerationRequest("a", prompt, 300, SAMPLING)):
            seen.append(hot.stats()["blocks"])
        return seen

    try:
        seen = asyncio.run(run())
    finally:
        engine.shutdown()
    stored = [n for i, n in enumerate(seen) if i == 0 or n != seen[i - 1]]
    # 12 blocks and the tail a block at a time, spread over the decode (each token's event sees at
    # most a piece more, two where the stream's events were merged), all before the request ended
    assert stored[-1] >= 13 and seen[-2] >= 13
    steps = [b - a for a, b in zip(stored, stored[1:], strict=False)]
    assert len(steps) >= 6 and max(steps) <= 2
