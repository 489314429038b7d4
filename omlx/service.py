"""`omlx service`: run the server under the user's service manager, a systemd user unit on
Linux or a launchd agent on macOS, restarted when it fails (exit code 75, a lost GPU, included;
not after a settings error, exit code 2, which a restart cannot fix).

The settings the service starts with (the install's flags and the `OMLX_*` variables set then)
are written as environment variables to a file only the user can read: a systemd
`EnvironmentFile`, or the agent's own plist. `$OMLX_HOME/settings.json` applies as for `omlx serve`.
"""

from __future__ import annotations

import os
import plistlib
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omlx.errors import ConfigError

UNIT_NAME = "omlx.service"
LAUNCHD_LABEL = "com.omlx.server"
RESTART_SEC = 5
EXIT_SETTINGS = 2  # a settings error (omlx.errors.ConfigError): restarting would fail again

Run = Callable[[list[str]], subprocess.CompletedProcess]


@dataclass(frozen=True)
class ServiceSpec:
    """What the service runs: this Python's `omlx serve`, with `env` (OMLX_* variables)."""

    python: str
    env: dict[str, str]
    home: Path

    @property
    def command(self) -> list[str]:
        return [self.python, "-m", "omlx", "serve"]

    @property
    def log_dir(self) -> Path:
        return Path(self.env.get("OMLX_LOG_DIR") or self.home / "logs")


def spec_for(flags: dict[str, str], environ: dict[str, str], home: Path) -> ServiceSpec:
    """The install's flags (setting name -> value) over the `OMLX_*` variables set now; log
    files in `$OMLX_HOME/logs` unless set otherwise."""
    from omlx.settings import SETTINGS_BY_NAME

    env = {k: v for k, v in environ.items() if k.startswith("OMLX_")}
    env.update({SETTINGS_BY_NAME[name].env: value for name, value in flags.items()})
    env["OMLX_HOME"] = str(home)
    env.setdefault("OMLX_LOG_DIR", str(home / "logs"))
    return ServiceSpec(sys.executable, env, home)


def _quote_env(value: str) -> str:
    """A systemd EnvironmentFile value: double-quoted, backslashes, quotes and $ escaped."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$") + '"'


def _unquote_env(text: str) -> str:
    """`_quote_env`'s value back."""
    body, out, i = text.strip()[1:-1], [], 0
    while i < len(body):
        if body[i] == "\\" and i + 1 < len(body):
            i += 1
        out.append(body[i])
        i += 1
    return "".join(out)


def render_env_file(spec: ServiceSpec) -> str:
    return "".join(f"{key}={_quote_env(value)}\n" for key, value in sorted(spec.env.items()))


def render_systemd_unit(spec: ServiceSpec, env_file: Path) -> str:
    """The user unit: `omlx serve` with the settings file, restarted on failure."""
    return f"""[Unit]
Description=oMLX local LLM server
After=network-online.target

[Service]
Type=exec
ExecStart={shlex.join(spec.command)}
EnvironmentFile={env_file}
Restart=on-failure
RestartSec={RESTART_SEC}
RestartPreventExitStatus={EXIT_SETTINGS}
TimeoutStopSec=30

[Install]
WantedBy=default.target
"""


def render_launchd_plist(spec: ServiceSpec) -> bytes:
    """The launch agent: started at login, started again after any exit but a clean one or 2."""
    return plistlib.dumps({
        "Label": LAUNCHD_LABEL,
        "ProgramArguments": spec.command,
        "EnvironmentVariables": dict(sorted(spec.env.items())),
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": RESTART_SEC,
        "StandardOutPath": str(spec.log_dir / "launchd.out.log"),
        "StandardErrorPath": str(spec.log_dir / "launchd.err.log"),
    })


def _write_private(path: Path, data: str | bytes) -> None:
    """Write `data` readable by the user alone (it may hold the API key)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


class Systemd:
    """A systemd user unit in `~/.config/systemd/user`."""

    def __init__(self, spec: ServiceSpec, run: Run = _run, config_home: Path | None = None):
        self.spec = spec
        self.run = run
        root = config_home or Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
        self.unit_path = root / "systemd" / "user" / UNIT_NAME
        self.env_path = spec.home / "service.env"

    def _ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        try:
            result = self.run(["systemctl", "--user", *args])
        except FileNotFoundError:
            raise ConfigError("systemctl is not installed: this system has no systemd to run the service.") from None
        if check and result.returncode != 0:
            detail = (result.stderr or result.stdout).strip().splitlines()
            raise ConfigError(f"systemctl --user {' '.join(args)} failed: {detail[-1] if detail else result.returncode}"
                              " (a user systemd must run: log in through a session, or `loginctl enable-linger`).")
        return result

    def install(self) -> str:
        _write_private(self.env_path, render_env_file(self.spec))
        self.unit_path.parent.mkdir(parents=True, exist_ok=True)
        self.unit_path.write_text(render_systemd_unit(self.spec, self.env_path))
        self._ctl("daemon-reload")
        self._ctl("enable", UNIT_NAME)
        return f"installed {self.unit_path} (settings in {self.env_path}); start it with: omlx service start"

    def uninstall(self) -> str:
        if self.unit_path.exists():
            self._ctl("disable", "--now", UNIT_NAME, check=False)
            self.unit_path.unlink()
            self._ctl("daemon-reload", check=False)
        self.env_path.unlink(missing_ok=True)
        return f"removed {self.unit_path}"

    def start(self) -> str:
        self._ctl("start", UNIT_NAME)
        return "started " + UNIT_NAME

    def stop(self) -> str:
        self._ctl("stop", UNIT_NAME)
        return "stopped " + UNIT_NAME

    def status(self) -> str:
        return self._ctl("status", "--no-pager", UNIT_NAME, check=False).stdout.strip()


class Launchd:
    """A launch agent in `~/Library/LaunchAgents`, in the user's GUI domain."""

    def __init__(self, spec: ServiceSpec, run: Run = _run, agents_dir: Path | None = None):
        self.spec = spec
        self.run = run
        self.plist_path = (agents_dir or Path.home() / "Library" / "LaunchAgents") / f"{LAUNCHD_LABEL}.plist"
        self.domain = f"gui/{os.getuid()}"

    def _ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        result = self.run(["launchctl", *args])
        if check and result.returncode != 0:
            detail = (result.stderr or result.stdout).strip()
            raise ConfigError(f"launchctl {' '.join(args)} failed: {detail or result.returncode}")
        return result

    def install(self) -> str:
        self.spec.log_dir.mkdir(parents=True, exist_ok=True)
        _write_private(self.plist_path, render_launchd_plist(self.spec))
        return f"installed {self.plist_path}; start it with: omlx service start (it then starts at login)"

    def uninstall(self) -> str:
        self._ctl("bootout", f"{self.domain}/{LAUNCHD_LABEL}", check=False)
        self.plist_path.unlink(missing_ok=True)
        return f"removed {self.plist_path}"

    def start(self) -> str:
        if not self.plist_path.exists():
            raise ConfigError("The service is not installed: run omlx service install first.")
        self._ctl("bootstrap", self.domain, str(self.plist_path))
        return "started " + LAUNCHD_LABEL

    def stop(self) -> str:
        self._ctl("bootout", f"{self.domain}/{LAUNCHD_LABEL}")
        return "stopped " + LAUNCHD_LABEL

    def status(self) -> str:
        result = self._ctl("print", f"{self.domain}/{LAUNCHD_LABEL}", check=False)
        return (result.stdout or result.stderr).strip()


def manager(spec: ServiceSpec) -> Systemd | Launchd:
    """This platform's service manager."""
    if sys.platform == "darwin":
        return Launchd(spec)
    if sys.platform.startswith("linux"):
        return Systemd(spec)
    raise ConfigError(f"omlx service supports Linux (systemd) and macOS (launchd), not {sys.platform}.")


def installed_log_dir(spec: ServiceSpec) -> Path:
    """The log dir the installed service writes to (its own settings), else `spec`'s."""
    env_file = spec.home / "service.env"
    if sys.platform.startswith("linux") and env_file.exists():
        for line in env_file.read_text().splitlines():
            key, _, value = line.partition("=")
            if key == "OMLX_LOG_DIR":
                return Path(_unquote_env(value))
    plist = Path.home() / "Library" / "LaunchAgents" / f"{LAUNCHD_LABEL}.plist"
    if sys.platform == "darwin" and plist.exists():
        env = plistlib.loads(plist.read_bytes()).get("EnvironmentVariables", {})
        if env.get("OMLX_LOG_DIR"):
            return Path(env["OMLX_LOG_DIR"])
    return spec.log_dir


def tail(path: Path, lines: int) -> list[str]:
    """The last `lines` lines of `path` (reads from the end; the file may be large)."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size, block, data = f.tell(), 1 << 16, b""
        while size > 0 and data.count(b"\n") <= lines:
            step = min(block, size)
            size -= step
            f.seek(size)
            data = f.read(step) + data
    return data.decode(errors="replace").splitlines()[-lines:]
