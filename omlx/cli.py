"""The `omlx` command line: serve, diagnose, models list / import-gguf, launch.

`serve`'s options are generated from `omlx.settings.SETTINGS`, so every setting
has exactly one flag, one env var and one help text. User errors print one line
and exit non-zero; tracebacks are for our bugs only.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.text import Text
from typer.core import TyperCommand

from omlx.errors import ConfigError
from omlx.settings import SETTINGS, SETTINGS_BY_NAME, load_settings

console = Console(stderr=True, soft_wrap=True)
# Plain click help and usage errors: rich's help tables cut flag names at 80 columns, and its
# markup would eat any [bracketed] text of a message.
app = typer.Typer(
    add_completion=False, no_args_is_help=True, rich_markup_mode=None, help="oMLX: local LLM server on MLX."
)
models_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="List and import models.")
app.add_typer(models_app, name="models")
service_app = typer.Typer(
    no_args_is_help=True, rich_markup_mode=None, help="Run the server as a systemd user unit or launchd agent."
)
app.add_typer(service_app, name="service")

HELP_WIDTH = 80
SERVE_EPILOG = (
    "Each flag can also be set as OMLX_<NAME> or in $OMLX_HOME/settings.json; on/off flags have a "
    "--no- form. Defaults and details: the settings table in README.md."
)


def fail(message: str, code: int = 2) -> None:
    """Print `message` as one line on stderr, verbatim (no markup), and exit with `code`."""
    console.print(Text.assemble(("error:", "red"), " ", message), highlight=False)
    raise SystemExit(code)


class ServeCommand(TyperCommand):
    """`omlx serve --help`: one line per flag, its setting's summary."""

    def format_options(self, ctx: Any, formatter: Any) -> None:
        rows = []
        for param in self.get_params(ctx):
            setting = SETTINGS_BY_NAME.get(param.name or "")
            if setting is not None:
                rows.append((setting.flag, setting.summary))
            elif getattr(param, "opts", None):  # --help
                rows.append((param.opts[0], getattr(param, "help", None) or ""))
        width = max(len(flag) for flag, _ in rows)
        with formatter.section("Options"):
            for flag, summary in rows:
                formatter.write(f"  {flag:<{width}}  {summary}\n")
        formatter.write_paragraph()
        formatter.write_text(SERVE_EPILOG)


def _serve_signature() -> inspect.Signature:
    """typer options for `serve`, one per setting, all defaulting to None (= not given)."""
    params = []
    for s in SETTINGS:
        if s.type is bool:
            option = typer.Option(None, f"{s.flag}/--no-{s.flag[2:]}", help=s.help, show_default=False)
            annotation: Any = bool | None
        else:
            option = typer.Option(None, s.flag, help=s.help, show_default=False)
            annotation = {int: int, float: float}.get(s.type, str) | None
        params.append(inspect.Parameter(s.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation))
    return inspect.Signature(params)


def serve(**cli: Any) -> None:
    """Start the HTTP server.

    An empty model dir gets the built-in default model first."""
    from omlx.platform_info import maybe_reexec_with_openblas, missing_backend

    if problem := missing_backend():
        fail(problem)
    maybe_reexec_with_openblas()
    try:
        settings = load_settings(cli)
    except ConfigError as exc:
        fail(str(exc))
    from omlx.server.runner import run_server

    run_server(settings)


serve.__signature__ = _serve_signature()  # type: ignore[attr-defined]
app.command("serve", cls=ServeCommand, context_settings={"max_content_width": HELP_WIDTH})(serve)


@app.command()
def diagnose(
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Print platform, device, memory and models."""
    from omlx.platform_info import (
        BLAS_HINT,
        maybe_reexec_with_openblas,
        missing_backend,
        platform_summary,
    )

    if problem := missing_backend():
        fail(problem)
    maybe_reexec_with_openblas()
    try:
        settings = load_settings()
    except ConfigError as exc:
        fail(str(exc))
    from omlx.models.discovery import discover_models
    from omlx.models.loader import resolve_compute_dtype

    info = platform_summary()
    found = discover_models(settings.model_dir)
    info.update(
        {
            "compute_dtype": resolve_compute_dtype(settings.compute_dtype),
            "home": str(settings.home),
            "model_dir": str(settings.model_dir),
            "cache_dir": str(settings.cache_dir),
            "models": sorted(found.models),
            "model_problems": [f"{p.path}: {p.reason}" for p in found.problems],
        }
    )
    if as_json:
        print(json.dumps(info, indent=2))
        return
    for key, value in info.items():
        if isinstance(value, list):
            value = ", ".join(value) or "(none)"
        print(f"{key:>18}: {value}")
    if info.get("type") == "cpu" and "OpenBLAS" not in str(info.get("blas")) and sys.platform == "linux":
        print(f"{'hint':>18}: {BLAS_HINT}")


@models_app.command("list")
def models_list(
    model_dir: Path | None = typer.Option(None, "--model-dir", help="Folder to scan (default: the setting)."),
) -> None:
    """List discovered models and report folders that are not valid models."""
    try:
        settings = load_settings({"model_dir": model_dir})
    except ConfigError as exc:
        fail(str(exc))
    from omlx.models.discovery import discover_models

    root = settings.model_dir
    if not root.exists():
        fail(f"Model dir {root} does not exist. Create it or pass --model-dir.")
    found = discover_models(root)
    if not found.models:
        print(f"No models in {root}.")
    for model_id, info in sorted(found.models.items()):
        ctx = info.context_length or "?"
        kind = f"{info.type}+vision" if info.vision else info.type
        print(f"{model_id}\t{kind}\tctx={ctx}\t{info.weight_bytes / 1e6:.1f} MB\t{info.path}")
    for problem in found.problems:
        print(f"skipped {problem.path}: {problem.reason}")


@models_app.command("import-gguf")
def models_import_gguf(
    path: Path = typer.Argument(..., help="The .gguf file."),
    name: str | None = typer.Option(None, "--name", help="Model id (folder name); default: the file's stem."),
    q_bits: int | None = typer.Option(None, "--q-bits", help="Re-quantize dequantized K-quant weights to 4 or 8 bits."),
    model_dir: Path | None = typer.Option(None, "--model-dir", help="Where to put it (default: the setting)."),
) -> None:
    """Turn a GGUF file into an MLX model folder in the model dir."""
    try:
        settings = load_settings({"model_dir": model_dir})
    except ConfigError as exc:
        fail(str(exc))
    if q_bits not in (None, 4, 8):
        fail("--q-bits must be 4 or 8.")
    if not path.is_file():
        fail(f"{path} is not a file. Pass the path of a .gguf file.")
    from rich.progress import Progress

    from omlx.models.gguf_import import GGUFImportError, import_gguf

    out = settings.model_dir / (name or path.name.removesuffix(".gguf"))
    if out.exists():
        fail(f"{out} already exists. Choose another --name or delete it.")
    settings.model_dir.mkdir(parents=True, exist_ok=True)
    try:
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("importing", total=1.0)
            import_gguf(path, out, q_bits=q_bits, progress=lambda stage, f: progress.update(task, completed=f, description=stage))
    except GGUFImportError as exc:
        fail(str(exc))
    print(f"imported {path.name} as {out.name} into {out}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def launch(
    ctx: typer.Context,
    agent: str = typer.Argument(..., help="claude, codex or opencode."),
    model: str | None = typer.Option(None, "--model", help="Model id (default: the server's first chat model)."),
    url: str | None = typer.Option(None, "--url", help="Server URL (default: http://HOST:PORT of the settings)."),
    print_config: bool = typer.Option(False, "--print-config", help="Print what would be set, then exit."),
) -> None:
    """Run a coding agent against oMLX (started if none answers); arguments after -- go to the agent."""
    import shutil
    import subprocess

    from omlx.launch import server as srv
    from omlx.launch.agents import AGENTS, INSTALL, ServerInfo, plan_for

    if agent not in AGENTS:
        fail(f"Unknown agent '{agent}'; choose one of {', '.join(AGENTS)}.")
    try:
        settings = load_settings()
    except ConfigError as exc:
        fail(str(exc))
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    base = (url or f"http://{host}:{settings.port}").rstrip("/")
    started = None
    try:
        if not srv.answers(base):
            if url is not None:
                fail(f"No oMLX server answers at {base}.")
            if print_config:
                info = ServerInfo(base, model or "<the server's first chat model>", 32768, settings.api_key)
                print(plan_for(agent, info, list(ctx.args), settings.home).describe())
                print(f"note: no server answers at {base}; `omlx launch` would start `omlx serve` there.")
                return
            log_path = settings.home / "logs" / "launch-serve.log"
            console.print(f"starting omlx serve at {base} (log: {log_path}) …", highlight=False)
            started = srv.start(base, settings.host, settings.port, log_path, model)
        info = srv.server_info(base, model, settings.api_key)
        plan = plan_for(agent, info, list(ctx.args), settings.home)
        if print_config:
            print(plan.describe())
            return
        if shutil.which(plan.command[0]) is None:
            fail(f"'{plan.command[0]}' is not on PATH. Install it: {INSTALL[agent]}")
        for path, text in plan.files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        console.print(f"{agent} → oMLX at {base}, model {info.model} (`omlx launch {agent} --print-config` "
                      "shows every setting)", highlight=False)  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k not in plan.unset} | plan.env | {"PWD": os.getcwd()}
        code = subprocess.run(plan.command, env=env).returncode
    except ConfigError as exc:
        fail(str(exc))
    finally:
        if started is not None:
            srv.stop(started)
    raise SystemExit(code)


# ----- omlx service ----------------------------------------------------------------------
def _service(flags: dict[str, Any] | None = None) -> Any:
    """This platform's service manager for the settings `flags` (given ones only) and OMLX_*."""
    import os

    from omlx.service import manager, spec_for
    from omlx.settings import omlx_home

    given = {k: v for k, v in (flags or {}).items() if v is not None}
    try:
        load_settings(given)  # a bad value fails here, not when the service starts
        texts = {k: (("true" if v else "false") if isinstance(v, bool) else str(v)) for k, v in given.items()}
        return manager(spec_for(texts, dict(os.environ), omlx_home()))
    except ConfigError as exc:
        fail(str(exc))


def _service_do(action: str, flags: dict[str, Any] | None = None) -> None:
    service = _service(flags)
    try:
        print(getattr(service, action)())
    except ConfigError as exc:
        fail(str(exc))


def service_install(**flags: Any) -> None:
    """Install it with serve's flags; it starts at login."""
    _service_do("install", flags)


service_install.__signature__ = _serve_signature()  # type: ignore[attr-defined]
service_app.command("install", cls=ServeCommand, context_settings={"max_content_width": HELP_WIDTH})(
    service_install
)


@service_app.command("uninstall")
def service_uninstall() -> None:
    """Stop the service and remove it."""
    _service_do("uninstall")


@service_app.command("start")
def service_start() -> None:
    """Start the installed service."""
    _service_do("start")


@service_app.command("stop")
def service_stop() -> None:
    """Stop the service."""
    _service_do("stop")


@service_app.command("status")
def service_status() -> None:
    """The service manager's view of the service."""
    _service_do("status")


@service_app.command("logs")
def service_logs(
    lines: int = typer.Option(50, "-n", "--lines", help="How many of the last lines to print."),
    follow: bool = typer.Option(False, "-f", "--follow", help="Keep printing new lines."),
) -> None:
    """Print its log file (by default in $OMLX_HOME/logs)."""
    import time

    from omlx.server.log_setup import LOG_FILE
    from omlx.service import installed_log_dir, tail

    path = installed_log_dir(_service().spec) / LOG_FILE
    if not path.exists():
        fail(f"No log file at {path} yet: is the service installed and started?")
    for line in tail(path, lines):
        print(line)
    if not follow:
        return
    with open(path, errors="replace") as f:
        f.seek(0, 2)
        while True:
            line = f.readline()
            if line:
                print(line, end="", flush=True)
            else:
                time.sleep(0.5)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app(prog_name="omlx")


if __name__ == "__main__":
    main()
