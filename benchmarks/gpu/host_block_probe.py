#!/usr/bin/env python
"""How prefix-cache blocks can leave device memory and come back, through MLX on CUDA.

MLX's CUDA buffers are managed memory (`cudaMallocManaged`): a page lives on the device or
on the host and migrates to whichever side touches it. This probe times, on 1 GB of blocks of the 1B Llama's KV shape
(125 blocks x 16 layers x keys/values of (1, 8, 256, 64) bf16), and reads the device's free
memory (PyTorch's `cuda.mem_get_info`, if there) after each step to see where pages are:

  copy    demote = host copy tensor by tensor (the RAM tier until 2026-12-01)
  staged  the RAM tier's path (`HostBlock.of`): packed on the device, copied into an MLX array
          made by the host; restore = a new array from its bytes + device op (RAM keeps it), or
          the array itself + device op (moved); once with MLX's buffer cache emptied before,
          once kept (as in an engine: a staged array may reuse a buffer the device holds)
  touch   keep the MLX arrays; demote = read them on MLX's CPU stream (do pages move to the
          host?), restore = a device op on them (do they move back, how fast?), twice
  host    MLX arrays made from host bytes ahead of time (CPU stream); restore = a device op

Usage: python benchmarks/gpu/host_block_probe.py [--blocks 125] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PERF = time.perf_counter
SHAPE = (1, 8, 256, 64)  # one block's keys (or values) of one layer, Llama-3.2-1B
LAYERS = 16


def device_free() -> int | None:
    try:
        import torch

        return int(torch.cuda.mem_get_info()[0])
    except Exception:
        return None


def make_blocks(n: int) -> list[dict[str, Any]]:
    import mlx.core as mx

    blocks = []
    for b in range(n):
        t = {f"{layer}.{kind}": mx.random.normal(SHAPE, key=mx.random.key(b * 64 + layer * 2 + (kind == "values"))).astype(mx.bfloat16)
             for layer in range(LAYERS) for kind in ("keys", "values")}  # fmt: skip
        mx.eval(list(t.values()))
        blocks.append(t)
    return blocks


def gpu_touch(blocks: list[dict[str, Any]]) -> float:
    """Seconds for a device op over every tensor (what `PrefixCache.advance` does)."""
    import mlx.core as mx

    tic = PERF()
    mx.eval([t.sum() for b in blocks for t in b.values()])
    return PERF() - tic


def cpu_touch(blocks: list[dict[str, Any]]) -> float:
    import mlx.core as mx

    tic = PERF()
    with mx.stream(mx.cpu):
        mx.eval([t.sum() for b in blocks for t in b.values()])
    return PERF() - tic


def nbytes(blocks: list[dict[str, Any]]) -> int:
    return sum(int(t.nbytes) for b in blocks for t in b.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=125)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import mlx.core as mx

    from omlx.cache.block import CacheBlock, HostBlock, packed, to_host

    out: dict[str, Any] = {"mlx": mx.__version__, "device": str(mx.default_device())}

    def note(name: str, seconds: float, size: int, free_before: int | None) -> None:
        free = device_free()
        moved = None if free is None or free_before is None else (free - free_before) / 1e9
        out[name] = {"s": round(seconds, 4), "GBps": round(size / seconds / 1e9, 2), "device_free_delta_GB": moved}
        print(f"{name:<28} {seconds:7.3f} s  {size / seconds / 1e9:7.2f} GB/s  device free {moved:+.2f} GB"
              if moved is not None else f"{name:<28} {seconds:7.3f} s  {size / seconds / 1e9:7.2f} GB/s", flush=True)

    # --- copy, as the RAM tier did until 2026-12-01: every tensor read by the host as it lies
    blocks = make_blocks(args.blocks)
    size = nbytes(blocks)
    out["GB"] = size / 1e9
    gpu_touch(blocks)  # kernels
    free = device_free()
    tic = PERF()
    old = [packed(to_host(b)) for b in blocks]
    seconds = PERF() - tic
    del blocks, old
    mx.clear_cache()
    note("copy: demote, per tensor", seconds, size, free)

    # --- the RAM tier (`HostBlock.of`: packed on the device, copied out in one piece into an MLX
    # array made by the host, "staged"); back as a copy (RAM keeps it) and moved (RAM lets it go)
    blocks = make_blocks(args.blocks)
    gpu_touch(blocks)
    free = device_free()
    tic = PERF()
    held = [HostBlock.of(CacheBlock(str(i), None, "f", 256, ["kv"] * LAYERS, b), copy=True) for i, b in enumerate(blocks)]
    seconds = PERF() - tic
    del blocks
    mx.clear_cache()
    note("staged: demote", seconds, size, free)
    free = device_free()
    tic = PERF()
    back = [h.to_block().tensors for h in held]
    mx.eval([t.sum() for b in back for t in b.values()])
    note("staged: restore as a copy", PERF() - tic, size, free)
    del back
    mx.clear_cache()
    free = device_free()
    tic = PERF()
    back = [h.to_block(move=True).tensors for h in held]
    mx.eval([t.sum() for b in back for t in b.values()])
    note("staged: restore, moved", PERF() - tic, size, free)
    del back, held
    mx.clear_cache()

    # --- the same as an engine does it: MLX's buffer cache is not emptied, so a staged array
    # may get a buffer whose pages the device holds (the block before's packed copy)
    blocks = make_blocks(args.blocks)
    gpu_touch(blocks)
    free = device_free()
    tic = PERF()
    held = []
    for i in range(len(blocks)):
        held.append(HostBlock.of(CacheBlock(str(i), None, "f", 256, ["kv"] * LAYERS, blocks[i]), copy=True))
        blocks[i] = None  # the device copy goes as RAM's is made
    note("staged, cache kept: demote", PERF() - tic, size, free)
    free = device_free()
    tic = PERF()
    back = [h.to_block(move=True).tensors for h in held]
    mx.eval([t.sum() for b in back for t in b.values()])
    note("staged, cache kept: moved", PERF() - tic, size, free)
    del back, held, blocks
    mx.clear_cache()

    # --- touch: the same MLX arrays, read by the CPU, then by the GPU
    blocks = make_blocks(args.blocks)
    gpu_touch(blocks)
    free = device_free()
    note("touch: demote (CPU reads)", cpu_touch(blocks), size, free)
    free = device_free()
    note("touch: restore (GPU reads)", gpu_touch(blocks), size, free)
    free = device_free()
    note("touch: again on the GPU", gpu_touch(blocks), size, free)
    free = device_free()
    note("touch: demote again", cpu_touch(blocks), size, free)
    free = device_free()
    note("touch: restore again", gpu_touch(blocks), size, free)
    del blocks
    mx.clear_cache()

    # --- host: MLX arrays made from host bytes (CPU stream), then used on the GPU
    src = make_blocks(args.blocks)
    held = [HostBlock.of(CacheBlock(str(i), None, "f", 256, ["kv"] * LAYERS, b), copy=True) for i, b in enumerate(src)]
    del src
    mx.clear_cache()
    free = device_free()
    tic = PERF()
    with mx.stream(mx.cpu):
        blocks = [h.to_block().tensors for h in held]
        mx.eval([t for b in blocks for t in b.values()])
    note("host: MLX arrays from bytes", PERF() - tic, size, free)
    free = device_free()
    note("host: restore (GPU reads)", gpu_touch(blocks), size, free)

    text = json.dumps(out, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
