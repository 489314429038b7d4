#!/usr/bin/env python
"""A prompt's KV blocks restored from the RAM tier as an engine does it, timed step by step.

In-process, no model: KV caches of a Llama shape's size (random bf16), one `PrefixCache` on
a hot tier of 1.25 prompts and a RAM tier. Each round stores a prompt, pushes it out to RAM
with two others (copied by `write_back` as an idle engine does), then restores it the way
`LLMEngine` does (`prefetch`, `advance` once per loop, `take`, `lookup`), and prints what
each step took, the rate the cache measured for RAM (what its restore-or-recompute decision
uses) and the rate of the whole restore.

Usage: python benchmarks/gpu/ram_restore_probe.py [--shape llama-3.1-8b] [--tokens 32000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

PERF = time.perf_counter


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--tokens", type=int, default=32000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import mlx.core as mx
    from bench_gpu import SHAPES, kv_bytes_per_token
    from mlx_lm.models.cache import KVCache

    from omlx.cache.block_hash import block_keys
    from omlx.cache.hot_tier import HotTier
    from omlx.cache.prefix_cache import WRITE_BACK_BOUND_GPU, PrefixCache
    from omlx.cache.store import CacheStore
    from omlx.platform_info import discrete_gpu

    c = SHAPES[args.shape]
    layers, heads = c["num_hidden_layers"], c["num_key_value_heads"]
    head_dim = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    per_token = kv_bytes_per_token(args.shape)
    n = args.tokens
    store = CacheStore(
        HotTier(int(1.25 * (n + 64) * per_token)), None, 256, warm=HotTier(32 << 30),
        demote_bound=WRITE_BACK_BOUND_GPU if discrete_gpu() else 0,
    )  # fmt: skip
    cache = PrefixCache(store, "p" * 64, layers, "probe")
    cache.prefill.observe(n, 0, 100.0)  # recomputing "is slow": every restore is done and timed

    def kv(seed: int) -> list[KVCache]:
        out = []
        for layer in range(layers):
            k = mx.random.normal((1, heads, n + 1, head_dim), key=mx.random.key(seed * 1000 + layer)).astype(mx.bfloat16)
            kc = KVCache()
            kc.state = (k, k, n + 1)
            out.append(kc)
        mx.eval([x.state for x in out])
        return out

    results = []
    for r in range(args.rounds):
        prompt = [7 + r] + list(range(1000 + r, 1000 + r + n))
        cache.store(prompt, kv(r), final=True)
        for j in range(2):  # push it out to RAM
            other = [100 + 10 * r + j] + list(range(n))
            cache.store(other, kv(100 + 10 * r + j), final=True)
        tic = PERF()
        while cache.write_back(idle=True):
            pass
        demote_s = PERF() - tic
        mx.synchronize()
        in_ram = sum(map(store.warm.contains, block_keys(cache.fp, prompt, 256)))
        before = cache.warm_rate.value
        tic = PERF()
        pending = cache.prefetch(prompt + [5], lambda: None)
        loops, chunk_s = 0, []
        if pending is not None:
            while True:
                t = PERF()
                done = cache.advance(pending, move=True)
                chunk_s.append(PERF() - t)
                loops += 1
                if done:
                    break
            cache.take(pending)
        advance_s = PERF() - tic
        t = PERF()
        caches, got = cache.lookup(prompt + [5])
        mx.eval([x.state for x in caches])
        lookup_s = PERF() - t
        total = PERF() - tic
        row = {
            "round": r, "blocks_in_ram": in_ram, "demote_s": round(demote_s, 3), "restored_tokens": got,
            "advance_loops": loops, "advance_s": round(advance_s, 3),
            "advance_chunk_ms": [round(x * 1e3, 1) for x in chunk_s[:6]],
            "lookup_s": round(lookup_s, 3), "total_s": round(total, 3),
            "GBps_total": round(got * per_token / total / 1e9, 2),
            "warm_rate_before_GBps": round(before / 1e9, 2) if before else None,
            "warm_rate_after_GBps": round(cache.warm_rate.value / 1e9, 2) if cache.warm_rate.value else None,
        }  # fmt: skip
        results.append(row)
        print(json.dumps(row), flush=True)
        del caches
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
