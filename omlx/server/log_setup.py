"""The server's logging: stderr and, with `--log-dir`, a file rotated at midnight and kept
`--log-retention-days`; text or JSON lines (`--log-format`), each with a request id and model.

A line's request id and model come from the request being served (`bind`, on the event loop),
else from an engine's thread (`engine:<model>`, and messages that begin `request=<id>`); "-" when
a line belongs to no request.
"""

from __future__ import annotations

import contextvars
import json
import logging
import logging.handlers
import sys
import time
from pathlib import Path
from typing import Any

LOG_FILE = "omlx.log"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s %(model)s]: %(message)s"
ENGINE_THREAD = "engine:"

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("omlx_request_id", default=None)
_model: contextvars.ContextVar[str | None] = contextvars.ContextVar("omlx_model", default=None)


def bind(*, request_id: str | None = None, model: str | None = None) -> None:
    """Name the request (and/or model) the current task serves on its later log lines."""
    if request_id is not None:
        _request_id.set(request_id)
    if model is not None:
        _model.set(model)


class RequestContext(logging.Filter):
    """Sets `record.request_id` and `record.model` (never drops a record)."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id, model = _request_id.get(), _model.get()
        if model is None and record.threadName.startswith(ENGINE_THREAD):
            model = record.threadName[len(ENGINE_THREAD):]
        if request_id is None and isinstance(record.msg, str) and record.msg.startswith("request=%s"):
            request_id = str(record.args[0]) if isinstance(record.args, tuple) and record.args else None
        record.request_id = getattr(record, "request_id", None) or request_id or "-"
        record.model = getattr(record, "model", None) or model or "-"
        return True


class JsonLines(logging.Formatter):
    """One JSON object per record: time, level, logger, request_id, model, message (+ exc)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
            + f".{int(record.msecs):03d}" + time.strftime("%z", time.localtime(record.created)),
            "level": record.levelname,
            "logger": record.name,
            "request_id": getattr(record, "request_id", "-"),
            "model": getattr(record, "model", "-"),
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def file_handler(log_dir: Path, retention_days: int) -> logging.Handler:
    """`log_dir/omlx.log`, rolled over at midnight (or at the first line of a later day) into
    `omlx.log.YYYY-MM-DD`, of which the newest `retention_days` are kept."""
    log_dir.mkdir(parents=True, exist_ok=True)
    return logging.handlers.TimedRotatingFileHandler(
        log_dir / LOG_FILE, when="midnight", backupCount=retention_days, encoding="utf-8"
    )


def configure_logging(level: str, log_format: str = "text", log_dir: Path | None = None,
                      retention_days: int = 7) -> None:
    """Replace the root logger's handlers with stderr (and the file) in `log_format`."""
    formatter = JsonLines() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_dir is not None:
        handlers.append(file_handler(log_dir, retention_days))
    for handler in handlers:
        handler.setFormatter(formatter)
        handler.addFilter(RequestContext())
    logging.basicConfig(level=level.upper(), handlers=handlers, force=True)
