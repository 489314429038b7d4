"""`omlx service`'s files: the systemd unit (checked by systemd-analyze), its settings file and
the launchd agent, rendered from the install's flags and OMLX_* variables."""

from __future__ import annotations

import plistlib
import shutil
import subprocess
import sys

import pytest

from omlx.service import (
    EXIT_SETTINGS,
    LAUNCHD_LABEL,
    render_env_file,
    render_launchd_plist,
    render_systemd_unit,
    spec_for,
)

ODD = 'k"e$y\\with spaces'


@pytest.fixture()
def spec(tmp_path):
    return spec_for({"port": "9001", "api_key": ODD}, {"OMLX_MODEL": "m", "PATH": "/bin"}, tmp_path)


def test_settings_file_carries_the_flags_over_the_environment(spec, tmp_path):
    text = render_env_file(spec)
    assert {line.split("=", 1)[0] for line in text.splitlines()} == {
        "OMLX_API_KEY", "OMLX_HOME", "OMLX_LOG_DIR", "OMLX_MODEL", "OMLX_PORT"}
    env_file = tmp_path / "service.env"
    env_file.write_text(text)
    # systemd reads double-quoted values as sh does (backslash before " \ ` $)
    read = subprocess.run(["sh", "-c", '. "$1"; printf "%s\\n" "$OMLX_API_KEY" "$OMLX_PORT" "$OMLX_MODEL"',
                           "sh", str(env_file)], capture_output=True, text=True, check=True)
    assert read.stdout.splitlines() == [ODD, "9001", "m"]


@pytest.mark.allowed_skip(reason="systemd-analyze exists on Linux with systemd only")
def test_systemd_unit_verifies_and_restarts_on_failure_but_not_on_a_settings_error(spec, tmp_path):
    env_file = tmp_path / "service.env"
    env_file.write_text(render_env_file(spec))
    unit = tmp_path / "omlx.service"
    unit.write_text(render_systemd_unit(spec, env_file))
    text = unit.read_text()
    assert f"ExecStart={sys.executable} -m omlx serve" in text
    assert "Restart=on-failure" in text and f"RestartPreventExitStatus={EXIT_SETTINGS}" in text
    assert ODD not in text  # the key stays in the settings file
    if shutil.which("systemd-analyze") is None:
        pytest.skip("no systemd-analyze on this machine")
    check = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and check.stderr.strip() == "", check.stderr


def test_launchd_agent_restarts_after_a_failed_exit(spec, tmp_path):
    agent = plistlib.loads(render_launchd_plist(spec))
    assert agent["Label"] == LAUNCHD_LABEL
    assert agent["ProgramArguments"] == [sys.executable, "-m", "omlx", "serve"]
    assert agent["KeepAlive"] == {"SuccessfulExit": False} and agent["RunAtLoad"] is True
    assert agent["EnvironmentVariables"]["OMLX_API_KEY"] == ODD
    assert agent["StandardErrorPath"].startswith(str(tmp_path / "logs"))
