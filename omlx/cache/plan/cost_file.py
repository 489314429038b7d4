"""A model's restore-or-recompute measurements saved beside its SSD blocks, so the first
restore after a restart is decided on this device's numbers. No MLX here."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

from omlx.cache.plan.restore_model import RestoreModel

log = logging.getLogger("omlx.cache")

SAVE_EVERY_S = 5.0  # prefills are frequent: at most this often unless forced
# One writer of measurement files at a time in the process: a reloaded model's new cache may
# save while the old one's close does, through the same temporary file.
_LOCK = threading.Lock()


class CostFile:
    """`<cache dir>/costs/<fingerprint>-<device kind>.json` (a directory moved to other
    hardware starts over); written by short-lived threads, newest state wins."""

    def __init__(self, path: Path):
        self.path = path
        self._saved = 0.0
        self._version = 0  # states handed to a writer thread
        self._written = 0  # the newest written
        self.unsaved = False  # a save was skipped for `SAVE_EVERY_S`: the newest state is not saved

    def load(self, model: RestoreModel) -> None:
        """Load the saved measurements into `model`; a missing or bad file only costs history."""
        try:
            model.load(json.loads(self.path.read_text()))
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring the saved cache measurements in %s: %s", self.path, exc)

    def save(self, model: RestoreModel, force: bool = False, wait: bool = False) -> None:
        """At most every `SAVE_EVERY_S` unless `force`; written by a short-lived thread (the
        engine thread may not wait behind the SSD writer's fsyncs), or here with `wait`."""
        now = time.monotonic()
        if not force and now - self._saved < SAVE_EVERY_S:
            self.unsaved = True
            return
        self._saved, self.unsaved = now, False
        self._version += 1
        job = (self._version, json.dumps(model.state()))
        if wait:
            self.write(*job)
            return
        try:
            threading.Thread(
                target=self.write, args=job, name="omlx-cache-costs", daemon=True
            ).start()
        except RuntimeError as exc:  # no thread to be had (interpreter shutdown): next time
            log.warning("could not save the cache measurements: %s", exc)

    def write(self, version: int, text: str) -> None:
        """Write one saved state unless a newer one was written already (threads may finish
        out of order)."""
        with _LOCK:
            if version <= self._written:
                return
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp.write_text(text)
                os.replace(tmp, self.path)
                self._written = version
            except OSError as exc:  # a full or read-only disk: the cache works on without history
                log.warning("could not save the cache measurements to %s: %s", self.path, exc)
