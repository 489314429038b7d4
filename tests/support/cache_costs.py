"""Test helpers for the prefix cache's saved restore-or-recompute measurements."""

from __future__ import annotations

import json
from pathlib import Path


def make_recompute_look_slow(home: Path) -> None:
    """Scale the saved prefill measurements under `home` by 1000, so that the next start restores
    every block it can: a tiny model recomputes faster than the SSD restores, and the decision
    then rightly reads only a probe's worth of blocks."""
    for f in (home / "cache" / "costs").glob("*.json"):
        state = json.loads(f.read_text())
        state["prefill"]["xt"] = [v * 1000 for v in state["prefill"]["xt"]]
        f.write_text(json.dumps(state))
