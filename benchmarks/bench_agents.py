"""Coding agents' sessions, measured: Claude Code, Codex and OpenCode (the CLIs pinned in
tests/agents) each run a 5-turn task that reads and edits a file in a scratch git repo, tools
enabled, against oMLX serving Qwen2.5-Coder-0.5B; the OpenCode session also against
mlx_lm.server (it serves chat completions only, so not the other two).

Per turn: the requests the agent sent, their prompt and restored (cached) tokens and TTFT, from
the server's request log lines; tool calls emitted, counted by a regex of our own over the raw
output the server logs at debug level, against the calls the server parsed. Goals: from the
second turn on, >= 90% of each turn's prompt tokens restored; emitted == parsed.

Everything runs in a loopback-only network namespace where the machine allows one
(`unshare --net`), with each CLI's telemetry off (`omlx launch` sets it).

    .venv/bin/python benchmarks/bench_agents.py                       # ~1 h on 2 CPUs
    .venv/bin/python benchmarks/bench_agents.py --agents opencode --turns 2 --no-peer
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import REPO_ROOT, Server, header_info, log, machine_summary, prepare_model, write_json  # noqa: E402

from omlx.launch.agents import ServerInfo, opencode_config  # noqa: E402
from tests.support.agent_session import BIN, loopback_only, requests_logged  # noqa: E402
from tests.support.qwen_coder import qwen_coder_dir  # noqa: E402

TASK = [
    "Read greet.py and tell me in one sentence what greet() returns.",
    "Edit greet.py so that greet() returns 'Hello, oMLX!'.",
    "Add a function farewell() to greet.py that returns 'Bye'.",
    "Read greet.py again and list the names of its functions.",
    "Add a one-line docstring to greet() in greet.py.",
]
GREET = 'def greet():\n    return "Hello"\n'
TURN_TIMEOUT_S = 1800
RAW = re.compile(r"request=(\S+) raw_output=(\".*?(?<!\\)\") tool_calls=(\d+)")
# a call as the model writes one (hermes <tool_call> envelope, a fence or bare JSON alike)
EMITTED = re.compile(r'"name"\s*:\s*"[^"]+"\s*,\s*"(?:arguments|parameters)"\s*:')


def agent_args(agent: str, turn: int, prompt: str) -> list[str]:
    """The CLI's arguments for one turn: non-interactive, tools allowed in the repo, continuing
    the session after the first turn."""
    if agent == "claude":
        more = ["--continue"] if turn else []
        return ["-p", *more, prompt, "--tools", "Read,Edit,Write", "--permission-mode", "acceptEdits"]
    if agent == "codex":
        flags = ["--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"]
        return ["exec", "resume", "--last", *flags, prompt] if turn else ["exec", *flags, prompt]
    more = ["--continue"] if turn else []
    return ["run", *more, prompt]


def scratch_repo(root: Path) -> Path:
    repo = root / "repo"
    repo.mkdir(parents=True)
    (repo / "greet.py").write_text(GREET)
    for cmd in (["init", "-q"], ["add", "."], ["-c", "user.email=b@x", "-c", "user.name=b", "commit", "-qm", "start"]):
        subprocess.run(["git", *cmd], cwd=repo, check=True)
    return repo


def per_request(log_text: str) -> list[dict[str, Any]]:
    """The request log lines, each with the raw output's emitted and parsed tool calls."""
    raw = {m[1]: (json.loads(m[2]), int(m[3])) for m in RAW.finditer(log_text)}
    rows = requests_logged(log_text)
    for row in rows:
        text, parsed = raw.get(row["id"], ("", 0))
        row["emitted_calls"], row["parsed_calls"] = len(EMITTED.findall(text)), parsed
        if row["emitted_calls"] != parsed:
            row["raw_output"] = text  # kept in --json where the counts differ, to be read
    return rows


def run_turns(agent: str, command: Any, env: dict[str, str], repo: Path, log_path: Path, turns: int) -> list[dict]:
    out = []
    for i, prompt in enumerate(TASK[:turns]):
        before = len(log_path.read_text(errors="replace"))
        start = time.monotonic()
        try:
            done = subprocess.run(command(agent_args(agent, i, prompt)), cwd=repo, env=env, capture_output=True,
                                  text=True, timeout=TURN_TIMEOUT_S)  # fmt: skip
            code, stdout = done.returncode, done.stdout
        except subprocess.TimeoutExpired as exc:
            code, stdout = "timeout", str(exc.stdout or "")
        time.sleep(1.0)  # the last request's log lines
        rows = per_request(log_path.read_text(errors="replace")[before:])
        turn = {"turn": i + 1, "exit": code, "seconds": round(time.monotonic() - start, 1), "requests": rows,
                "stdout": stdout[-600:]}  # fmt: skip
        log(f"{agent} turn {i + 1}: exit {code}, {turn['seconds']} s, {len(rows)} requests")
        out.append(turn)
    return out


def session(agent: str, model: Any, work: Path, turns: int, peer: bool) -> dict[str, Any]:
    home = work / "home"
    home.mkdir(parents=True)
    repo = scratch_repo(work)
    env = {**os.environ, "HOME": str(home), "OMLX_HOME": str(home / ".omlx"), "PATH": f"{BIN}:{os.environ['PATH']}",
           "PYTHONPATH": str(REPO_ROOT)}  # fmt: skip
    server = Server("mlx_lm" if peer else "omlx", model, [] if peer else ["--log-level", "debug"])
    server.start(timeout=600)
    try:
        if peer:  # the same OpenCode provider `omlx launch` writes, pointed at mlx_lm.server
            config = work / "opencode-peer.json"
            info = ServerInfo(server.base_url, server.request_model, 32768)
            config.write_text(json.dumps(opencode_config(info), indent=2))
            env |= {"OPENCODE_CONFIG": str(config), "OPENCODE_DISABLE_AUTOUPDATE": "1",
                    "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_SHARE": "1"}  # fmt: skip
            command = lambda args: ["opencode", *args]  # noqa: E731
        else:
            command = lambda args: [sys.executable, "-m", "omlx", "launch", agent, "--url", server.base_url,  # noqa: E731
                                    "--model", model.model_id, "--", *args]  # fmt: skip
        result = run_turns(agent, command, env, repo, server.log_path, turns)
    finally:
        server.cleanup()
    return {"agent": agent, "server": "mlx_lm.server" if peer else "oMLX", "turns": result,
            "final_file": (repo / "greet.py").read_text()}  # fmt: skip


def summary(run: dict[str, Any]) -> list[str]:
    lines = [f"\n{run['agent']} against {run['server']}",
             "| turn | exit | turn s | requests | prompt tokens | restored | restored % | TTFT mean / max (s) | calls emitted / parsed |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for t in run["turns"]:
        rows = t["requests"]
        prompt, cached = sum(r["prompt"] for r in rows), sum(r["cached"] for r in rows)
        ttfts = [r["ttft"] for r in rows] or [0.0]
        emitted, parsed = sum(r.get("emitted_calls", 0) for r in rows), sum(r.get("parsed_calls", 0) for r in rows)
        share = f"{100 * cached / prompt:.1f}" if prompt else "-"
        calls = f"{emitted} / {parsed}" if run["server"] == "oMLX" else "-"
        lines.append(f"| {t['turn']} | {t['exit']} | {t['seconds']} | {len(rows)} | {prompt:,} | {cached:,} | {share} | "
                     f"{sum(ttfts) / len(ttfts):.2f} / {max(ttfts):.2f} | {calls} |")  # fmt: skip
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", default="claude,codex,opencode")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--no-peer", action="store_true", help="skip OpenCode against mlx_lm.server")
    ap.add_argument("--json", help="write every request's figures here")
    ap.add_argument("--isolated", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.isolated and shutil.which("unshare") and subprocess.run(["unshare", "--net", "true"]).returncode == 0:
        raise SystemExit(subprocess.run(["unshare", "--net", sys.executable, *sys.argv, "--isolated"]).returncode)
    isolated = loopback_only() if args.isolated else False
    if not (BIN / "opencode").exists():
        raise SystemExit("The agent CLIs are missing: run `bash scripts/setup.sh test` (npm ci in tests/agents).")
    model = prepare_model(qwen_coder_dir())
    log(f"{machine_summary()}; loopback only: {isolated}")
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-agents-") as tmp:
        for agent in args.agents.split(","):
            runs.append(session(agent, model, Path(tmp) / agent, args.turns, peer=False))
        if "opencode" in args.agents.split(",") and not args.no_peer:
            runs.append(session("opencode", model, Path(tmp) / "opencode-peer", args.turns, peer=True))
    for run in runs:
        print("\n".join(summary(run)))
    pair = [r for r in runs if r["agent"] == "opencode"]
    if len(pair) == 2:  # the session's wall time, turn by turn: the peer logs no per-request figures
        ours, peer = (sum(t["seconds"] for t in r["turns"]) for r in pair)
        print(f"\nOpenCode session: oMLX {ours:.1f} s, mlx_lm.server {peer:.1f} s, ratio peer/oMLX {peer / ours:.2f}x")
    write_json(args.json, {**header_info(sys.argv, model), "loopback_only": isolated, "runs": runs})


if __name__ == "__main__":
    main()
