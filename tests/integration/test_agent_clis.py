"""The real agent CLIs (Claude Code, Codex, OpenCode; pinned in tests/agents/package.json and
installed by the test setup) each run a two-turn session through `omlx launch` against
`omlx serve`, in a loopback-only network namespace where the machine allows one (and with each
CLI's telemetry off either way): both turns exit 0 with the model's answer on stdout, the
second turn's request restores at least the first turn's prompt less one cache block, and the
user's own configuration files are left as they were.

The model is tiny and answers "pong" (tests/support/pong_model.py), with a 32k window and a
per-model cap on max_tokens (Claude Code asks for 32000).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.pong_model import ANSWER, build_pong_model
from tests.support.qwen_coder import qwen_coder_dir

ROOT = Path(__file__).resolve().parent.parent
AGENTS_DIR = ROOT / "agents"
MODEL = "pong"
BLOCK = 256
CAP = 64
TURNS = {
    "claude": [["-p", "Say pong.", "--tools", "Read"], ["-p", "--continue", "Again, please.", "--tools", "Read"]],
    "codex": [["exec", "--skip-git-repo-check", "Say pong."],
              ["exec", "resume", "--last", "--skip-git-repo-check", "Again, please."]],
    "opencode": [["run", "Say pong."], ["run", "--continue", "Again, please."]],
}  # fmt: skip
USER_FILES = {  # the user's own configuration, which `omlx launch` must not touch
    ".codex/config.toml": 'model = "gpt-5"\n',
    ".config/opencode/opencode.json": '{"model": "anthropic/claude-sonnet-4-5"}\n',
    ".claude/settings.json": '{"env": {"MY_SETTING": "1"}}\n',
}

pytestmark = pytest.mark.skipif(shutil.which("npm") is None, reason="npm is absent: the agent CLIs cannot be installed")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """The pong model, with its max_tokens cap set in the server home each session copies."""
    if not (AGENTS_DIR / "node_modules" / ".bin" / "opencode").exists():  # the test setup installs them
        subprocess.run(["npm", "install", "--no-audit", "--no-fund"], cwd=AGENTS_DIR, check=True, capture_output=True)
    root = tmp_path_factory.mktemp("cli-models")
    build_pong_model(root / MODEL, qwen_coder_dir())
    return root


def isolation() -> list[str]:
    """`unshare --net` where this machine allows a network namespace of our own, else nothing."""
    if shutil.which("unshare") and subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode == 0:
        return ["unshare", "--net"]
    return []


def session(agent: str, models: Path, work: Path) -> dict:
    home = work / "home"
    for rel, text in USER_FILES.items():
        (home / rel).parent.mkdir(parents=True, exist_ok=True)
        (home / rel).write_text(text)
    server_home = work / "server"
    server_home.mkdir(parents=True)
    (server_home / "model_settings.json").write_text(json.dumps({MODEL: {"max_tokens_cap": CAP}}))
    out = work / "result.json"
    args = [arg for turn in TURNS[agent] for arg in [*turn, ";;"]][:-1]
    cmd = [*isolation(), sys.executable, "-m", "tests.support.agent_session", agent, str(models), MODEL, str(work),
           str(out), "--", *args]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT.parent, check=True, timeout=1500)
    return json.loads(out.read_text())


@pytest.mark.parametrize("agent", ["claude", "codex", "opencode"])
def test_a_two_turn_session_answers_and_restores_the_first_turn(agent, models, tmp_path):
    result = session(agent, models, tmp_path)
    assert result["isolated"] or not isolation(), "the session ran with more than loopback"
    for turn in result["turns"]:
        assert turn["exit"] == 0, turn
        assert ANSWER in turn["stdout"], turn
        assert turn["requests"], turn
    first = max(r["prompt"] for r in result["turns"][0]["requests"])
    restored = max(r["cached"] for r in result["turns"][1]["requests"])
    assert restored >= first - BLOCK, result["turns"]
    for rel, text in USER_FILES.items():
        now = (tmp_path / "home" / rel).read_text()
        if rel.endswith(".json"):  # OpenCode adds a "$schema" key to its user config itself
            now, text = {**json.loads(now), "$schema": None}, {**json.loads(text), "$schema": None}
        assert now == text, rel
