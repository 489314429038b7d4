#!/usr/bin/env python
"""Is decode slower than at an earlier commit? Two `omlx serve` processes at once on the same
model, one from a temporary git worktree of REV and one from this checkout, rounds alternating
between them (a shared machine's noise then falls on both): prints each round's tok/s and the
best and mean of each side. Batch-1 by default; `--streams N` times N concurrent streams'
aggregate tok/s instead (all tokens over the batch's wall time, as `bench_serving.py` does).

    .venv/bin/python benchmarks/ab_decode.py REV [--rounds 6] [--tokens 256] [--streams 8]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import common
from bench_serving import conversation
from common import Server, prepare_model, run, stream_many


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rev", help="the earlier commit")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=256, help="output tokens per stream")
    ap.add_argument("--streams", type=int, default=1, help="concurrent streams (aggregate tok/s when > 1)")
    ap.add_argument("--model-path", default=None, help="MLX model folder (default: SmolLM2-135M-Instruct)")
    args = ap.parse_args()
    here = Path(common.REPO_ROOT)
    model = prepare_model(args.model_path)
    with tempfile.TemporaryDirectory(prefix="omlx-ab-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(here), "worktree", "add", "-q", "--detach", str(tree), args.rev], check=True)
        servers: dict[str, Server] = {}
        try:
            for label, root in ((args.rev, tree), ("this checkout", here)):
                common.REPO_ROOT = root  # `omlx serve` runs from there: `python -m omlx` imports that tree
                servers[label] = Server("omlx", model, ["--max-concurrent-requests", "8"], label=label).start()
            common.REPO_ROOT = here
            seeds = iter(range(9000, 10**6))

            def decode(server: Server) -> float:
                talks = [conversation(model, next(seeds), 64) for _ in range(args.streams)]
                results, wall = run(stream_many(server, talks, args.tokens, fixed_length=True))
                if args.streams == 1:
                    return results[0].decode_tps
                return sum(r.completion_tokens for r in results) / wall

            for s in servers.values():
                decode(s)  # warm
            rounds: dict[str, list[float]] = {label: [] for label in servers}
            labels = list(servers)
            for i in range(args.rounds):
                for label in labels if i % 2 == 0 else labels[::-1]:
                    rounds[label].append(decode(servers[label]))
            for label, values in rounds.items():
                print(f"{label:>14}: " + " / ".join(f"{v:.2f}" for v in values)
                      + f" tok/s; best {max(values):.2f}, mean {statistics.mean(values):.2f}")  # fmt: skip
        finally:
            for s in servers.values():
                s.cleanup()  # stops it and removes its temporary home
            subprocess.run(["git", "-C", str(here), "worktree", "remove", "--force", str(tree)], check=False)


if __name__ == "__main__":
    sys.exit(main())
