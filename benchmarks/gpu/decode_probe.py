#!/usr/bin/env python
"""Batch-1 TTFT and decode tok/s of one model, in one process, down the layers between raw
mlx-lm and the server: where does a gap appear?

  raw        mlx-lm `stream_generate`
  solo-main  oMLX's `SoloSequence` loop on the main thread, default stream
  solo-thread  the same loop on a long-lived worker thread inside its own `mx.new_stream` (the
             engine's setup)
  solo-thread-default  on a long-lived worker thread, in the default stream
  engine     oMLX's `LLMEngine` in this process (solo path, no prefix cache), made once

Each prints (TTFT seconds, decode tok/s); a long `--prompt-tokens` (8000, 32000) with few
`--tokens` measures prefill, the server's TTFT gap of part (c).

Usage: python benchmarks/gpu/decode_probe.py MODEL_DIR [--tokens 512] [--prompt-tokens 128] [--rounds 3]
(MODEL_DIR: e.g. a folder that `bench_gpu.py` built under /tmp/omlx-bench-gpu/models.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import queue
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


class Worker:
    """One long-lived thread that runs the jobs given to it, in its own `mx.new_stream` or the
    default stream: like the engine's thread, it is warm after the first job (a new thread
    per job measured MLX's per-thread first-use costs, 3x the prefill, instead)."""

    def __init__(self, own_stream: bool):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, args=(own_stream,), daemon=True)
        self.thread.start()

    def _run(self, own_stream: bool) -> None:
        import mlx.core as mx

        with mx.stream(mx.new_stream(mx.default_device())) if own_stream else contextlib.nullcontext():
            while (job := self.jobs.get()) is not None:
                fn, out = job
                out.put(fn())

    def __call__(self, fn: Any) -> Any:
        out: queue.SimpleQueue = queue.SimpleQueue()
        self.jobs.put((fn, out))
        return out.get()

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()


class Engine:
    """oMLX's `LLMEngine` in this process (solo path, no prefix cache), made once and kept, as
    in the server; each call is one request."""

    def __init__(self, model: Any, tokenizer: Any, eos: list[int]):
        from omlx.engine.llm_engine import LLMEngine

        loaded = SimpleNamespace(model=model, tokenizer=tokenizer, context_length=1 << 20)
        self.eng = LLMEngine("probe", lambda: loaded, max_concurrent=1)
        self.eos = eos

    def __call__(self, prompt: list[int], n: int) -> Timing:
        from omlx.engine.request import GenerationRequest, SamplingParams

        async def one() -> Timing:
            await self.eng.wait_ready()
            sampling = SamplingParams(temperature=0.0, logit_bias={e: -100.0 for e in self.eos})
            start, times = PERF(), []
            async for ev in self.eng.generate(GenerationRequest("probe", prompt, n, sampling)):
                times += [PERF()] * len(ev.token_ids)
            return timing(start, times)

        return asyncio.run(one())

    def close(self) -> None:
        self.eng.shutdown()


def vs_raw(ttft: dict[str, float], tps: dict[str, float]) -> dict[str, dict[str, float]]:
    """Each kind's figures as a fraction of raw mlx-lm's, when raw ran."""
    if not ttft.get("raw") or not tps.get("raw"):
        return {}
    return {"ttft_vs_raw": {k: round(v / ttft["raw"], 3) for k, v in ttft.items()},
            "tps_vs_raw": {k: round(v / tps["raw"], 3) for k, v in tps.items()}}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kinds", help="comma-separated subset of the kinds above (default: all)")
    args = ap.parse_args()

    import mlx.core as mx
    from bench_gpu import load_for_threads
    from mlx_lm.sample_utils import make_logits_processors

    model, tokenizer = load_for_threads(args.model)  # engines and workers run on their own threads
    eos = sorted(set(tokenizer.eos_token_ids or [])) or [2]
    procs = make_logits_processors(logit_bias={e: -100.0 for e in eos})
    prompt = [3 + (i * 7919) % 500 for i in range(args.prompt_tokens)]
    own, default, eng = Worker(own_stream=True), Worker(own_stream=False), Engine(model, tokenizer, eos)
    kinds = {
        "raw": lambda: raw(model, tokenizer, prompt, args.tokens, procs),
        "solo-main": lambda: solo(model, prompt, args.tokens, procs),
        "solo-grid": lambda: solo(model, prompt, args.tokens, procs, quantum=256),
        "solo-thread": lambda: own(lambda: solo(model, prompt, args.tokens, procs)),
        "solo-thread-default": lambda: default(lambda: solo(model, prompt, args.tokens, procs)),
        "engine": lambda: eng(prompt, args.tokens),
    }
    if args.kinds:
        kinds = {k: kinds[k] for k in args.kinds.split(",")}
    for f in kinds.values():  # warm-up: kernels compile on first use of each shape
        f()
    rows: dict[str, list[Timing]] = {k: [] for k in kinds}
    for r in range(args.rounds):
        for k, f in kinds.items():
            rows[k].append(f())
            mx.clear_cache()
        print(f"round {r}: " + ", ".join(f"{k} {v[-1][0]:.3f}s {v[-1][1]:.1f}tok/s" for k, v in rows.items()), flush=True)
    for closing in (own, default, eng):
        closing.close()
    ttft = {k: min(t for t, _ in v) for k, v in rows.items()}
    tps = {k: max(r for _, r in v) for k, v in rows.items()}
    print(json.dumps({"model": str(args.model), "prompt_tokens": args.prompt_tokens, "best_ttft_s": ttft,
                      "best_tps": tps, **vs_raw(ttft, tps)}))


if __name__ == "__main__":
    main()
