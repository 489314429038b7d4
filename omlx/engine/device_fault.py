"""A GPU fault no request can recover from, and what the process does about it.

Some CUDA errors are "sticky": after one, the process's CUDA context is unusable and every
later call fails the same way, whatever the request (an "illegal memory access" has made
every later request fail with it). Only a new process gets a
working GPU again. So the first engine to meet one marks the device lost: the requests in
flight fail, new ones get a 503, `/health` says why, and the server shuts down and exits
with `EXIT_DEVICE_LOST` for its supervisor to restart it; the SSD cache keeps the prompt
prefixes across the restart.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from omlx.errors import OMLXError

log = logging.getLogger("omlx.engine")

# sysexits' EX_TEMPFAIL: a new process is expected to work
EXIT_DEVICE_LOST = 75

# CUDA's sticky errors, as cudaGetErrorString words them (MLX puts that text in its exceptions)
STICKY_CUDA_ERRORS = (
    "an illegal memory access was encountered",
    "unspecified launch failure",
    "misaligned address",
    "an illegal instruction was encountered",
    "hardware stack error",
    "invalid program counter",
    "device-side assert triggered",
    "the launch timed out and was terminated",
    "uncorrectable ecc error encountered",
)


class DeviceLostError(OMLXError):
    """The GPU can no longer be used by this process; it is restarting (503)."""

    status = 503
    error_type = "server_error"

    def __init__(self, reason: str):
        super().__init__(
            f"The GPU failed ({reason}); this server process cannot use it any more and is shutting "
            "down to be restarted. Retry shortly.",
            code="device_lost",
        )


def is_sticky_device_error(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(marker in text for marker in STICKY_CUDA_ERRORS)


class DeviceHealth:
    """Process-wide, like the CUDA context itself: every engine shares one device."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.lost: str | None = None
        self._listeners: list[Callable[[str], None]] = []

    def on_lost(self, listener: Callable[[str], None]) -> None:
        """Call `listener(reason)` (on the failing engine's thread) when the device is lost."""
        with self._lock:
            self._listeners.append(listener)

    def check(self, exc: BaseException) -> bool:
        """Whether `exc` means the device is lost; the first such error marks it so."""
        if self.lost is None and not is_sticky_device_error(exc):
            return False
        with self._lock:
            first = self.lost is None
            if first:
                text = str(exc).strip()
                self.lost = text.splitlines()[0][:300] if text else type(exc).__name__
            listeners = list(self._listeners) if first else []
        if first:
            log.critical("the GPU failed and this process cannot use it any more: %s", self.lost)
        for listener in listeners:
            listener(self.lost)
        return True

    def raise_if_lost(self) -> None:
        if self.lost is not None:
            raise DeviceLostError(self.lost)

    def reset(self) -> None:
        """For tests: a fresh process's state."""
        with self._lock:
            self.lost = None
            self._listeners.clear()


DEVICE = DeviceHealth()
