"""Warm start as a new user sees it: `omlx serve` on a fresh home (the default model is
provisioned), then the same server restarted on that home.

For each start: seconds from the process start to `/health` 200, the model load the server
logs, and the time to first token of one ~2,000-token prompt sent as soon as `/health` is ok
(no warm-up request: what a client sees). The restart's prompt is the cold one again, so it
can come from the SSD tier. Goal: after-restart TTFT <= 0.1x cold TTFT.

    .venv/bin/python benchmarks/bench_warm_start.py                  # this checkout
    .venv/bin/python benchmarks/bench_warm_start.py --repo /tmp/old  # another tree of oMLX
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    PYTHON,
    REPO_ROOT,
    PreparedModel,
    bench_env,
    free_port,
    log,
    machine_summary,
    new_client,
    run,
    stream_chat,
    text_of_tokens,
)

MODEL = "SmolLM2-135M-Instruct"


class Start:
    """One `omlx serve` process on `home`, started from the tree `repo`."""

    def __init__(self, repo: Path, home: Path, n: int):
        self.port = free_port()
        self.log_path = home / f"server-{n}.log"
        self.label = "oMLX"
        self.model = None  # stream_chat reads `.model` only for fixed-length outputs
        env = bench_env({"OMLX_HOME": str(home)}, preload=False)
        self.t0 = time.perf_counter()
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen([PYTHON, "-m", "omlx", "serve", "--port", str(self.port)],
                                         cwd=repo, env=env, stdout=out, stderr=subprocess.STDOUT)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def request_model(self) -> str:
        return MODEL

    def wait_healthy(self, timeout: float = 600) -> float:
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return time.perf_counter() - self.t0
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise SystemExit("server not healthy in time")

    def load_seconds(self) -> str:
        found = re.findall(r"loaded \S+ in ([\d.]+)s", self.log_path.read_text(errors="replace"))
        return ", ".join(found) or "-"

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(60)


async def ask(server: Start, messages: list[dict[str, str]]) -> Any:
    """The prompt once, streamed, greedy, 4 tokens."""
    async with new_client() as client:
        return await stream_chat(client, server, messages, 4)  # type: ignore[arg-type]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", type=Path, default=REPO_ROOT, help="the oMLX tree to run (default: this one)")
    ap.add_argument("--tokens", type=int, default=2000, help="prompt length (default 2000)")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="bench-warm-"))
    rows = []
    messages = None
    try:
        for n, phase in enumerate(("cold", "restart")):
            start = Start(args.repo.resolve(), home, n)
            healthy = start.wait_healthy()
            if messages is None:
                folder = home / "models" / MODEL
                model = PreparedModel(path=folder, model_dir=folder.parent, model_id=MODEL, eos_ids=[])
                text = text_of_tokens(model, args.tokens, seed=2024, prefix="Read this document and summarise it.\n\n")
                messages = [{"role": "user", "content": text}]

            r = run(ask(start, messages))
            start.stop()
            rows.append((phase, healthy, start.load_seconds(), r.ttft, r.prompt_tokens, r.cached_tokens))
            log(f"{phase}: healthy after {healthy:.2f}s, ttft {r.ttft:.2f}s, cached {r.cached_tokens}/{r.prompt_tokens}")
    finally:
        if os.environ.get("BENCH_KEEP_HOMES") == "1":
            log(f"kept {home}")
        else:
            shutil.rmtree(home, ignore_errors=True)
    print(f"\n{machine_summary()}\ntree: {args.repo}\n")
    print("| start | process start to /health 200 (s) | model load logged (s) | TTFT (s) | cached / prompt tokens |")
    print("|---|---|---|---|---|")
    for phase, healthy, load, ttft, prompt, cached in rows:
        print(f"| {phase} | {healthy:.2f} | {load} | {ttft:.2f} | {cached} / {prompt} |")
    print(f"\nafter-restart TTFT / cold TTFT: {rows[1][3] / rows[0][3]:.3f}x (goal <= 0.1x)")


if __name__ == "__main__":
    main()
