#!/usr/bin/env python
"""Send 1, then N concurrent streamed requests to `omlx serve`; if they stall, dump the
server's Python stacks with py-spy (used to find where concurrent streams hang on CUDA)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent)]
import bench_gpu as bg  # noqa: E402

shape, n, py_spy = sys.argv[1], int(sys.argv[2]), sys.argv[3]
work = Path("/tmp/omlx-bench-gpu")
home = work / "homes" / "probe"
srv = bg.Server(
    "probe", work / "models", shape, home, ["--max-concurrent-requests", "32", *sys.argv[4:]]
)
srv.start()
try:
    print("load", srv.wait_ready(), flush=True)
    wl = bg.Workload(shape, [2])
    for k in (1, 2, 4, n):
        done: list[float] = []

        def go(done: list[float] = done) -> None:
            rec = bg.one(srv.url, wl.body(wl.prompt(128), 16))
            done.append(rec["done"] - rec["sent"])

        threads = [threading.Thread(target=go, daemon=True) for _ in range(k)]
        tic = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=max(0.1, 25 - (time.perf_counter() - tic)))
        print(f"{k} streams: {len(done)} done in {time.perf_counter() - tic:.2f}s", flush=True)
        if len(done) < k:
            out = subprocess.run(
                [py_spy, "dump", "--pid", str(srv.proc.pid)], capture_output=True, text=True
            )
            print(out.stdout[-8000:], out.stderr[-2000:], flush=True)
            break
finally:
    srv.stop()
    print(srv.log_tail()[-3000:])
