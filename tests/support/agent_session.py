"""One agent CLI's session against a real `omlx serve`, run in a process of its own so that it
can be put in a loopback-only network namespace (`unshare --net`): nothing the server or the
CLI sends can leave the machine. Writes what happened as JSON for the test to judge.

    python -m tests.support.agent_session AGENT MODEL_DIR MODEL WORK_DIR OUT_JSON -- TURN1 ARGS ;; TURN2 ARGS
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from tests.support.server import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "agents" / "node_modules" / ".bin"
LOG_LINE = re.compile(r"request=(\S+) model=\S+ prompt=(\d+) cached=(\d+) completion=(\d+) .*?ttft=([\d.]+)s")
TURN_TIMEOUT_S = 600


def requests_logged(log: str) -> list[dict]:
    return [{"id": m[1], "prompt": int(m[2]), "cached": int(m[3]), "completion": int(m[4]), "ttft": float(m[5])}
            for m in LOG_LINE.finditer(log)]  # fmt: skip


def loopback_only() -> bool:
    """Whether this process's network namespace has nothing but loopback (bringing `lo` up)."""
    subprocess.run(["ip", "link", "set", "lo", "up"], capture_output=True)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return bool(links) and all(": lo:" in line for line in links.splitlines() if line.strip())


def run(agent: str, model_dir: Path, model: str, work: Path, turns: list[list[str]]) -> dict:
    home, repo = work / "home", work / "repo"
    repo.mkdir(parents=True, exist_ok=True)
    isolated = loopback_only()  # before anything listens: `lo` starts down in a new namespace
    server = ServerProcess(work / "server", ["--model-dir", str(model_dir), "--model", model])
    server.start()
    env = {**os.environ, "HOME": str(home), "OMLX_HOME": str(home / ".omlx"), "PWD": str(repo),
           "PATH": f"{BIN}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT.parent)}  # fmt: skip
    result: dict = {"agent": agent, "isolated": isolated, "turns": []}
    try:
        for args in turns:
            before = len(server.log_path.read_text(errors="replace"))
            start = time.monotonic()
            cmd = [sys.executable, "-m", "omlx", "launch", agent, "--url", server.base_url, "--model", model,
                   "--", *args]  # fmt: skip
            try:
                done = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=TURN_TIMEOUT_S)
                code, out, err = done.returncode, done.stdout, done.stderr
            except subprocess.TimeoutExpired as exc:
                code, out, err = "timeout", str(exc.stdout or ""), str(exc.stderr or "")
            time.sleep(0.5)  # the last request's log line
            result["turns"].append({
                "args": args, "exit": code, "stdout": out[-4000:], "stderr": err[-4000:],
                "seconds": round(time.monotonic() - start, 2),
                "requests": requests_logged(server.log_path.read_text(errors="replace")[before:]),
            })  # fmt: skip
    finally:
        server.stop()
    return result


def main() -> None:
    agent, model_dir, model, work, out = sys.argv[1:6]
    rest = sys.argv[sys.argv.index("--") + 1 :]
    turns, current = [], []
    for arg in rest:
        if arg == ";;":
            turns.append(current)
            current = []
        else:
            current.append(arg)
    turns.append(current)
    result = run(agent, Path(model_dir), model, Path(work), turns)
    Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
