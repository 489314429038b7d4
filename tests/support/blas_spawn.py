"""Run by tests/integration/test_mcp_blas.py with OpenBLAS preloaded: matrix products on a thread
must keep finishing while `McpManager` starts (and restarts) 20 stdio servers under uvloop, as in
`omlx serve`. Prints the products finished in each of 8 seconds; exit code 0 when no second was
empty, 1 otherwise. `same-loop` runs the connections on uvloop itself (the first version's way),
which stalls the products (docs/design/mcp.md)."""

from __future__ import annotations

import asyncio
import os
import sys
import threading

import mlx.core as mx
import uvloop

from omlx.mcp.config import ServerSpec
from omlx.mcp.manager import McpManager

finished = [0]


def products() -> None:
    a = mx.random.normal((256, 256))
    while True:
        mx.eval(a @ a)
        finished[0] += 1


async def main() -> int:
    manager = McpManager([ServerSpec(f"s{i}", "stdio", "/bin/true") for i in range(20)], connect_timeout=2)
    if sys.argv[1:] == ["same-loop"]:
        manager._tasks = [asyncio.create_task(manager._keep(c)) for c in manager.connections.values()]
    else:
        manager.start()
    per_second = []
    for _ in range(8):
        before = finished[0]
        await asyncio.sleep(1)
        per_second.append(finished[0] - before)
    starts = sum(c.attempts for c in manager.connections.values())
    print(f"products per second: {per_second}; server starts: {starts}", flush=True)
    return 0 if all(per_second) and starts >= 40 else 1


if __name__ == "__main__":
    mx.set_default_device(mx.cpu)
    threading.Thread(target=products, daemon=True).start()
    code = uvloop.run(main())
    os._exit(code)  # MLX's threads abort a normal interpreter exit
