"""Weights kept in the compute dtype: a quantized model dequantized for this device (float32 on
a CPU) is saved once under `$OMLX_HOME/converted/` and later loads read that copy instead of
converting again (docs/design/operations.md, "Warm starts").

A copy is keyed by the source folder's config and weight files (names, sizes, modification
times) and the dtype, so a changed model is converted afresh and its stale copy removed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from omlx.models.discovery import ModelInfo

log = logging.getLogger("omlx.models")

QUANTIZATION_KEYS = ("quantization", "quantization_config")
DONE = "omlx-kept.json"  # written last: a folder without it is an interrupted save
FREE_DISK_FACTOR = 2  # a copy is only kept where twice its size is free


def source_key(info: ModelInfo, dtype: str) -> str:
    """Hash of the model's config and weight files (name, size, mtime) and the dtype."""
    h = hashlib.sha256(dtype.encode())
    h.update((info.path / "config.json").read_bytes())
    for f in sorted(info.path.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()[:16]


def _prefix(info: ModelInfo, dtype: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", info.id) + f"-{dtype}-"


def kept_dir(root: Path, info: ModelInfo, dtype: str) -> Path:
    """Where the `dtype` copy of `info`'s weights lives (whether or not it exists)."""
    return root / (_prefix(info, dtype) + source_key(info, dtype))


def is_kept(path: Path) -> bool:
    return (path / DONE).is_file()


def converts(config: dict[str, Any]) -> bool:
    """Whether loading this model in a float dtype dequantizes it (what is worth keeping)."""
    return any(config.get(key) for key in QUANTIZATION_KEYS)


def keep(model: Any, info: ModelInfo, dtype: str, root: Path) -> Path | None:
    """On the engine's thread (MLX writes the arrays): save `model`'s weights as `info`'s
    `dtype` copy with a config without quantization, replacing older copies of that model;
    None (and a log line) when the disk has too little room or the save fails."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import save_model

    target = kept_dir(root, info, dtype)
    nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    if free < FREE_DISK_FACTOR * nbytes:
        log.info("%s: not keeping its %s weights (%d MB; %d MB free in %s)", info.id, dtype, nbytes >> 20, free >> 20, root)
        return None
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        save_model(tmp, model)
        config = {k: v for k, v in info.config.items() if k not in QUANTIZATION_KEYS}
        config["torch_dtype"] = dtype
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / DONE).write_text(json.dumps({"model": info.id, "source": str(info.path), "dtype": dtype}))
        for old in root.glob(_prefix(info, dtype) + "*"):
            shutil.rmtree(old, ignore_errors=True)
        tmp.rename(target)
    except OSError as exc:
        log.warning("%s: could not keep its %s weights in %s: %s", info.id, dtype, root, exc)
        shutil.rmtree(tmp, ignore_errors=True)
        return None
    log.info("%s: kept its %s weights in %s (%d MB): later loads skip the conversion", info.id, dtype, target, nbytes >> 20)
    return target
