#!/usr/bin/env python
"""Aggregate tok/s of S concurrent streams in one process, no HTTP: raw mlx-lm
`BatchGenerator` vs oMLX's `LLMEngine` (with and without engine-side prefill of newcomers).
The gap between the two is the engine's own per-step host work; part (b) of `bench_gpu.py`
adds the HTTP layer and the clients on top.

  raw            `BatchGenerator.insert` of all prompts at once, then `next()` until done
  engine         `LLMEngine`, S requests submitted together (prefill by mlx-lm)
  engine-own     the same with `own_prefill=True` (the default on a CUDA GPU)

`--profile PATH` samples the engine thread's Python stack every 2 ms during the last
`engine` round and writes the most frequent frames (a py-spy stand-in where ptrace is not
allowed).

Usage: python benchmarks/gpu/batch_probe.py MODEL_DIR [--streams 32] [--tokens 256]
       [--prompt-tokens 128] [--length-spread 0] [--rounds 3] [--profile PATH]
(MODEL_DIR: e.g. a folder that `bench_gpu.py` built under /tmp/omlx-bench-gpu/models.)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]

PERF = time.perf_counter


def summary(t0: float, t_end: float, firsts: list[float], lasts: list[float], stamps: list[float]) -> dict[str, float]:
    """Aggregate rate over the whole run; steady rate while every stream decodes."""
    lo, hi = max(firsts), min(lasts)
    steady = sum(1 for t in stamps if lo < t <= hi) / (hi - lo) if hi > lo else 0.0
    return {
        "aggregate_tps": round(len(stamps) / (t_end - t0), 1),
        "steady_tps": round(steady, 1),
        "mean_ttft": round(sum(f - t0 for f in firsts) / len(firsts), 4),
    }


def raw(model: Any, prompts: list[list[int]], n: int, procs: list[Any], eos: list[int]) -> dict[str, float]:
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    s = len(prompts)
    bg = BatchGenerator(model, stop_tokens=[[e] for e in eos], completion_batch_size=s,
                        prefill_batch_size=min(8, s), prefill_step_size=512)  # fmt: skip
    t0 = PERF()
    bg.insert(prompts, max_tokens=[n] * s, logits_processors=[procs] * s)
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    stamps: list[float] = []
    done = 0
    while done < s:
        _, gen = bg.next()
        now = PERF()
        for r in gen:
            stamps.append(now)
            first.setdefault(r.uid, now)
            last[r.uid] = now
            done += r.finish_reason is not None
    t_end = PERF()
    bg.close()
    mx.clear_cache()
    return summary(t0, t_end, list(first.values()), list(last.values()), stamps)


class StackSampler:
    """Counts the innermost frames (file:line function) of one thread every `interval` s."""

    def __init__(self, thread_name: str, interval: float = 0.002):
        self.thread_name, self.interval = thread_name, interval
        self.counts: collections.Counter[str] = collections.Counter()
        self.leaf: collections.Counter[str] = collections.Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        target = next(t for t in threading.enumerate() if t.name.startswith(self.thread_name))
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(target.ident)
            if frame is None:
                continue
            self.samples += 1
            seen = set()
            leaf = True
            while frame is not None:
                code = frame.f_code
                key = f"{Path(code.co_filename).name}:{code.co_name}"
                if leaf:
                    self.leaf[f"{key}:{frame.f_lineno}"] += 1
                    leaf = False
                if key not in seen:  # inclusive counts, once per sample
                    seen.add(key)
                    self.counts[key] += 1
                frame = frame.f_back

    def report(self) -> str:
        lines = [f"{self.samples} samples of the engine thread", "inclusive:"]
        lines += [f"  {100 * c / self.samples:5.1f}%  {k}" for k, c in self.counts.most_common(40)]
        lines += ["innermost line:"]
        lines += [f"  {100 * c / self.samples:5.1f}%  {k}" for k, c in self.leaf.most_common(30)]
        return "\n".join(lines)


def engine(
    model: Any, tokenizer: Any, prompts: list[list[int]], n: int, eos: list[int], own_prefill: bool,
    profile: Path | None = None,
) -> dict[str, float]:
    from omlx.engine.llm_engine import LLMEngine
    from omlx.engine.request import GenerationRequest, SamplingParams

    loaded = SimpleNamespace(model=model, tokenizer=tokenizer, context_length=1 << 20)
    eng = LLMEngine("probe", lambda: loaded, max_concurrent=len(prompts), own_prefill=own_prefill)
    bias = {e: -100.0 for e in eos}

    async def stream(prompt: list[int], rec: dict[str, Any]) -> None:
        req = GenerationRequest("probe", prompt, n, SamplingParams(temperature=0.0, logit_bias=bias))
        async for ev in eng.generate(req):
            now = PERF()
            rec["times"] += [now] * len(ev.token_ids)

    async def run() -> dict[str, float]:
        await eng.wait_ready()
        sampler = StackSampler("engine:probe") if profile else None
        if sampler:
            sampler.start()
        recs = [{"times": []} for _ in prompts]
        t0 = PERF()
        await asyncio.gather(*(stream(p, r) for p, r in zip(prompts, recs, strict=True)))
        t_end = PERF()
        if sampler:
            sampler.stop()
            profile.write_text(sampler.report() + "\n")
        stamps = [t for r in recs for t in r["times"]]
        return summary(t0, t_end, [r["times"][0] for r in recs], [r["times"][-1] for r in recs], stamps)

    try:
        return asyncio.run(run())
    finally:
        eng.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--length-spread", type=int, default=0, help="prompts of 4 lengths this many tokens apart")
    ap.add_argument("--profile", type=Path)
    ap.add_argument("--kinds", help="comma-separated subset of the kinds above (default: all)")
    args = ap.parse_args()

    import mlx.core as mx
    from bench_gpu import load_for_threads
    from mlx_lm.sample_utils import make_logits_processors

    model, tokenizer = load_for_threads(args.model)  # engines and workers run on their own threads
    eos = sorted(set(tokenizer.eos_token_ids or [])) or [2]
    procs = make_logits_processors(logit_bias={e: -100.0 for e in eos})
    # distinct prompts; of one length as in bench_gpu.py's part (b), or of four
    prompts = [
        [3 + (i * 131 + j * 7919) % 500 for j in range(args.prompt_tokens - args.length_spread * (i % 4))]
        for i in range(args.streams)
    ]
    kinds = {
        "raw": lambda last: raw(model, prompts, args.tokens, procs, eos),
        "engine": lambda last: engine(model, tokenizer, prompts, args.tokens, eos, False,
                                      args.profile if last else None),  # fmt: skip
        "engine-own": lambda last: engine(model, tokenizer, prompts, args.tokens, eos, True),
    }
    if args.kinds:
        kinds = {k: kinds[k] for k in args.kinds.split(",")}
    for f in kinds.values():  # warm-up: kernels compile on first use of each shape
        f(False)
    rows: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    for r in range(args.rounds):
        for k, f in kinds.items():
            rows[k].append(f(r == args.rounds - 1))
            mx.clear_cache()
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]}" for k, v in rows.items()), flush=True)
    best = {k: max(v, key=lambda x: x["aggregate_tps"]) for k, v in rows.items()}
    ratios = {
        k: {m: round(v[m] / best["raw"][m], 3) for m in ("aggregate_tps", "steady_tps")} for k, v in best.items()
    } if "raw" in best else {}
    print(json.dumps({"model": str(args.model), "streams": args.streams, "best": best, "vs_raw": ratios}))


if __name__ == "__main__":
    main()
