"""The server `omlx launch` points an agent at: the one answering at the URL, or one it starts
(and stops when the agent exits), and the model the agent will use there."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from omlx.errors import ConfigError
from omlx.launch.agents import ServerInfo

START_TIMEOUT_S = 600.0  # a first start may import a model


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def answers(url: str) -> bool:
    """Whether an oMLX server answers at `url`."""
    try:
        r = httpx.get(url + "/", timeout=2)
        return r.status_code == 200 and r.json().get("name") == "oMLX"
    except (httpx.HTTPError, ValueError):
        return False


def start(url: str, host: str, port: int, log_path: Path, model: str | None) -> subprocess.Popen:
    """`omlx serve` in the background, its output in `log_path`; returns once it answers."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "omlx", "serve", "--host", host, "--port", str(port)]
    if model:
        args += ["--model", model]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise ConfigError(f"omlx serve exited with code {proc.returncode}; its log ({log_path}) ends:\n{tail}")
        if answers(url):
            return proc
        time.sleep(0.5)
    stop(proc)
    raise ConfigError(f"omlx serve did not answer at {url} within {START_TIMEOUT_S:.0f} s; see {log_path}.")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def server_info(url: str, model: str | None, api_key: str | None) -> ServerInfo:
    """The model (`model`, else the first chat model listed) with its window and output cap."""
    headers = _headers(api_key)
    try:
        cards = httpx.get(url + "/v1/models", headers=headers, timeout=30).raise_for_status().json()["data"]
    except httpx.HTTPStatusError as exc:
        raise ConfigError(f"{url}/v1/models answered {exc.response.status_code}: {exc.response.text[:200]}") from None
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        raise ConfigError(f"Could not list the models at {url}: {exc}") from None
    llms = [c for c in cards if c.get("type") in (None, "llm")]
    if model is None:
        if not llms:
            raise ConfigError(f"The server at {url} has no chat model; add one to its model dir.")
        card = llms[0]
    else:
        card = next((c for c in cards if c["id"] == model), None)
        if card is None:
            known = ", ".join(c["id"] for c in llms) or "none"
            raise ConfigError(f"Model '{model}' is not served at {url} (chat models: {known}).")
    cap = None
    try:
        settings = httpx.get(f"{url}/api/models/{card['id']}/settings", headers=headers, timeout=10)
        if settings.status_code == 200:
            cap = settings.json().get("max_tokens_cap")
    except (httpx.HTTPError, ValueError):
        pass
    return ServerInfo(url, card["id"], card.get("context_length") or 32768, api_key, cap, _slow_device(url, headers))


def _slow_device(url: str, headers: dict[str, str]) -> bool:
    """Whether the server computes on a CPU (its first agent prompts take many minutes)."""
    try:
        info = httpx.get(url + "/api/system", headers=headers, timeout=10).json()
        return str(info.get("device", {}).get("type", "cpu")) == "cpu"
    except (httpx.HTTPError, ValueError, AttributeError):
        return True
