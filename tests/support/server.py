"""Run `omlx serve` as a real subprocess on a free loopback port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

SHARED_KERNEL_CACHE = str(Path(tempfile.gettempdir()) / "omlx-tests-kernel-cache")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, home: Path, args: list[str], env: dict[str, str] | None = None):
        self.home = home
        self.args = args
        self.port = free_port()
        self.env = {
            **os.environ,
            "OMLX_HOME": str(home),
            "PYTHONUNBUFFERED": "1",
            # every test server has its own home; on CUDA they share MLX's compiled kernels
            "MLX_PTX_CACHE_DIR": os.environ.get("MLX_PTX_CACHE_DIR", SHARED_KERNEL_CACHE),
            **(env or {}),
        }
        self.proc: subprocess.Popen | None = None
        self.log_path = home / "server.log"
        self.health_seen: list[tuple[int, dict]] = []  # each distinct /health answer while starting

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omlx", "serve", "--port", str(self.port), *self.args],
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(f"{self.base_url}/health", timeout=1)
                if (r.status_code, r.json()) not in self.health_seen:
                    self.health_seen.append((r.status_code, r.json()))
                if r.status_code == 200:
                    return
            except (httpx.HTTPError, ValueError):  # not up yet, or not our JSON yet
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not become healthy:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-20000:]
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "_log", None):
            self._log.close()

    def kill(self) -> None:
        self.stop(signal.SIGKILL)
