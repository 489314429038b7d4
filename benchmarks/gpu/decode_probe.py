#!/usr/bin/env python
"""Batch-1 decode tok/s of one model, in one process, down the layers between raw mlx-lm and
the server: where does a gap appear?

  raw        mlx-lm `stream_generate`
  solo-main  oMLX's `SoloSequence` loop on the main thread, default stream
  solo-thread  the same loop on a worker thread inside its own `mx.new_stream` (the engine's setup)
  engine     oMLX's `LLMEngine` in this process (solo path, no prefix cache), two requests on
             one engine; the second one counts

Usage: python benchmarks/gpu/decode_probe.py MODEL_DIR [--tokens 512] [--rounds 3]
(MODEL_DIR: e.g. a folder that `bench_gpu.py` built under /tmp/omlx-bench-gpu/models.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]

PERF = time.perf_counter


def rate(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0


def raw(model: Any, tokenizer: Any, prompt: list[int], n: int, procs: list[Any]) -> float:
    from mlx_lm.generate import stream_generate

    times = [PERF() for _ in stream_generate(model, tokenizer, prompt=prompt, max_tokens=n, logits_processors=procs)]
    return rate(times)


def solo(model: Any, prompt: list[int], n: int, procs: list[Any]) -> float:
    from omlx.engine.solo import SoloSequence

    seq = SoloSequence(model, prompt, cache=None, cached=[], sampler=None, logits_processors=procs,
                       prefill_step_size=2048)  # fmt: skip
    while not seq.prefill():
        pass
    times = []
    for i in range(n):
        seq.next(launch=i < n - 1)
        times.append(PERF())
    return rate(times)


def solo_thread(model: Any, prompt: list[int], n: int, procs: list[Any]) -> float:
    import mlx.core as mx

    out: list[float] = []

    def work() -> None:
        with mx.stream(mx.new_stream(mx.default_device())):
            out.append(solo(model, prompt, n, procs))

    t = threading.Thread(target=work)
    t.start()
    t.join()
    return out[0]


def engine(model: Any, tokenizer: Any, prompt: list[int], n: int, eos: list[int]) -> float:
    from omlx.engine.llm_engine import LLMEngine
    from omlx.engine.request import GenerationRequest, SamplingParams

    loaded = SimpleNamespace(model=model, tokenizer=tokenizer, context_length=1 << 20)
    eng = LLMEngine("probe", lambda: loaded, max_concurrent=1)

    async def one() -> float:
        req = GenerationRequest("probe", prompt, n, SamplingParams(temperature=0.0, logit_bias={e: -100.0 for e in eos}))
        times = []
        async for ev in eng.generate(req):
            times += [PERF()] * len(ev.token_ids)
        return rate(times)

    async def run() -> float:
        await eng.wait_ready()
        await one()
        return await one()

    try:
        return asyncio.run(run())
    finally:
        eng.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.sample_utils import make_logits_processors

    model, tokenizer = load(str(args.model))
    eos = sorted(set(tokenizer.eos_token_ids or [])) or [2]
    procs = make_logits_processors(logit_bias={e: -100.0 for e in eos})
    prompt = [3 + (i * 7919) % 500 for i in range(args.prompt_tokens)]
    kinds = {
        "raw": lambda: raw(model, tokenizer, prompt, args.tokens, procs),
        "solo-main": lambda: solo(model, prompt, args.tokens, procs),
        "solo-thread": lambda: solo_thread(model, prompt, args.tokens, procs),
        "engine": lambda: engine(model, tokenizer, prompt, args.tokens, eos),
    }
    for f in kinds.values():  # warm-up: kernels compile on first use of each shape
        f()
    rows: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(args.rounds):
        for k, f in kinds.items():
            rows[k].append(f())
            mx.clear_cache()
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rows.items()), flush=True)
    best = {k: max(v) for k, v in rows.items()}
    print(json.dumps({"model": str(args.model), "best_tps": best,
                      "vs_raw": {k: round(v / best["raw"], 3) for k, v in best.items()}}))  # fmt: skip


if __name__ == "__main__":
    main()
