"""An idle engine that prefills (a CUDA GPU) feeds a dummy prompt once, in the chunks a lone
prompt is prefilled in, so that MLX's per-shape attention graphs exist before a user's long
prompt needs them (graph_warmup.py).

On the CPU there is no graph cache, but the shapes are the point: the warm-up must call the
model's attention with exactly the (query, key) lengths a real lone prompt does, pause for
requests without changing their answers, and stay within its memory budget.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest

from omlx.engine.graph_warmup import GraphWarmup
from omlx.engine.llm_engine import LLMEngine
from omlx.engine.solo import PrefillShapes
from tests.unit.test_solo_sequence import (
    PROMPT_A,
    alone,
    assert_same,
    drive,
    request,
    run_one,
    together,
)


@pytest.fixture(scope="module")
def model_path(tiny_model_dir: Path) -> Path:
    return tiny_model_dir / "tiny-llama"


def warming_engine(model_path: Path, warmup_tokens: int, *, own_prefill: bool = True, step: int = 32) -> LLMEngine:
    def loader() -> SimpleNamespace:
        from mlx_lm import load

        model, tokenizer = load(str(model_path))
        return SimpleNamespace(model=model, tokenizer=tokenizer, context_length=2048, draft=None)

    return LLMEngine(
        "tiny", loader, max_concurrent=4, prefill_step_size=16, solo_prefill_step_size=step, own_prefill=own_prefill,
        graph_warmup_tokens=warmup_tokens,
    )  # fmt: skip


@pytest.fixture()
def attention_shapes(monkeypatch) -> list[tuple[int, int]]:
    """(query length, key length) of every attention call the engine thread makes from here on."""
    shapes: list[tuple[int, int]] = []
    real = mx.fast.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        if threading.current_thread().name.startswith("engine:"):
            shapes.append((q.shape[2], k.shape[2]))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy)
    return shapes


async def warmed(engine: LLMEngine, timeout: float = 60.0) -> dict:
    """The warm-up's progress once it is done."""
    deadline = time.monotonic() + timeout
    while not (engine.graph_warmup_progress or {}).get("done"):
        assert time.monotonic() < deadline, engine.graph_warmup_progress
        await asyncio.sleep(0.01)
    return engine.graph_warmup_progress


def test_the_warmup_meets_the_attention_shapes_of_a_lone_long_prompt(model_path: Path, attention_shapes) -> None:
    engine = warming_engine(model_path, 100)  # whole chunks of 32: 96 tokens

    async def main() -> tuple[list, list]:
        await engine.wait_ready()
        assert await warmed(engine) == {"tokens": 96, "target": 96, "done": True}
        # what came before it was the load's kernel warm-up: prompts of at most 15 tokens
        warmup = sorted({s for s in attention_shapes if s[0] > 15})
        del attention_shapes[:]
        await run_one(engine, request("long", [5 + (i * 7) % 390 for i in range(100)], 2))
        return warmup, sorted(set(attention_shapes))

    warmup, prompt = drive(engine, main)
    assert warmup == [(32, 32), (32, 64), (32, 96)]
    assert set(warmup) <= set(prompt)  # the prompt's chunks reuse every graph the warm-up built
    assert engine.runner.graph_warmup is None  # its dummy cache is gone


def test_requests_pause_the_warmup_and_are_answered_as_without_it(model_path: Path) -> None:
    reqs = [request("a", PROMPT_A, 24), request("b", PROMPT_A[:17], 16, temperature=0.8, seed=3)]
    expected = alone(model_path, reqs, solo=True, own_prefill=True)
    engine = warming_engine(model_path, 2048, step=16)  # 128 chunks

    async def main() -> tuple[list[dict], dict, int]:
        await engine.wait_ready()
        warmup = engine.runner.graph_warmup
        while not (engine.graph_warmup_progress or {}).get("tokens"):
            await asyncio.sleep(0.001)
        outs = await together(engine, reqs)  # queued between two chunks of the warm-up
        return list(outs), await warmed(engine), warmup.pauses

    outs, progress, paused = drive(engine, main)
    # batched with each other, unlike alone: on a GPU logprobs differ a little and the seeded
    # draw may part (assert_same says why); on the CPU everything must match
    assert_same(outs[0], expected[0])
    assert_same(outs[1], expected[1], sampled_from=0)
    assert progress == {"tokens": 2048, "target": 2048, "done": True}  # started over after them
    assert paused == 1


def test_a_pause_drops_what_was_fed_and_enough_of_them_end_it(model_path: Path) -> None:
    from mlx_lm import load

    from omlx.engine.graph_warmup import MAX_RESTARTS

    model, _ = load(str(model_path))
    warmup = GraphWarmup(model, depth=96, step=32, token=5, memory_budget=1 << 30)
    warmup.pause()
    assert warmup.pauses == 0  # nothing fed yet: nothing to drop
    for n in range(1, MAX_RESTARTS + 1):
        warmup.feed()
        assert warmup.progress() == {"tokens": 32, "target": 96, "done": False}
        warmup.pause()
        warmup.pause()  # the same interruption, seen again next loop
        assert (warmup.pauses, warmup.fed, warmup._cache) == (n, 0, None)  # no memory held meanwhile
    assert warmup.over and warmup.error == f"gave up after {MAX_RESTARTS} interruptions by requests"
    warmup.feed()
    assert warmup.fed == 0


def test_the_warmup_waits_while_another_engine_serves(model_path: Path) -> None:
    busy = warming_engine(model_path, 0)
    warming: list[LLMEngine] = []

    async def main() -> tuple[list[int], dict]:
        await busy.wait_ready()
        task = asyncio.create_task(run_one(busy, request("long", PROMPT_A, 200)))
        while not busy.active_count:
            await asyncio.sleep(0.005)
        gate = threading.Event()  # holds the busy engine mid-request: it stays busy until set
        held = asyncio.ensure_future(busy.call(gate.wait))
        warming.append(warming_engine(model_path, 96))
        await warming[0].wait_ready()
        seen = []
        for _ in range(30):
            seen.append((warming[0].graph_warmup_progress or {}).get("tokens", -1))
            await asyncio.sleep(0.01)
        gate.set()
        await held
        assert (await task)["usage"] == (len(PROMPT_A), 200)
        return seen, await warmed(warming[0])

    try:
        seen, progress = drive(busy, main)
    finally:
        for engine in warming:
            engine.shutdown()
    assert set(seen) == {0}  # not one chunk while the other engine had a request
    assert progress == {"tokens": 96, "target": 96, "done": True}  # then it ran


def test_a_failed_warmup_says_so_and_the_engine_serves(model_path: Path, monkeypatch) -> None:
    def broken(self) -> None:
        raise RuntimeError("no graph for you")

    monkeypatch.setattr(GraphWarmup, "feed", broken)
    engine = warming_engine(model_path, 96)

    async def main() -> tuple[dict, dict]:
        await engine.wait_ready()
        deadline = time.monotonic() + 30
        while "error" not in (engine.graph_warmup_progress or {}):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        return engine.graph_warmup_progress, await run_one(engine, request("r", PROMPT_A, 4))

    progress, out = drive(engine, main)
    assert progress == {"tokens": 0, "target": 96, "done": False, "error": "failed: no graph for you"}
    assert out["finish"] == "length" and len(out["tokens"]) == 4 and engine.runner.graph_warmup is None


def test_the_dummy_cache_stays_within_the_memory_budget(model_path: Path) -> None:
    from mlx_lm import load

    model, _ = load(str(model_path))
    probe = GraphWarmup(model, depth=32, step=32, token=5, memory_budget=1 << 30)
    probe.feed()
    assert probe.done and probe._cache is None
    warmup = GraphWarmup(model, depth=2048, step=256, token=5, memory_budget=0)
    warmup.feed()
    assert warmup.depth == 256 and warmup.done  # not even one more chunk fits
    shapes = PrefillShapes(16)  # what it built, for the engine's restore cuts (`_onto_built_shapes`)
    warmup = GraphWarmup(
        model, depth=2048, step=256, token=5, memory_budget=_kv_bytes_per_token(model) * 600, shapes=shapes
    )
    while not warmup.done:
        warmup.feed()
    assert (warmup.depth, warmup.fed) == (512, 512)  # whole chunks within 600 tokens' worth
    assert (1, 256, 256) in shapes and (1, 256, 512) in shapes and len(shapes._seen) == 2


def _kv_bytes_per_token(model) -> int:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([[5] * 8]), cache=cache)
    mx.eval([c.state for c in cache])
    return sum(c.keys[..., :8, :].nbytes + c.values[..., :8, :].nbytes for c in cache) // 8


def test_only_an_engine_that_prefills_warms_graphs(model_path: Path) -> None:
    engine = warming_engine(model_path, 96, own_prefill=False)
    try:
        asyncio.run(engine.wait_ready())
        assert engine.graph_warmup_tokens == 0 and engine.graph_warmup_progress is None
    finally:
        engine.shutdown()
