"""`omlx service` through the CLI: install writes the unit and its settings; where a user
systemd runs, the service starts, answers, and stops (elsewhere that part is an allowed skip)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import httpx
import pytest

from tests.integration.test_cli import assert_one_line_error, omlx
from tests.support.server import free_port


def user_systemd() -> str | None:
    """None when `systemctl --user` works here, else why not."""
    if not sys.platform.startswith("linux"):
        return "not Linux"
    try:
        r = subprocess.run(["systemctl", "--user", "show-environment"], capture_output=True, text=True, timeout=10)
    except FileNotFoundError:
        return "no systemctl"
    return None if r.returncode == 0 else (r.stderr.strip() or f"exit {r.returncode}")


@pytest.mark.allowed_skip(reason="needs a user systemd (a login session or lingering user); CI's container has none")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the systemd unit is Linux's")
def test_service_install_start_stop_uninstall(tiny_model_dir, tmp_path):
    port = free_port()
    env = {"XDG_CONFIG_HOME": str(tmp_path / "config")}
    args = ("service", "install", "--port", str(port), "--model-dir", str(tiny_model_dir), "--model", "tiny-llama")
    installed = omlx(*args, home=tmp_path / "home", env=env)
    unit = tmp_path / "config" / "systemd" / "user" / "omlx.service"
    env_file = tmp_path / "home" / "service.env"
    assert unit.exists() and f"EnvironmentFile={env_file}" in unit.read_text()
    assert stat.S_IMODE(os.stat(env_file).st_mode) == 0o600 and f'OMLX_PORT="{port}"' in env_file.read_text()
    why_not = user_systemd()
    if why_not is not None:  # what a user without a systemd session gets
        assert_one_line_error(installed, "systemctl --user daemon-reload failed")
        pytest.skip(f"no user systemd here: {why_not}")
    try:
        assert installed.returncode == 0, installed.stderr
        assert omlx("service", "start", home=tmp_path / "home", env=env).returncode == 0
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert "active (running)" in omlx("service", "status", home=tmp_path / "home", env=env).stdout
        assert omlx("service", "stop", home=tmp_path / "home", env=env).returncode == 0
        assert "inactive" in omlx("service", "status", home=tmp_path / "home", env=env).stdout
        logs = omlx("service", "logs", "-n", "200", home=tmp_path / "home", env=env)
        assert "ready: http://127.0.0.1:" in logs.stdout
    finally:
        omlx("service", "uninstall", home=tmp_path / "home", env=env)
    assert not unit.exists()
