"""Start-up: logging, model-dir checks, default-model provisioning, then uvicorn."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType

import uvicorn

from omlx.engine.device_fault import DEVICE, EXIT_DEVICE_LOST
from omlx.settings import Settings

log = logging.getLogger("omlx")

DEVICE_LOST_GRACE_S = 1.0  # for the failed requests' answers to go out before the shutdown
SHUTDOWN_DEADLINE_S = 30.0
# After SIGTERM or Ctrl-C, connections get this long to close once their requests were failed;
# then they are cut. With the engines' stop (llm_engine.STOP_STORES_S, STOP_WRITES_S) the
# process is gone within 15 s, however long a prefill it was in.
SHUTDOWN_GRACE_S = 3
SHUTDOWN_MESSAGE = "The server is shutting down; retry the request shortly."


class StoppingServer(uvicorn.Server):
    """uvicorn's server, which on the first SIGTERM or SIGINT also tells the engines to fail
    what they hold (`on_exit`), so that no stream keeps the graceful shutdown waiting."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]):
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first:
            self._on_exit()


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def prepare_model_dir(settings: Settings) -> str | None:
    """Check the model dir; provision the built-in default model when it holds none (and
    return its id: a fresh install loads it at start)."""
    from omlx.models.discovery import discover_models

    root = settings.model_dir
    if root.exists() and not root.is_dir():
        _fail(f"Model dir {root} is not a folder. Pass --model-dir with a folder.")
    try:
        root.mkdir(parents=True, exist_ok=True)
        list(root.iterdir())
    except OSError as exc:
        _fail(f"Model dir {root} is not usable ({exc.strerror}). Pass --model-dir with a readable folder.")
    found = discover_models(root)
    for problem in found.problems:
        log.warning("skipping %s: %s", problem.path, problem.reason)
    if found.models:
        return None
    from omlx.models.default_model import DEFAULT_MODEL_ID, provision_default_model

    print(f"No models in {root}: provisioning the built-in default model {DEFAULT_MODEL_ID}…", file=sys.stderr)
    from rich.console import Console
    from rich.progress import Progress

    try:
        with Progress(console=Console(stderr=True), transient=True) as progress:
            task = progress.add_task("importing", total=1.0)
            provision_default_model(
                root, progress=lambda stage, f: progress.update(task, completed=f, description=stage)
            )
    except Exception as exc:  # report the reason in one line; the server cannot start without a model
        _fail(f"Could not provision {DEFAULT_MODEL_ID}: {exc}")
    return DEFAULT_MODEL_ID


def run_server(settings: Settings) -> None:
    from omlx.server.log_setup import configure_logging

    try:
        configure_logging(settings.log_level, settings.log_format, settings.log_dir, settings.log_retention_days)
    except OSError as exc:
        _fail(f"Log dir {settings.log_dir} is not usable ({exc.strerror}). Pass --log-dir with a writable folder.")
    # MLX's CUDA backend compiles kernels at run time and caches them under /tmp by default,
    # which a reboot empties; keep them with oMLX's other state so only the first start pays.
    os.environ.setdefault("MLX_PTX_CACHE_DIR", str(settings.home / "kernel-cache"))
    # Its prefill attention runs cuDNN graphs built per (chunk, context) shape, in an LRU of
    # 128 by default: one 32,000-token prompt in 512-token chunks needs 63. Keep more. And
    # MLX raises an error on every new shape once a process has missed twice an LRU's
    # capacity (its "cache thrashing" check): a server meets new prompt lengths all its life,
    # so after a few hundred requests every prefill would fail. Misses only cost time here.
    # What an entry costs in build time and memory: docs/design/gpu-findings.md
    # (#attention-graph-cache-entries).
    os.environ.setdefault("MLX_CUDA_SDPA_CACHE_SIZE", "1024")
    os.environ.setdefault("MLX_ENABLE_CACHE_THRASHING_CHECK", "0")
    from omlx.models.loader import resolve_compute_dtype
    from omlx.platform_info import BLAS_HINT, blas_in_use, cuda_backend_problem, device_info
    from omlx.server.app import create_app

    dev = device_info()
    blas = blas_in_use() if dev["type"] == "cpu" else "n/a"
    log.info(
        "device=%s compute_dtype=%s blas=%s", dev["device"], resolve_compute_dtype(settings.compute_dtype), blas
    )
    if dev["type"] == "cpu" and (problem := cuda_backend_problem()):
        log.warning(problem)
    elif dev["type"] == "cpu" and sys.platform == "linux" and "OpenBLAS" not in blas:
        log.warning(BLAS_HINT)
    if not settings.api_key and settings.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("No API key is set and the server binds %s: anyone who can reach it can use it.", settings.host)
    elif not settings.api_key:
        log.info("No API key set: binding loopback only (%s).", settings.host)
    from omlx.errors import ConfigError

    try:
        app = create_app(settings)  # validates every setting before a slow first-run provisioning
    except ConfigError as exc:
        _fail(str(exc))
    app.state.provisioned = prepare_model_dir(settings)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM and then re-raises the signal; with no-op
    # handlers in place that re-raise ends nothing, so Ctrl-C is a clean exit instead of a
    # KeyboardInterrupt traceback.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    DEVICE.on_lost(shut_down_when_device_lost())
    config = uvicorn.Config(  # log_config=None: uvicorn's lines go through our handlers and format
        app, host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False, log_config=None,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    server = StoppingServer(config, on_exit=lambda: app.state.pool.stop_generating(SHUTDOWN_MESSAGE))
    app.state.listening = lambda: server.started  # the start's models are loaded, then "ready" is logged
    server.run()
    # The engines, SSD writer and downloads were stopped by the app's shutdown. Leave without
    # the interpreter's teardown: MLX's stream threads abort the process there ("terminate
    # called without an active exception") once a model has generated on an engine thread.
    _leave(EXIT_DEVICE_LOST if DEVICE.lost else 0)


def _leave(code: int) -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def shut_down_when_device_lost(
    grace_s: float = DEVICE_LOST_GRACE_S,
    deadline_s: float = SHUTDOWN_DEADLINE_S,
    kill: Callable[[], None] | None = None,
    leave: Callable[[int], None] | None = None,
) -> Callable[[str], None]:
    """What the server does when the GPU is lost (`DEVICE.on_lost`): after `grace_s`, for the
    failed requests' answers to go out, the graceful shutdown of a SIGTERM (the SSD writer
    finishes its queue), then exit code `EXIT_DEVICE_LOST` for a supervisor to restart it.
    A shutdown still running after `deadline_s` (an engine stuck in the broken device) ends
    in a hard exit with the same code."""
    kill = kill or (lambda: os.kill(os.getpid(), signal.SIGTERM))
    leave = leave or _leave

    def lost(reason: str) -> None:
        def stop() -> None:
            log.critical("shutting down (exit code %d): restart the server to use the GPU again", EXIT_DEVICE_LOST)
            hard = threading.Timer(deadline_s, leave, (EXIT_DEVICE_LOST,))
            hard.daemon = True
            hard.start()
            kill()

        timer = threading.Timer(grace_s, stop)
        timer.daemon = True
        timer.start()

    return lost
