"""The fingerprints each model id has had (`FingerprintBook`), kept beside the SSD's blocks in
`<cache dir>/fingerprints.json`, so a miss whose blocks are cached for another build of the same
model (new weights, dtype, KV format or block size) can say so, also after a restart. No MLX."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

log = logging.getLogger("omlx.cache")

PER_MODEL = 4  # the most recent builds of a model that a miss is checked against


class FingerprintBook:
    """model id -> its most recent (fingerprint, block size), newest last; saved to `path` (None: kept in
    memory only) when a new one is added. Any thread."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._models: dict[str, list[tuple[str, int]]] = {}
        if path is not None:
            try:
                raw = json.loads(path.read_text())
                self._models = {str(m): [(str(f), int(b)) for f, b in seen][-PER_MODEL:] for m, seen in raw.items()}
            except FileNotFoundError:
                pass
            except (OSError, ValueError, TypeError, AttributeError) as exc:  # only the reason for a miss is lost
                log.warning("ignoring %s: %s", path, exc)

    def add(self, model_id: str, fingerprint: str, block_size: int) -> None:
        """Record `model_id`'s current build (a model's cache is made: its engine thread, at load)."""
        with self._lock:
            seen = self._models.setdefault(model_id, [])
            entry = (fingerprint, block_size)
            if seen and seen[-1] == entry:
                return
            if entry in seen:
                seen.remove(entry)
            seen.append(entry)
            del seen[:-PER_MODEL]
            if self.path is not None:  # under the lock: engines loading at once share the temporary file
                self._save(json.dumps(self._models))

    def _save(self, text: str) -> None:
        assert self.path is not None
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(text)
            os.replace(tmp, self.path)
        except OSError as exc:  # a full or read-only disk: only the reason for a miss is lost
            log.warning("could not save %s: %s", self.path, exc)

    def others(self, model_id: str, fingerprint: str) -> list[tuple[str, int]]:
        """`model_id`'s other builds (fingerprint, block size), newest first."""
        with self._lock:
            return [e for e in reversed(self._models.get(model_id, [])) if e[0] != fingerprint]
