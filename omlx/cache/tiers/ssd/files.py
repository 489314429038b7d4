"""File-system helpers of the SSD tier: durable renames, temp files of dead writers, and
telling an I/O failure from a bug."""

from __future__ import annotations

import errno
import logging
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from omlx.cache.tiers.ssd.format import SUFFIX, TMP_MARK, CorruptBlockFile, is_key, read_header

log = logging.getLogger("omlx.cache.tiers.ssd.tier")

_HEX = frozenset("0123456789abcdef")


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:  # pragma: no cover
        return False
    return True


def unlink(path: Path | str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:  # pragma: no cover - e.g. read-only file system
        log.debug("could not delete %s: %s", path, exc)


def lower_thread_priority() -> None:
    """Writes are background work: on Linux (per-thread nice) they yield the CPU to decoding,
    which matters on small machines where checksumming and writing compete with the engine."""
    if sys.platform != "linux":
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except OSError:
        pass


def stale_tmp(name: str, own_pid: int) -> bool:
    """A temp file is stale unless a live process other than us may still be writing it."""
    try:
        pid = int(name.rsplit(TMP_MARK, 1)[1].split("-", 1)[0])
    except (IndexError, ValueError):
        return True
    return pid == own_pid or not pid_alive(pid)


def looks_like_io_error(exc: BaseException) -> bool:
    """MLX may wrap an OS write error in a RuntimeError; recognise the usual ones."""
    text = str(exc).lower()
    needles = ("no space", "i/o error", "permission denied", "read-only", "disk quota")
    return any(n in text for n in needles) or getattr(exc, "errno", None) in (
        errno.ENOSPC,
        errno.EIO,
        errno.EACCES,
        errno.EPERM,
        errno.EROFS,
        errno.EDQUOT,
    )


def scan_files(
    folder: Path, on_stale: Callable[[], None], on_bad: Callable[[str, Path, BaseException], None]
) -> list[tuple[int, str, int, str]]:
    """(mtime, key, size, fingerprint) of each whole block file under `folder`, read from
    headers only, oldest first; stale temp files are deleted (`on_stale` after each), bad
    files passed to `on_bad`."""
    found: list[tuple[int, str, int, str]] = []
    own_pid = os.getpid()
    try:
        subdirs = [e for e in os.scandir(folder) if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return found
    for sub in subdirs:
        if len(sub.name) != 2 or not set(sub.name) <= _HEX:
            continue
        try:
            files = list(os.scandir(sub.path))
        except OSError:
            continue
        for ent in files:
            name = ent.name
            if TMP_MARK in name:
                if stale_tmp(name, own_pid):
                    unlink(ent.path)
                    on_stale()
                continue
            key = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else ""
            if not is_key(key) or key[:2] != sub.name:
                continue
            try:
                st = ent.stat()
                meta = read_header(ent.path, st.st_size)
                if meta["key"] != key:
                    raise CorruptBlockFile("file name and metadata key differ")
            except FileNotFoundError:
                continue
            except (CorruptBlockFile, OSError) as exc:
                on_bad(key, Path(ent.path), exc)
                continue
            found.append((st.st_mtime_ns, key, st.st_size, meta["fingerprint"]))
    found.sort()
    return found
