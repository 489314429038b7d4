#!/usr/bin/env python
"""Does the prefix cache slow a cache miss inside one process? Engines that differ only in
their cache, side by side in one process on one model, each sent fresh prompts in turn.

`cache_ab_probe.py` found cache-enabled servers' misses 1-5% slower than `--no-cache`
servers' on the H200, with samples spread as widely. Here there is one process, one copy of
the weights, one Python heap and one set of threads for all of them, so what is left between
the engines is the cache itself:

  nocache, nocache-b  no prefix cache (two, to show how far identical engines differ)
  hot                 a hot tier only (what a server with `--hot-cache-only
                      --ram-cache-max-size 0` has): prompts stored after their first token
  hot-nostore         the same cache, but nothing is ever stored: lookups and read-aheads
                      only, so a difference from `hot` is the stores' (the blocks made and
                      kept in device memory), from `nocache` the lookups'
  ssd                 a hot tier and an SSD tier (in `--work-dir`): the SSD writer's thread
  ram                 a hot tier and a RAM tier (what `auto` gives on a discrete GPU)

Each round sends one new prompt to each engine in a rotating order, with `--gap` seconds of
quiet before each (an engine's idle work: stores, emptying MLX's buffer cache). Printed:
TTFT in this process (submit to first token) and the engine's own prefill time, best and
median, and the median's ratio to the first engine's.

Usage: python benchmarks/gpu/miss_probe.py [--shape llama-3.2-1b | --model DIR] [--tokens 32000]
       [--rounds 8] [--engines nocache,nocache-b,hot,hot-nostore,ssd,ram]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import shutil
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks" / "gpu")]

PERF = time.perf_counter


class PrefillTimes(logging.Handler):
    """The engines' own prefill seconds, from their debug line (`_observe_prefill`)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.by_request: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("request=%s prefilled"):
            self.by_request[record.args[0]] = record.args[3]


def make_engines(names: list[str], loaded: Any, hot_bytes: int, ssd_dir: Path) -> dict[str, Any]:
    from omlx.cache.hot_tier import HotTier
    from omlx.cache.prefix_cache import PrefixCache
    from omlx.cache.ssd_tier import SSDTier
    from omlx.cache.store import CacheStore
    from omlx.engine.llm_engine import LLMEngine
    from omlx.settings import SETTINGS

    defaults = {s.name: s.default for s in SETTINGS}

    class NoStores(PrefixCache):
        def store(self, tokens: list[int], cache: list[Any], *, final: bool, start: int = 0) -> int:
            return 0

        def wants_prompt_blocks(self, prompt_tokens: int, cached_tokens: int) -> bool:
            return False

    def factory(name: str) -> Any:
        layers, block = len(loaded.model.layers), defaults["cache_block_size"]
        kind = NoStores if name == "hot-nostore" else PrefixCache
        if name == "ssd":
            directory = ssd_dir / "ssd"
            shutil.rmtree(directory, ignore_errors=True)
            return lambda _: kind(CacheStore(HotTier(hot_bytes), SSDTier(directory, 64 << 30), block), "probe", layers, "m")
        warm = HotTier(32 << 30 if name == "ram" else 0)
        return lambda _: kind(CacheStore(HotTier(hot_bytes), None, block, warm=warm), "probe", layers, "m")

    engines = {}
    for name in names:
        engines[name] = LLMEngine(
            name,
            lambda: loaded,
            max_concurrent=defaults["max_concurrent_requests"],
            max_waiting=defaults["max_waiting_requests"],
            prefill_step_size=defaults["prefill_step_size"],
            graph_warmup_tokens=defaults["graph_warmup_tokens"],
            prefix_cache_factory=None if name.startswith("nocache") else factory(name),
        )
    return engines


async def one(engine: Any, prompt: list[int], rid: str) -> float:
    from omlx.engine.request import GenerationRequest, SamplingParams

    # random weights: keep end-of-sequence from ending a request before its first token
    sampling = SamplingParams(temperature=0.0, logit_bias={e: -100.0 for e in engine.eos_ids})
    start, last = PERF(), None
    async for ev in engine.generate(GenerationRequest(rid, prompt, 2, sampling)):
        if ev.token_ids:
            return PERF() - start
        last = ev
    raise RuntimeError(f"{rid}: no token ({last})")


async def run(args: argparse.Namespace, engines: dict[str, Any], times: PrefillTimes) -> dict[str, Any]:
    rng = random.Random(1234)

    def prompt() -> list[int]:
        return [rng.randrange(3, 512) for _ in range(args.tokens)]

    for e in engines.values():
        await e.wait_ready()
    for name, e in engines.items():  # kernels and this length's chunk shapes, before timing
        await one(e, prompt(), f"{name}-warm")
        await asyncio.sleep(args.gap)
    labels = list(engines)
    rows: dict[str, dict[str, list[float]]] = {k: {"ttft": [], "prefill": []} for k in labels}
    for r in range(args.rounds):
        for name in labels[r % len(labels) :] + labels[: r % len(labels)]:
            await asyncio.sleep(args.gap)
            rid = f"{name}-{r}"
            rows[name]["ttft"].append(round(await one(engines[name], prompt(), rid), 4))
            rows[name]["prefill"].append(times.by_request.get(rid, float("nan")))
        print(f"round {r + 1}/{args.rounds}: " + "  ".join(f"{k} {v['ttft'][-1]:.4f}" for k, v in rows.items()),
              flush=True)  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.2-1b", help="a random-weight model built as bench_gpu.py does")
    ap.add_argument("--model", type=Path, help="a model folder instead of --shape")
    ap.add_argument("--tokens", type=int, default=32000)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--gap", type=float, default=1.0, help="seconds of quiet before each request")
    ap.add_argument("--engines", default="nocache,nocache-b,hot,hot-nostore,ssd,ram")
    ap.add_argument("--hot-bytes", type=int, default=16 << 30)
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/omlx-bench-gpu"))
    args = ap.parse_args()

    import bench_gpu as bg

    path = args.model or bg.build_model(args.work_dir / "models", args.shape)
    model, tokenizer = bg.load_for_threads(path)
    loaded = SimpleNamespace(model=model, tokenizer=tokenizer, context_length=1 << 20)
    times = PrefillTimes()
    logging.getLogger("omlx.engine").addHandler(times)
    logging.getLogger("omlx.engine").setLevel(logging.DEBUG)
    engines = make_engines(args.engines.split(","), loaded, args.hot_bytes, args.work_dir)
    try:
        rows = asyncio.run(run(args, engines, times))
    finally:
        for e in engines.values():
            e.shutdown()
    base = rows[next(iter(rows))]
    print(f"\n{path.name}, {args.tokens}-token misses, {args.rounds} rounds (median ratio to {next(iter(rows))})")
    for name, row in rows.items():
        parts = []
        for key in ("ttft", "prefill"):
            v = [x for x in row[key] if x == x]
            b = [x for x in base[key] if x == x]
            if v and b:
                ratio = statistics.median(v) / statistics.median(b)
                parts.append(f"{key} best {min(v):.4f} median {statistics.median(v):.4f} ({ratio:.3f}x)")
        print(f"  {name:<12} " + " | ".join(parts))
    print(json.dumps({"model": str(path), "tokens": args.tokens, "rows": rows}))


if __name__ == "__main__":
    main()
