"""The prefix cache inside a real engine (the tiny random Llama, in process): restores made ready
ahead while other streams decode, prompt stores timed around the first token, write-back while
idle, the SSD timed before any request. Waits count engine loops, tokens or events, never seconds
(a bound in seconds only guards against a hang)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from omlx.cache.plan.restore_plan import PrefillEstimate
from omlx.cache.prefix_cache import PrefixCache
from omlx.cache.tiers.ssd.tier import SSDTier
from omlx.cache.tiers.tiers import Tiers
from omlx.engine.llm_engine import LLMEngine
from omlx.engine.request import GenerationRequest, SamplingParams
from omlx.platform_info import discrete_gpu
from tests.support.cache_parts import make_tiers

B = 16
FP = "f" * 64
LAYERS = 2
BIAS = {0: -100.0, 1: -100.0, 2: -100.0}  # the tiny model's special tokens: never an early end
HANG = 60.0  # seconds: only a guard against a hang, never what a test measures


def kv(tokens: int) -> list[KVCache]:
    caches = []
    for layer in range(LAYERS):
        c = KVCache()
        k = mx.random.normal((1, 2, tokens, 8), key=mx.random.key(layer))
        c.state = (k, k + 1, tokens)
        caches.append(c)
    return caches


def tiny_loader(tiny_model_dir: Path) -> Callable[[], SimpleNamespace]:
    def loader() -> SimpleNamespace:
        from mlx_lm import load

        model, tokenizer = load(str(tiny_model_dir / "tiny-llama"))
        return SimpleNamespace(model=model, tokenizer=tokenizer, context_length=2048, draft=None)

    return loader


def engine_over(tiny_model_dir: Path, tiers: Tiers, made: list[PrefixCache] | None = None, **settings: Any) -> LLMEngine:
    """An engine on the tiny model whose prefix cache sits on `tiers` (each cache made goes to `made`)."""
    made = made if made is not None else []

    def factory(loaded: SimpleNamespace) -> PrefixCache:
        made.append(PrefixCache(tiers, FP, len(loaded.model.layers), "m"))
        return made[-1]

    return LLMEngine("m", tiny_loader(tiny_model_dir), prefix_cache_factory=factory, **settings)


def request(rid: str, prompt: list[int], n: int) -> GenerationRequest:
    return GenerationRequest(rid, prompt, n, SamplingParams(temperature=0.0, logit_bias=BIAS))


async def answer(engine: LLMEngine, rid: str, prompt: list[int], n: int) -> tuple[list[int], int]:
    got, cached = [], 0
    async for ev in engine.generate(request(rid, prompt, n)):
        got += ev.token_ids
        cached = ev.cached_tokens or cached
    return got, cached


async def loops_until(engine: LLMEngine, done: Callable[[], bool], loops: int = 2000) -> bool:
    """Whether `done()` (asked on the engine thread, between two of its loops) comes true within `loops` loops."""
    for _ in range(loops):
        if await engine.call(done):
            return True
    return False


def test_an_engine_times_its_ssd_while_idle_before_any_request(tiny_model_dir: Path, tmp_path: Path) -> None:
    first = make_tiers(B, ssd=tmp_path)
    written = PrefixCache(first, FP, LAYERS, "m")
    written.store(list(range(10, 10 + 4 * B)), kv(4 * B), final=True)
    written.close(timeout=10)
    first.close()
    made: list[PrefixCache] = []
    engine = engine_over(tiny_model_dir, make_tiers(B, ssd=tmp_path), made)

    async def main() -> bool:
        await engine.wait_ready()
        probe = made[-1].idle_probe
        if not await loops_until(engine, lambda: probe.in_flight is not None or made[-1].costs.ssd_rate.value is not None):
            return False
        if probe.in_flight is not None:  # its reads, on the reader threads: done before the next loops
            concurrent.futures.wait(probe.in_flight, timeout=HANG)
        return await loops_until(engine, lambda: made[-1].costs.ssd_rate.value is not None)

    try:
        assert asyncio.run(main())
    finally:
        engine.shutdown()
        made[-1].tiers.close()


def ram_only_engine(tiny_model_dir: Path, made: list[PrefixCache] | None = None) -> tuple[LLMEngine, Tiers]:
    """An engine on the tiny model whose hot tier holds no block (only RAM keeps them)."""
    tiers = make_tiers(B, 1, ram_bytes=1 << 30)
    return engine_over(tiny_model_dir, tiers, made, max_concurrent=4), tiers


def test_an_engine_stores_a_finished_sequence_to_ram_while_idle_not_between_others_tokens(
    tiny_model_dir: Path, monkeypatch
) -> None:
    engine, tiers = ram_only_engine(tiny_model_dir)
    ram = tiers.ram
    short = [5 + (i * 7) % 390 for i in range(10 * B)]
    long = [9 + (i * 11) % 390 for i in range(3 * B)]

    async def main() -> tuple[int, tuple[int, int]]:
        await engine.wait_ready()
        await answer(engine, "measure", [7] * (B + 1), 1)  # the first store learns a block's bytes
        await engine.call(lambda: None)
        monkeypatch.setattr("omlx.cache.saver.write_back.WRITE_BACK_CHUNK", 1)  # a block per piece
        before = ram.stats()["blocks"]
        long_task = asyncio.create_task(answer(engine, "long", long, 200))
        assert await loops_until(engine, lambda: bool(engine.scheduler.running))
        await answer(engine, "short", short, 2)
        # on the engine thread, between two of the long request's steps
        during = await engine.call(lambda: (ram.stats()["blocks"], len(engine.scheduler.running)))
        await long_task
        assert await loops_until(engine, lambda: ram.stats()["blocks"] - before >= 10 + 3)  # idle: a piece a loop
        return before, during

    try:
        before, (held, running) = asyncio.run(main())
    finally:
        engine.shutdown()
    assert running == 1  # the long request was still decoding
    assert held - before < 10  # and the short one's 10 blocks had not all been copied meanwhile
    assert ram.stats()["blocks"] - before >= 10 + 3  # then all of both went to RAM


@pytest.mark.parametrize("then", ["another", "leaves", "ends"])
def test_a_lone_prompt_is_stored_once_its_first_token_has_left_and_another_request_comes(
    tiny_model_dir: Path, monkeypatch, then: str
) -> None:
    # the store's work holds the GIL: started while the event loop still has to send the first
    # token, it adds to the TTFT (the loop is kept from taking the token here by blocking it). A
    # request alone then stores its prompt when another one comes (it may share it), when it is
    # cancelled, or at its end: stored between its tokens, it slowed them (write-back.md)
    from omlx.engine import request_state

    tiers = make_tiers(B)
    engine = engine_over(tiny_model_dir, tiers, max_concurrent=4)
    device = tiers.device
    prompt = [5 + (i * 7) % 390 for i in range(8 * B + 3)]
    steps_blocked = 8  # decode steps the engine makes while this (the event loop's) thread blocks

    def blocks_while_loop_blocked() -> list[tuple[int, int]]:
        """(hot-tier blocks, requests running) sampled while the event loop's thread blocks: until the
        engine has a first event for it and has made `steps_blocked` more decode steps."""
        counts, tokens, end = [], None, time.monotonic() + HANG
        while time.monotonic() < end:
            counts.append((device.stats()["blocks"], len(engine.scheduler.running)))
            if engine.bridge.outbox and tokens is None:  # emitted: a store would start now
                tokens = engine.runner.clock.tokens
            if tokens is not None and engine.runner.clock.tokens - tokens >= steps_blocked:
                return counts
            time.sleep(0.001)
        raise AssertionError("the engine made no decode steps while the event loop was blocked")

    async def main() -> tuple[list[tuple[int, int]], int, int, int]:
        await engine.wait_ready()
        monkeypatch.setattr(request_state, "FIRST_TOKEN_GRACE_S", 3600.0)  # only the event loop lets it go
        before = device.stats()["blocks"]
        stream = engine.generate(request("r", prompt, 300 if then == "ends" else 1800))
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)  # submitted: the task waits for its first event
        counts = blocks_while_loop_blocked()  # the prefill and first token happen meanwhile
        await first
        for _ in range(16):  # the first token has gone on: 16 more tokens decoded alone
            await asyncio.wait_for(anext(stream), HANG)
        alone = device.stats()["blocks"]
        other: list[Any] = []
        if then == "another":
            other.append(engine.generate(request("r-2", [9] * 40, 4)))
            await anext(other[0])
        elif then == "leaves":
            await stream.aclose()
        else:
            async for _ in stream:
                pass
        assert await loops_until(engine, lambda: device.stats()["blocks"] >= before + 8)
        await stream.aclose()
        if other:
            await other[0].aclose()
        return counts, alone, device.stats()["blocks"], before

    try:
        counts, alone, after, before = asyncio.run(main())
    finally:
        engine.shutdown()
    assert counts[-1][1] >= 1  # still decoding: its end would store it whole
    assert {n for n, _ in counts} == {before}  # none stored while the token waited for the loop
    assert alone == before  # nor while it decoded alone
    assert after >= before + 8  # then the prompt's blocks were stored


def test_a_first_token_counts_as_out_only_after_the_stream_writer_has_it(tiny_model_dir: Path) -> None:
    # SSE routes take events on through `with_keepalive` (a reader task, then the writer): the
    # engine may store the prompt only once the writer has run with the first token
    from omlx.server.sse import with_keepalive

    engine, _ = ram_only_engine(tiny_model_dir)

    async def main() -> tuple[bool, bool]:
        await engine.wait_ready()
        stream = with_keepalive(engine.generate(GenerationRequest("r", [5, 6, 7, 8] * 10, 50, SamplingParams(temperature=0.0))), 10.0)
        await anext(stream)  # the writer's turn with the first token
        handle = engine.scheduler.by_id["r"]
        at_writer = handle.first_out
        for _ in range(3):
            await asyncio.sleep(0)
        after = handle.first_out
        await stream.aclose()
        return at_writer, after

    try:
        at_writer, after = asyncio.run(main())
    finally:
        engine.shutdown()
    assert not at_writer
    assert after


def test_the_next_turn_finds_the_whole_pending_prefix(tiny_model_dir: Path, monkeypatch) -> None:
    # pieces go only while idle: a follow-up arriving first makes its conversation's store finish
    from omlx.cache.plan import decide
    from omlx.engine.store_queue import StoreQueue

    engine, _ = ram_only_engine(tiny_model_dir)
    prompt = [5 + (i * 7) % 390 for i in range(10 * B)]

    async def main() -> tuple[list[int], int]:
        await engine.wait_ready()
        await answer(engine, "measure", [7] * (B + 1), 1)
        await engine.call(lambda: None)
        monkeypatch.setattr("omlx.cache.saver.write_back.WRITE_BACK_CHUNK", 1)  # a block per piece
        monkeypatch.setattr(StoreQueue, "continue_store", lambda self: True)  # never idle long enough
        # what is asked here is whether the blocks are there, not whether restoring them beats
        # recomputing: the tiny model's 144 tokens are a near-tie on a fast GPU
        monkeypatch.setattr(decide, "RESTORE_MARGIN", float("inf"))
        first, _ = await answer(engine, "first", prompt, 4)
        return await answer(engine, "next", prompt + first + [11, 12, 13], 2)

    try:
        _, cached = asyncio.run(main())
    finally:
        engine.shutdown()
    assert cached >= 10 * B - (B if discrete_gpu() else 0)  # the first turn's prompt, all of it


def test_a_request_restoring_from_the_ssd_does_not_stall_the_others(tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """Its blocks are read on the SSD tier's threads while the engine keeps decoding: with every read
    held at a gate, the other stream decodes many tokens while the request waits, RESTORING; read in
    line (on the engine thread), every running stream waited for the disk."""
    shared = [5 + (i * 7) % 390 for i in range(12 * B)]
    made: list[PrefixCache] = []
    first = make_tiers(B, ssd=tmp_path)
    e1 = engine_over(tiny_model_dir, first, made, max_concurrent=4)

    async def first_run() -> list[int]:
        await e1.wait_ready()
        return (await answer(e1, "a", shared, 8))[0]

    expected = asyncio.run(first_run())
    e1.shutdown()  # writes its blocks to the SSD
    first.close()

    tiers = make_tiers(B, ssd=tmp_path)  # after a restart: the prefix is on the SSD only
    e2 = engine_over(tiny_model_dir, tiers, made, max_concurrent=4)
    monkeypatch.setattr("omlx.cache.plan.planner.AHEAD_MIN_BYTES", 1)
    gate, reading = threading.Event(), threading.Event()
    real_load = SSDTier._load

    def gated_load(self, *args):  # a disk that answers only when the test says so
        reading.set()
        assert gate.wait(HANG)
        return real_load(self, *args)

    monkeypatch.setattr(SSDTier, "_load", gated_load)

    async def second_run() -> tuple[list[int], int, tuple[int, int], list[Any]]:
        await e2.wait_ready()
        cache = made[-1]
        # recomputing is slow (a second a token, whatever this engine's own prefills show): restore
        monkeypatch.setattr(cache.costs.prefill, "estimate", lambda: PrefillEstimate((0.0, 1.0, 0.0)))
        cache.costs.ssd_rate.observe(1e9, 1.0)
        cache.costs.bytes_per_token = 1
        background = e2.generate(request("bg", [9 + (i * 11) % 390 for i in range(20)], 1500))
        await anext(background)  # decoding
        restoring = asyncio.ensure_future(answer(e2, "b", shared, 8))
        assert await loops_until(e2, lambda: bool(e2.scheduler.restoring))  # waiting for its reads
        assert reading.wait(HANG)
        decoded = 0
        for _ in range(24):  # the other stream goes on while every read is held
            decoded += len((await asyncio.wait_for(anext(background), HANG)).token_ids)
        still = await e2.call(lambda: len(e2.scheduler.restoring))
        gate.set()
        got, cached = await restoring
        await background.aclose()

        # a client that goes away while its prefix is being read: the engine forgets it
        gate.clear()
        reading.clear()
        cache.tiers.device.clear()  # the prefix is on the SSD only again
        stream = e2.generate(request("c", shared, 8))
        pending = asyncio.ensure_future(anext(stream))
        assert await loops_until(e2, lambda: bool(e2.scheduler.restoring))
        left = [len(e2.scheduler.restoring)]
        pending.cancel()
        await asyncio.gather(pending, return_exceptions=True)
        await stream.aclose()
        assert await loops_until(e2, lambda: not e2.scheduler.restoring and not e2.scheduler.waiting)
        left.append(await e2.call(lambda: len(e2.scheduler.restoring) + len(e2.scheduler.waiting)))
        gate.set()
        after = (await answer(e2, "d", shared, 8))[0]
        return got, cached, (decoded, still), [left, after]

    try:
        got, cached, decoded, (left, after) = asyncio.run(second_run())
    finally:
        gate.set()
        e2.shutdown()
        tiers.close()
    assert cached == 12 * B - B and got == expected  # restored from the SSD (all but the last block)
    assert decoded[0] >= 24 and decoded[1] == 1  # the other stream's tokens came while the request still waited, RESTORING
    assert left == [1, 0] and after == expected


def test_an_engine_restores_from_ram_ahead_and_answers_as_before(tiny_model_dir: Path, monkeypatch) -> None:
    tiers = make_tiers(B, ram_bytes=1 << 30)
    made: list[PrefixCache] = []
    engine = engine_over(tiny_model_dir, tiers, made, max_concurrent=4)
    prompt = [5 + (i * 7) % 390 for i in range(12 * B)]
    # (move, tokens the running requests had decoded so far) at each call
    advanced: list[tuple[bool, int]] = []
    real_advance = PrefixCache.advance

    def counting(self, loading, move, alone=False):
        advanced.append((move, sum(s.completion_tokens for s in engine.scheduler.running.values())))
        return real_advance(self, loading, move, alone)

    observed: list[float] = []  # bytes of each RAM rate observation

    def push_out() -> None:  # the prompt's blocks go to RAM
        tiers.device.set_max_bytes(0)
        tiers.device.set_max_bytes(1 << 30)

    async def main() -> list[Any]:
        await engine.wait_ready()
        first = await answer(engine, "a", prompt, 8)
        await engine.call(lambda: None)  # after the engine stored its blocks (behind the answer)
        await engine.call(push_out)
        costs = made[-1].costs
        costs.prefill.observe(100, 0, 100.0)  # recomputing is slow: restore
        costs.ram_move_rate.observe(1e9, 1.0)
        monkeypatch.setattr("omlx.cache.plan.planner.AHEAD_MIN_BYTES", 1)
        monkeypatch.setattr("omlx.cache.loader.loader.MOVE_CHUNK", 1)  # a block per loop, while others run
        monkeypatch.setattr(PrefixCache, "advance", counting)
        real_observe = costs.ram_move_rate.observe
        monkeypatch.setattr(costs.ram_move_rate, "observe", lambda n, s: observed.append(n) or real_observe(n, s))
        alone = await answer(engine, "b", prompt, 8)  # nothing else runs: the whole run moves in one loop
        lone_moves, lone_observed = list(advanced), list(observed)
        advanced.clear()
        await engine.call(push_out)
        other = asyncio.create_task(answer(engine, "c", [9 + (i * 5) % 380 for i in range(3 * B)], 120))
        assert await loops_until(engine, lambda: bool(engine.scheduler.running))  # decoding meanwhile
        beside = await answer(engine, "d", prompt, 8)
        await other
        return [first, alone, beside, (lone_moves, lone_observed)]

    try:
        (first, _), (alone, cached_alone), (beside, cached_beside), (lone_moves, lone_observed) = asyncio.run(main())
    finally:
        engine.shutdown()
    # all but the last token, restored ahead (on a CUDA GPU in whole blocks: solo.py's grid)
    usable = len(prompt) - 1 - ((len(prompt) - 1) % B if discrete_gpu() else 0)
    assert alone == beside == first and cached_alone == cached_beside == usable
    assert [move for move, _ in lone_moves] == [True]  # alone: all of it at once ...
    block_bytes = B * made[-1].costs.bytes_per_token
    assert lone_observed == [(len(prompt) - 1) // B * block_bytes]  # ... and timed as one move
    moves = [decoded for move, decoded in advanced if move]
    assert len(moves) >= 11  # beside a decoding stream: one block a loop ...
    assert moves[-1] > moves[0]  # ... and the stream went on decoding between them
