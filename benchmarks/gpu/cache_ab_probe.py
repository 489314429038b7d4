#!/usr/bin/env python
"""Which part of the prefix cache slows a cache miss's prefill? Servers that differ only in
their cache settings, side by side on one GPU, each sent fresh prompts in turn.

On the H200 the cache-enabled server of `bench_gpu.py --parts c` prefilled new 32,000-token
prompts ~5% slower than the `--no-cache` one, chunk by chunk, with nothing restored and no
background work running. Here each variant is its own `omlx serve` (same model, same
flags but the cache's), all are up at once, and every round sends one new prompt to each in
a rotating order, once every server is quiet (no SSD writes, RAM copies, requests or graph
warm-up). Two `--no-cache` servers show how far two identical servers differ.

Printed per variant: client TTFT and the server's own prefill time (its debug line), best
and median, and the median's ratio to the first variant's.

Usage: python benchmarks/gpu/cache_ab_probe.py [--shape llama-3.2-1b] [--tokens 32000] [--rounds 5]
       [--variant 'label=flags' ...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

DEFAULT_VARIANTS = [
    "nocache=--no-cache",
    "nocache-b=--no-cache",
    "default=",  # hot tier, RAM tier (auto: on on a discrete GPU) and SSD, as bench_gpu's cache server
    "hot+ram=--hot-cache-only",
    "hot=--hot-cache-only --ram-cache-max-size 0",
    "tiny-hot=--hot-cache-only --ram-cache-max-size 0 --hot-cache-max-size 64MB",
]
PREFILLED = re.compile(r"prefilled (\d+) tokens after (\d+) in ([\d.]+)s: (\d+) chunks ([\d.]+)s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--tokens", type=int, default=32000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variant", action="append", help="label=flags for `omlx serve` (repeatable)")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/omlx-bench-gpu"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import bench_gpu as bg

    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else args.work_dir / "out")
    out.mkdir(parents=True, exist_ok=True)
    models_root = args.work_dir / "models"
    bg.build_model(models_root, args.shape)
    wl = bg.Workload(args.shape, [2])
    homes = args.work_dir / "ab-homes"
    variants = [v.split("=", 1) for v in (args.variant or DEFAULT_VARIANTS)]
    servers: dict[str, Any] = {}
    for label, flags in variants:
        extra = ["--log-level", "debug", "--ssd-cache-max-size", "40GB", *shlex.split(flags)]
        servers[label] = bg.Server(label, models_root, args.shape, homes / label, extra)
    for s in servers.values():
        s.start()
    results: dict[str, Any] = {"shape": args.shape, "tokens": args.tokens, "variants": dict(variants)}
    try:
        for s in servers.values():
            s.wait_ready()

        def quiet() -> None:
            for label, s in servers.items():
                flags = dict(variants)[label]
                if "--no-cache" not in flags:
                    if "--hot-cache-only" not in flags:
                        s.wait_ssd_writes()
                    s.wait_demoted()
                s.wait_idle()
                s.wait_warmed()

        # kernels, then the prefill shapes of this length (graph warm-up or not, each server
        # prefills one prompt of it before anything is timed)
        for s in servers.values():
            bg.ttft(s.url, wl.body(wl.prompt(128), 2))
        for s in servers.values():
            quiet()
            bg.ttft(s.url, wl.body(wl.prompt(args.tokens), 2))
        ttfts: dict[str, list[float]] = {label: [] for label in servers}
        labels = list(servers)
        for r in range(args.rounds):
            order = labels[r % len(labels) :] + labels[: r % len(labels)]
            for label in order:
                quiet()
                t, cached = bg.ttft(servers[label].url, wl.body(wl.prompt(args.tokens), 2))
                if cached:
                    raise RuntimeError(f"{label}: a fresh prompt found {cached} tokens cached")
                ttfts[label].append(round(t, 4))
            bg.log(f"round {r + 1}/{args.rounds}: " + "  ".join(f"{k} {v[-1]:.3f}" for k, v in ttfts.items()))
        quiet()
    finally:
        for s in servers.values():
            s.stop()
    rows = {}
    for label, s in servers.items():
        text = (s.home / f"server-{s.starts}.log").read_text(errors="replace")
        lone = [m for m in PREFILLED.finditer(text) if int(m.group(1)) > args.tokens // 2 and m.group(2) == "0"]
        prefill = [float(m.group(3)) for m in lone][-args.rounds :]
        chunks = [float(m.group(5)) for m in lone][-args.rounds :]
        rows[label] = {"ttft": ttfts[label], "prefill": prefill, "chunks": chunks}
    base = rows[labels[0]]
    print(f"\n{args.shape}, {args.tokens}-token misses, {args.rounds} rounds (median ratio to {labels[0]})")
    for label, row in rows.items():
        parts = []
        for key in ("ttft", "prefill", "chunks"):
            v = row[key]
            if v and base[key]:
                ratio = statistics.median(v) / statistics.median(base[key])
                parts.append(f"{key} best {min(v):.3f} median {statistics.median(v):.3f} ({ratio:.3f}x)")
        print(f"  {label:<10} " + " | ".join(parts))
        print(f"  {'':<10} ttft {row['ttft']} prefill {row['prefill']}")
    results["rows"] = rows
    (out / f"cache-ab-{args.shape}.json").write_text(json.dumps(results, indent=2))
    for label, s in servers.items():
        log = s.home / f"server-{s.starts}.log"
        (out / f"cache-ab-server-{label}.log").write_text(log.read_text(errors="replace")[-400_000:])


if __name__ == "__main__":
    main()
