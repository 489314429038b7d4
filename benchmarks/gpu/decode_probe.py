#!/usr/bin/env python
"""Batch-1 TTFT and decode tok/s of one model, in one process, down the layers between raw
mlx-lm and the server: where does a gap appear?

  raw        mlx-lm `stream_generate`
  solo-main  oMLX's `SoloSequence` loop on the main thread, default stream
  solo-thread  the same loop on a worker thread inside its own `mx.new_stream` (the engine's setup)
  solo-thread-default  on a worker thread, in the default stream
  engine     oMLX's `LLMEngine` in this process (solo path, no prefix cache), two requests on
             one engine; the second one counts

Each prints (TTFT seconds, decode tok/s); a long `--prompt-tokens` (8000, 32000) with few
`--tokens` measures prefill, the server's TTFT gap of part (c).

Usage: python benchmarks/gpu/decode_probe.py MODEL_DIR [--tokens 512] [--prompt-tokens 128] [--rounds 3]
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


Timing = tuple[float, float]  # (TTFT s, decode tok/s)


def timing(start: float, times: list[float]) -> Timing:
    tps = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
    return (times[0] - start if times else 0.0), tps


def raw(model: Any, tokenizer: Any, prompt: list[int], n: int, procs: list[Any]) -> Timing:
    from mlx_lm.generate import stream_generate

    start = PERF()
    times = [PERF() for _ in stream_generate(model, tokenizer, prompt=prompt, max_tokens=n, logits_processors=procs)]
    return timing(start, times)


def solo(model: Any, prompt: list[int], n: int, procs: list[Any], quantum: int = 0) -> Timing:
    from omlx.engine.solo import SoloSequence

    start = PERF()
    seq = SoloSequence(model, prompt, cache=None, cached=[], sampler=None, logits_processors=procs,
                       prefill_step_size=2048, quantum=quantum)  # fmt: skip
    while not seq.prefill():
        pass
    times = []
    for i in range(n):
        seq.next(launch=i < n - 1)
        times.append(PERF())
    return timing(start, times)


def solo_thread(model: Any, prompt: list[int], n: int, procs: list[Any], own_stream: bool = True) -> Timing:
    import mlx.core as mx

    out: list[Timing] = []

    def work() -> None:
        if not own_stream:
            out.append(solo(model, prompt, n, procs))
            return
        with mx.stream(mx.new_stream(mx.default_device())):
            out.append(solo(model, prompt, n, procs))

    t = threading.Thread(target=work)
    t.start()
    t.join()
    return out[0]


def engine(model: Any, tokenizer: Any, prompt: list[int], n: int, eos: list[int]) -> Timing:
    from omlx.engine.llm_engine import LLMEngine
    from omlx.engine.request import GenerationRequest, SamplingParams

    loaded = SimpleNamespace(model=model, tokenizer=tokenizer, context_length=1 << 20)
    eng = LLMEngine("probe", lambda: loaded, max_concurrent=1)

    async def one() -> Timing:
        req = GenerationRequest("probe", prompt, n, SamplingParams(temperature=0.0, logit_bias={e: -100.0 for e in eos}))
        start, times = PERF(), []
        async for ev in eng.generate(req):
            times += [PERF()] * len(ev.token_ids)
        return timing(start, times)

    async def run() -> Timing:
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
        "solo-grid": lambda: solo(model, prompt, args.tokens, procs, quantum=256),
        "solo-thread": lambda: solo_thread(model, prompt, args.tokens, procs),
        "solo-thread-default": lambda: solo_thread(model, prompt, args.tokens, procs, own_stream=False),
        "engine": lambda: engine(model, tokenizer, prompt, args.tokens, eos),
    }
    for f in kinds.values():  # warm-up: kernels compile on first use of each shape
        f()
    rows: dict[str, list[Timing]] = {k: [] for k in kinds}
    for r in range(args.rounds):
        for k, f in kinds.items():
            rows[k].append(f())
            mx.clear_cache()
        print(f"round {r}: " + ", ".join(f"{k} {v[-1][0]:.3f}s {v[-1][1]:.1f}tok/s" for k, v in rows.items()), flush=True)
    ttft = {k: min(t for t, _ in v) for k, v in rows.items()}
    tps = {k: max(r for _, r in v) for k, v in rows.items()}
    print(json.dumps({"model": str(args.model), "prompt_tokens": args.prompt_tokens, "best_ttft_s": ttft,
                      "best_tps": tps, "ttft_vs_raw": {k: round(v / ttft["raw"], 3) for k, v in ttft.items()},
                      "tps_vs_raw": {k: round(v / tps["raw"], 3) if tps["raw"] else 0.0 for k, v in tps.items()}}))  # fmt: skip


if __name__ == "__main__":
    main()
