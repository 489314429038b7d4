"""Starting stdio MCP servers never stalls the engines' OpenBLAS matrix products: uvloop starts a
process with fork(), whose OpenBLAS handler stops the BLAS worker threads under a product in
flight; the MCP connections therefore run on a plain asyncio loop of their own
(docs/design/mcp.md). Checked in a subprocess with the system OpenBLAS preloaded, as
`omlx serve` preloads it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from omlx.platform_info import find_openblas

ROOT = Path(__file__).resolve().parents[2]


def test_blas_products_keep_running_while_mcp_servers_start() -> None:
    pytest.importorskip("mcp", reason="the omlx[mcp] extra (the test extra installs it)")
    blas = find_openblas()
    if blas is None:
        pytest.skip("no system OpenBLAS (scripts/setup.sh installs libopenblas0-pthread as root)")
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "blas_spawn.py")],
                          env={**os.environ, "LD_PRELOAD": blas, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "products per second" in proc.stdout
