#!/usr/bin/env python
"""What joining a restored prefix's blocks into one KV cache costs on the device.

A restore (`kv_layout.join_blocks`) concatenated, before blocks stacked their layers, per layer, the keys and the values of
every block: 2 x layers concatenations of n blocks, which MLX runs as one copy per input.
On the H200 the first chunk after a hot-tier hit at 1B took 17-19 ms for 256 tokens at depth
7,936 and 38-47 ms at depth 32,000, as much as a 2,048-token chunk at those depths. Timed
here with random bf16 blocks of a Llama shape's size, no model:

  per-layer   what a restore did: 2 x layers concatenations of n (1, heads, B, dim) blocks
  one-copy    the same bytes as one array copied once (the floor)
  stacked     blocks held as one (layers, 2, heads, B, dim) array each: one concatenation of
              n inputs, then a contiguous copy of each layer's keys and values

Usage: python benchmarks/gpu/concat_probe.py [--shape llama-3.2-1b] [--blocks 31,125] [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

PERF = time.perf_counter


def best(fn, repeats: int) -> float:
    fn()  # first use: kernels, buffers
    times = []
    for _ in range(repeats):
        tic = PERF()
        fn()
        times.append(PERF() - tic)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--blocks", default="31,125")
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    import mlx.core as mx
    from bench_gpu import SHAPES

    c = SHAPES[args.shape]
    layers, heads = c["num_hidden_layers"], c["num_key_value_heads"]
    dim = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    B = args.block_size
    print(f"{args.shape}: {layers} layers, {heads} KV heads, head dim {dim}, blocks of {B} tokens, {mx.default_device()}")
    for n in (int(x) for x in args.blocks.split(",")):
        probe(mx, n, layers, heads, B, dim, args.repeats)
        mx.clear_cache()


def probe(mx: Any, n: int, layers: int, heads: int, B: int, dim: int, repeats: int) -> None:
    per_layer = [
        {f"{i}.{kind}": mx.random.normal((1, heads, B, dim)).astype(mx.bfloat16) for i in range(layers) for kind in ("keys", "values")}
        for _ in range(n)
    ]
    stacked = [mx.random.normal((layers, 2, heads, B, dim)).astype(mx.bfloat16) for _ in range(n)]
    whole = mx.random.normal((layers * 2, heads, n * B, dim)).astype(mx.bfloat16)
    mx.eval(per_layer, stacked, whole)

    def cat_per_layer() -> None:
        mx.eval([mx.concatenate([b[name] for b in per_layer], axis=2) for name in per_layer[0]])

    def one_copy() -> None:
        mx.eval(whole * 1)

    def cat_stacked() -> None:
        big = mx.concatenate(stacked, axis=3)  # (layers, 2, heads, n*B, dim)
        mx.eval([mx.contiguous(big[i, j][None]) for i in range(layers) for j in range(2)])

    t1, t2, t3 = (best(f, repeats) for f in (cat_per_layer, one_copy, cat_stacked))
    gb = whole.nbytes / 1e9
    print(
        f"  {n:>4} blocks ({gb:.2f} GB, {2 * layers} joins of {n} inputs): per-layer {t1 * 1e3:.2f} ms "
        f"({gb / t1:.0f} GB/s) | one copy {t2 * 1e3:.2f} ms ({gb / t2:.0f} GB/s) | stacked {t3 * 1e3:.2f} ms ({gb / t3:.0f} GB/s)"
    )

if __name__ == "__main__":
    main()
