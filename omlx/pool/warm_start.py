"""Warm starts: which models the server loads when it starts, before `/health` says ok.

`$OMLX_HOME/loaded_models.json` lists the models loaded now (rewritten at each load and each
unload but those of a shutdown), so after a stop, a crash or a reboot the same models come
back. At start: `--model`, then that list, then the pinned models, then the built-in default
model when this start provisioned it (a fresh install). A server in a new home with none of
these loads nothing until a request asks (the test suite's servers).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger("omlx.pool")

FILE_NAME = "loaded_models.json"


class LoadedModels:
    """The ids of the loaded models, in load order, mirrored to a JSON file (event loop)."""

    def __init__(self, path: Path):
        self.path = path
        self.ids: list[str] = self._read()

    def _read(self) -> list[str]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            log.warning("ignoring %s (%s): no models are loaded again at start", self.path, exc)
            return []
        ids = data.get("loaded") if isinstance(data, dict) else None
        return [i for i in ids if isinstance(i, str)] if isinstance(ids, list) else []

    def loaded(self, model_id: str) -> None:
        if model_id not in self.ids:
            self.ids.append(model_id)
            self._write()

    def unloaded(self, model_id: str) -> None:
        if model_id in self.ids:
            self.ids.remove(model_id)
            self._write()

    def _write(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps({"loaded": self.ids}, indent=2) + "\n")
            os.replace(tmp, self.path)
        except OSError as exc:  # the server serves on; only the next start is colder
            log.warning("could not record the loaded models in %s: %s", self.path, exc)


def models_to_warm(explicit: str | None, recorded: list[str], pinned: list[str], default: str | None) -> list[str]:
    """The start's load order without repeats: `--model`, the recorded, the pinned, the default."""
    out: list[str] = []
    for model_id in [explicit, *recorded, *pinned, default]:
        if model_id and model_id not in out:
            out.append(model_id)
    return out
