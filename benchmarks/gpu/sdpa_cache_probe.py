#!/usr/bin/env python
"""What an entry of MLX's cuDNN attention-graph cache costs, and whether evicting entries
breaks a process. MLX's CUDA backend builds one cuDNN graph per (query, key) shape of a
prefill's attention and keeps them in a per-thread LRU (`MLX_CUDA_SDPA_CACHE_SIZE`); in the
seventh session an `omlx serve` whose LRU was shrunk to 8 lost its CUDA context ("illegal
memory access") at the 29th prompt length with CUDA graphs on, and answered all 40 with
them off. `omlx serve` sizes the LRU from these figures (omlx/server/runner.py).

  memory  N distinct prefill-like shapes (1B-like attention: 32 query heads, 8 key/value
          heads, head dim 64, bf16; keys and values sliced from one preallocated cache, as
          mlx-lm's KV cache hands them out) through an LRU that keeps them all: host RSS,
          this process's device memory (nvidia-smi), and the time of a miss against a hit
  evict   the same kind of shapes through the LRU the environment sets (8 unless set), then
          the first ones again (rebuilt after eviction); prints how far it got and the
          error, if any. Run it under MLX_USE_CUDA_GRAPHS=0 and =1 to compare.

Usage: python benchmarks/gpu/sdpa_cache_probe.py memory [--entries 1200]
       python benchmarks/gpu/sdpa_cache_probe.py evict [--entries 40]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

GRID = 256
HEADS, KV_HEADS, DIM = 32, 8, 64


def shape(i: int) -> tuple[int, int]:
    """The i-th distinct (query, key) length pair: queries of 1-8 grid units, keys up to ~i/8 more."""
    q = GRID * (1 + i % 8)
    return q, q + GRID * (i // 8)


def device_mib() -> float:
    """This process's device memory as the driver sees it (cuDNN's own allocations included)."""
    if not shutil.which("nvidia-smi"):
        return float("nan")
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=False,
    ).stdout  # fmt: skip
    for line in out.splitlines():
        pid, _, used = line.partition(",")
        if pid.strip() == str(os.getpid()):
            return float(used)
    return float("nan")


def rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["memory", "evict"])
    ap.add_argument("--entries", type=int)
    args = ap.parse_args()
    n = args.entries or (1200 if args.mode == "memory" else 40)
    os.environ.setdefault("MLX_CUDA_SDPA_CACHE_SIZE", str(n + 16 if args.mode == "memory" else 8))
    os.environ.setdefault("MLX_ENABLE_CACHE_THRASHING_CHECK", "0")
    import mlx.core as mx

    max_k = max(k for _, k in map(shape, range(n)))
    keys = mx.random.normal((1, KV_HEADS, max_k, DIM)).astype(mx.bfloat16)
    values = mx.random.normal((1, KV_HEADS, max_k, DIM)).astype(mx.bfloat16)
    mx.eval(keys, values)

    def attend(i: int) -> float:
        q_len, k_len = shape(i)
        q = mx.random.normal((1, HEADS, q_len, DIM)).astype(mx.bfloat16)
        mx.eval(q)
        start = time.perf_counter()
        out = mx.fast.scaled_dot_product_attention(
            q, keys[:, :, :k_len], values[:, :, :k_len], scale=DIM**-0.5, mask="causal"
        )
        mx.eval(out)
        return time.perf_counter() - start

    env = {k: os.environ.get(k) for k in ("MLX_CUDA_SDPA_CACHE_SIZE", "MLX_USE_CUDA_GRAPHS")}
    if args.mode == "evict":
        done, error = 0, None
        try:
            for i in [*range(n), *range(n // 2)]:
                attend(i)
                done += 1
            mx.eval(mx.sum(keys))  # a context lost on the way fails every later operation
        except Exception as exc:  # the finding, not a failure of the probe
            error = f"{type(exc).__name__}: {exc}"
        print(json.dumps({"mode": "evict", "env": env, "calls": n + n // 2, "done": done, "error": error}))
        return

    attend(0)  # first use: kernels and cuDNN handle, not an entry's cost
    base = {"rss_mib": rss_mib(), "device_mib": device_mib(), "active_mib": mx.get_active_memory() / 2**20}
    rows, step = [], max(1, n // 6)
    for lo in range(1, n, step):
        t = [attend(i) for i in range(lo, min(n, lo + step))]
        rows.append({"entries": min(n, lo + step), "miss_ms": round(1000 * sum(t) / len(t), 2),
                     "rss_mib": round(rss_mib() - base["rss_mib"], 1),
                     "device_mib": device_mib() - base["device_mib"],
                     "active_mib": round(mx.get_active_memory() / 2**20 - base["active_mib"], 1)})  # fmt: skip
        print(rows[-1], flush=True)
    hits = [attend(i) for i in range(n - step, n)]
    last = rows[-1]
    print(json.dumps({"mode": "memory", "env": env, "base": base, "rows": rows,
                      "hit_ms": round(1000 * sum(hits) / len(hits), 2),
                      "per_entry_kib": {"rss": round(1024 * last["rss_mib"] / n, 1),
                                        "device": round(1024 * last["device_mib"] / n, 1)}}))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
