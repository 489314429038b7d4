#!/usr/bin/env python
"""How long an event handed from an engine thread takes to reach an asyncio consumer three
loop iterations later (as a first token on its way out of the server), with and without a
prompt store's worth of MLX slicing started on the engine thread right after the hand-off.

Why: that work holds the GIL, and each loop iteration gives the GIL up in `select`, so the
loop waits for it (up to the 5 ms switch interval) at every iteration before the token is
sent. The engine therefore stores a prompt's blocks only once the loop has passed its first
token on to the response's writer (`FIRST_TOKEN_GRACE_S` in omlx/engine/llm_engine.py).

Usage: python benchmarks/first_token_delivery_probe.py [--layers 16] [--tokens 32000] [--runs 15]
(defaults: the block slicing of a 32,000-token prompt of a 16-layer model, e.g. Llama-3.2-1B)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time

import mlx.core as mx

BLOCK = 256


async def delivery_ms(kv: list[mx.array], tokens: int, busy: bool) -> float:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[float] = asyncio.Queue()
    took: list[float] = []

    async def consumer() -> None:
        sent = await queue.get()
        await asyncio.sleep(0)  # the response's own iterations (an SSE chunk's way to the socket)
        await asyncio.sleep(0)
        took.append(time.perf_counter() - sent)

    task = asyncio.create_task(consumer())
    await asyncio.sleep(0.02)

    def engine() -> None:
        loop.call_soon_threadsafe(queue.put_nowait, time.perf_counter())
        if busy:  # what `PrefixCache.store` does per block: a contiguous slice per layer
            blocks = [[mx.contiguous(x[:, :, a : a + BLOCK, :]) for x in kv] for a in range(0, tokens, BLOCK)]
            mx.eval(blocks)

    thread = threading.Thread(target=engine)
    thread.start()
    await task
    thread.join()
    return 1e3 * took[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32000)
    ap.add_argument("--runs", type=int, default=15)
    args = ap.parse_args()
    kv = [mx.zeros((1, 8, args.tokens, 8)) for _ in range(2 * args.layers)]  # small heads: the slicing is what counts
    mx.eval(kv)
    for busy in (False, True):
        ms = [asyncio.run(delivery_ms(kv, args.tokens, busy)) for _ in range(args.runs)]
        label = "store started right after the hand-off" if busy else "nothing else on the engine thread"
        print(f"{label}: median {statistics.median(ms):.2f} ms, max {max(ms):.2f} ms ({args.runs} runs)")


if __name__ == "__main__":
    main()
