"""Helper process for the crash test: writes SSD blocks as fast as it can until killed.

Usage: python cache_writer_helper.py CACHE_DIR FINGERPRINT. Block i has key sha256("block-i")
and tensors derived from seed i (see ``make_block``), so the test can check every block that
survives a SIGKILL byte for byte.
"""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from omlx.cache.block.block import CacheBlock
from omlx.cache.tiers.ssd.tier import SSDTier


def make_block(i: int, fingerprint: str, n_layers: int = 4, tokens: int = 256) -> CacheBlock:
    rng = np.random.default_rng(i)
    tensors: dict[str, mx.array] = {}
    for layer in range(n_layers):
        for kind in ("keys", "values"):
            data = rng.standard_normal((1, 4, tokens, 64), dtype=np.float32)
            tensors[f"{layer}.{kind}"] = mx.array(data).astype(mx.bfloat16)
    key = hashlib.sha256(f"block-{i}".encode()).hexdigest()
    return CacheBlock(
        key=key,
        parent=None,
        fingerprint=fingerprint,
        token_count=i,  # lets the test map a surviving file back to its seed
        layer_types=["kv"] * n_layers,
        tensors=tensors,
    )


def main() -> None:
    cache_dir, fingerprint = Path(sys.argv[1]), sys.argv[2]
    tier = SSDTier(cache_dir, 1 << 40, write_queue_max=8)
    tier.wait_ready()
    print("ready", flush=True)
    i = 0
    while True:
        block = make_block(i, fingerprint)
        while not tier.put(block):
            time.sleep(0.001)
        i += 1


if __name__ == "__main__":
    main()
