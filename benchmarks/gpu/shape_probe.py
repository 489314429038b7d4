#!/usr/bin/env python
"""What a prompt of a new length costs MLX's CUDA backend, and whether copies between device
and host can leave the engine thread. In one process, on a model `bench_gpu.py` built:

  shapes   prefill time of prompts whose lengths the process has not seen, against a length it
           has: plain chunks (every last chunk a new (query, key) shape), the last chunk padded
           to a multiple of 256 and trimmed after, and after a cached prefix of unaligned depth
  d2h      1 GB of KV to host memory: `np.array` on the calling thread, vs a copy on MLX's CPU
           stream launched with `async_eval` (how long the caller is held, how long a GPU
           workload takes meanwhile)
  h2d      1 GB from numpy to a GPU-usable array, twice (does MLX's buffer reuse help?)
  ram-tier (--ram-tier GB) 32,000-token prefills before, while and after GB of KV blocks are
           kept as the RAM tier keeps them (`staged_on_host`: MLX arrays in host memory): does
           their presence slow the device's prefill? (on the H200 a server with a RAM tier
           prefilled 32,000 tokens at 1B in 0.36-0.41 s, the others in 0.34-0.36 s)

Usage: python benchmarks/gpu/shape_probe.py MODEL_DIR [--no-shapes] [--no-copies] [--ram-tier GB]
"""

from __future__ import annotations

import json
import random
import sys
import time
from typing import Any

import numpy as np

PERF = time.perf_counter
QUANTUM = 256


def prefill(model: Any, tokens: list[int], *, step: int = 2048, pad: bool = False, cache: Any = None) -> float:
    """Seconds to feed `tokens` (after whatever `cache` holds) in step-aligned chunks."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = cache if cache is not None else make_prompt_cache(model)
    tic = PERF()
    fed = cache[0].offset
    todo = list(tokens)
    while todo:
        n = min(step - fed % step, len(todo))
        chunk = todo[:n]
        extra = (-n) % QUANTUM if pad and n == len(todo) else 0
        model(mx.array(chunk + [chunk[-1]] * extra)[None], cache=cache)
        if extra:
            for c in cache:
                c.trim(extra)
        mx.eval([c.state for c in cache])
        fed += n
        todo = todo[n:]
    return PERF() - tic


def shapes(model: Any) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    rng = random.Random(3)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, 500) for _ in range(n)]

    base = 8000
    for _ in range(2):
        prefill(model, toks(base))
    seen = [prefill(model, toks(base)) for _ in range(3)]
    out: dict[str, Any] = {"seen_length_s": [round(t, 4) for t in seen]}
    out["new_length_plain_s"] = [round(prefill(model, toks(base + 3 + 17 * i)), 4) for i in range(6)]
    out["new_length_padded_s"] = [round(prefill(model, toks(base + 5 + 19 * i), pad=True), 4) for i in range(6)]
    # after a cached prefix: 300 new tokens on depths the process has not seen
    rows = {}
    for label, depths, pad in (
        ("unaligned_depth_plain", [5000 + 37 * i for i in range(4)], False),
        ("aligned_depth_padded", [5120 + 256 * i for i in range(4)], True),
        ("aligned_depth_padded_again", [5120 + 256 * i for i in range(4)], True),
    ):
        times = []
        for d in depths:
            cache = make_prompt_cache(model)
            prefill(model, toks(d), cache=cache)
            times.append(round(prefill(model, toks(300 + (d % 7)), cache=cache, pad=pad), 4))
            del cache
        rows[label] = times
    out["after_prefix_300_s"] = rows
    mx.clear_cache()
    return out


def copies() -> dict[str, Any]:
    import mlx.core as mx

    layers = [mx.random.normal((1, 8, 32000, 64)).astype(mx.float16) for _ in range(32)]  # 1.05 GB
    mx.eval(layers)
    nbytes = sum(a.nbytes for a in layers)
    w = mx.random.normal((8192, 8192)).astype(mx.bfloat16)
    mx.eval(w)

    def gpu_work() -> float:
        tic = PERF()
        y = w
        for _ in range(40):
            y = (y @ w) * 1e-4
        mx.eval(y)
        return PERF() - tic

    gpu_work()
    out: dict[str, Any] = {"GB": round(nbytes / 1e9, 3), "gpu_work_alone_s": round(gpu_work(), 4)}
    tic = PERF()
    hosts = [np.array(a) for a in layers]
    out["np_array_s"] = round(PERF() - tic, 4)
    for attempt in range(2):
        tic = PERF()
        copied = [mx.multiply(a, 1, stream=mx.cpu) for a in layers]  # MLX's CPU stream reads the buffers
        mx.async_eval(copied)
        launched = PERF() - tic
        during = gpu_work()
        mx.eval(copied)
        ready = PERF() - tic
        tic = PERF()
        views = [np.array(c, copy=False) for c in copied]
        view_s = PERF() - tic
        tic = PERF()
        owned = [np.array(c) for c in copied]
        own_s = PERF() - tic
        same = all(np.array_equal(a.view(np.uint16), b.view(np.uint16)) for a, b in zip(hosts, owned, strict=True))
        out[f"cpu_stream_copy_{attempt}"] = {
            "launch_s": round(launched, 4), "gpu_work_meanwhile_s": round(during, 4), "ready_s": round(ready, 4),
            "np_view_s": round(view_s, 4), "np_copy_after_s": round(own_s, 4), "identical": same,
        }  # fmt: skip
        del copied, views, owned
    for attempt in range(2):
        tic = PERF()
        back = [mx.array(h) for h in hosts]
        made = PERF() - tic
        mx.eval([b.sum() for b in back])
        out[f"h2d_{attempt}"] = {"mx_array_s": round(made, 4), "then_gpu_use_s": round(PERF() - tic - made, 4)}
        del back
    # the RAM tier's shape: 125 blocks of 256 tokens, each layer's keys and values apart
    small = [np.ascontiguousarray(h[:, :, i * 256 : (i + 1) * 256]) for h in hosts for i in range(125)]
    tic = PERF()
    back = [mx.array(h) for h in small]
    made = PERF() - tic
    mx.eval([mx.concatenate(back[i : i + 125], axis=2).sum() for i in range(0, len(back), 125)])
    out["h2d_4000_blocks"] = {"mx_array_s": round(made, 4), "then_concat_gpu_s": round(PERF() - tic - made, 4)}
    del back
    tic = PERF()
    joined = [np.concatenate(small[i : i + 125], axis=2) for i in range(0, len(small), 125)]
    host_join = PERF() - tic
    back = [mx.array(h) for h in joined]
    mx.eval([b.sum() for b in back])
    out["h2d_joined_on_host"] = {"np_concat_s": round(host_join, 4), "total_s": round(PERF() - tic, 4)}
    return out


def ram_tier(model: Any, gb: float, length: int = 32000) -> dict[str, Any]:
    import mlx.core as mx

    from omlx.cache.block import staged_on_host

    rng = random.Random(5)

    def timed() -> list[float]:
        return [round(prefill(model, [rng.randrange(3, 500) for _ in range(length)]), 4) for _ in range(3)]

    timed()
    out: dict[str, Any] = {"before_s": timed()}
    args = model.args
    kv_heads = getattr(args, "num_key_value_heads", args.num_attention_heads)
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    block = {
        f"{layer}.{name}": mx.random.normal((1, kv_heads, 256, head_dim)).astype(mx.bfloat16)
        for layer in range(args.num_hidden_layers)
        for name in ("keys", "values")
    }
    mx.eval(block)
    nbytes = sum(t.nbytes for t in block.values())
    tic = PERF()
    held = [staged_on_host(block)[0] for _ in range(max(1, int(gb * 1e9) // nbytes))]
    out["staged"] = {"blocks": len(held), "GB": round(len(held) * nbytes / 1e9, 2), "s": round(PERF() - tic, 2)}
    out["staged_cache_not_emptied_s"] = timed()
    mx.clear_cache()
    out["active_GB"] = round(mx.get_active_memory() / 1e9, 2)
    out["while_held_s"] = timed()
    del held
    mx.clear_cache()
    out["after_s"] = timed()
    return out


def main() -> None:
    from mlx_lm import load

    model, _ = load(sys.argv[1])
    result = {"shapes": shapes(model) if "--no-shapes" not in sys.argv else {}}
    print(json.dumps(result, indent=1), flush=True)
    if "--ram-tier" in sys.argv:
        result["ram_tier"] = ram_tier(model, float(sys.argv[sys.argv.index("--ram-tier") + 1]))
        print(json.dumps(result["ram_tier"], indent=1), flush=True)
    del model
    if "--no-copies" not in sys.argv:
        result["copies"] = copies()
        print(json.dumps(result["copies"], indent=1), flush=True)


if __name__ == "__main__":
    main()
