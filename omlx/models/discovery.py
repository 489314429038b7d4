"""Find models on disk: flat, org/name, and Hugging Face hub-cache layouts.

A folder is a model when it has `config.json`, a tokenizer and `*.safetensors`
weights. Folders that look like models but are incomplete are reported with the
reason instead of failing discovery. A hub-cache repo's `refs/main` must name a
revision whose snapshot lies inside that repo's own `snapshots/`; a repo whose ref
escapes it is skipped with a warning.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("omlx.models")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass
class ModelInfo:
    id: str
    path: Path
    type: str  # "llm" | "embedding" | "reranker"
    config: dict[str, Any] = field(repr=False)
    weight_bytes: int = 0
    # The folder that is this model's own: `path`, or its hub-cache `models--org--name` folder.
    root: Path | None = None
    vision: bool = False  # a vision-language model: it accepts images (models/vision.py)

    def __post_init__(self) -> None:
        if self.root is None:
            self.root = self.path

    @property
    def context_length(self) -> int | None:
        cfg = self.config
        for key in ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length"):
            value = cfg.get(key) or cfg.get("text_config", {}).get(key)
            if isinstance(value, int) and value > 0:
                return value
        return None


@dataclass
class Problem:
    path: Path
    reason: str


@dataclass
class Discovery:
    models: dict[str, ModelInfo]
    problems: list[Problem]


def model_type_from_config(path: Path, config: dict[str, Any]) -> str:
    """Route by the model's own config: encoders embed, classifiers rerank, the rest chat."""
    archs = " ".join(config.get("architectures") or [])
    if "ForSequenceClassification" in archs:
        return "reranker"
    if (path / "modules.json").exists() or config.get("model_type") in (
        "bert",
        "roberta",
        "xlm-roberta",
        "modernbert",
        "nomic_bert",
    ):
        return "embedding"
    return "llm"


def is_vision_config(config: dict[str, Any]) -> bool:
    """A vision-language (or OCR) model: its config has a `vision_config` (every mlx-vlm VLM's does);
    needs nothing installed, so a VLM is never mistaken for a text model (models/vision.py)."""
    return isinstance(config.get("vision_config"), dict)


def inspect_folder(path: Path) -> ModelInfo | Problem | None:
    """A ModelInfo, a Problem for a folder that looks like a broken model, or None."""
    config_path = path / "config.json"
    weights = sorted(path.glob("*.safetensors"))
    has_tokenizer = any((path / name).exists() for name in TOKENIZER_FILES)
    if not config_path.exists():
        return Problem(path, "no config.json") if weights else None
    missing = []
    if not weights:
        missing.append("*.safetensors weights")
    if not has_tokenizer:
        missing.append("a tokenizer (tokenizer.json or tokenizer_config.json)")
    if missing:
        return Problem(path, "missing " + " and ".join(missing))
    try:
        config = json.loads(config_path.read_text())
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        return Problem(path, f"unreadable config.json: {exc}")
    size = sum(w.stat().st_size for w in weights)
    kind = model_type_from_config(path, config)
    vision = kind == "llm" and is_vision_config(config)
    return ModelInfo(id="", path=path, type=kind, config=config, weight_bytes=size, vision=vision)


def is_revision(ref: str) -> bool:
    """A ref names a revision: one path segment, no separators, not `.` or `..`."""
    return bool(ref) and ref not in (".", "..") and "/" not in ref and "\\" not in ref and "\0" not in ref


def lies_below(path: Path, folder: Path) -> bool:
    """`path` resolves to something strictly below `folder` (links followed on both)."""
    return folder.resolve() in path.resolve().parents


def _snapshots(snapshots_dir: Path) -> list[Path]:
    """The snapshot folders that lie inside `snapshots_dir` once links are followed."""
    inside = []
    for p in snapshots_dir.glob("*"):
        if not p.is_dir():
            continue
        if lies_below(p, snapshots_dir):
            inside.append(p)
        else:
            log.warning("ignoring snapshot %s: it lies outside its snapshots/ folder", p)
    return inside


def _read_ref(ref_file: Path) -> str | None:
    """The revision `refs/main` names ("" when there is no ref); None when it is not a revision."""
    if not ref_file.exists():
        return ""
    try:
        ref = ref_file.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        log.warning("skipping %s: refs/main is unreadable (%s)", ref_file.parent.parent, exc)
        return None
    if not is_revision(ref):
        log.warning("skipping %s: refs/main (%r) does not name a revision", ref_file.parent.parent, ref[:80])
        return None
    return ref


def _snapshot_of(repo: Path) -> Path | None:
    """The snapshot `refs/main` names, else the newest one; None when the ref escapes or none exists."""
    snapshots_dir = repo / "snapshots"
    ref = _read_ref(repo / "refs" / "main")
    if ref is None:
        return None
    candidate = snapshots_dir / ref if ref else None
    if candidate is not None and candidate.is_dir():
        if not lies_below(candidate, snapshots_dir):
            log.warning("skipping %s: snapshot %s lies outside its snapshots/ folder", repo, ref)
            return None
        return candidate
    snapshots = _snapshots(snapshots_dir)
    return max(snapshots, key=lambda p: p.stat().st_mtime) if snapshots else None


def _hub_cache_models(root: Path) -> list[tuple[str, Path, Path]]:
    """(id, snapshot, repo folder) of each `models--org--name` repo, its ref's snapshot or the newest."""
    found = []
    for repo in sorted(p for p in root.glob("models--*") if p.is_dir()):
        chosen = _snapshot_of(repo)
        if chosen is None:
            continue
        model_id = "/".join(repo.name.split("--")[1:])
        found.append((model_id, chosen, repo))
    return found


def discover_models(model_dir: Path) -> Discovery:
    """Scan `model_dir` (and a `hub/` cache inside it) for models."""
    models: dict[str, ModelInfo] = {}
    problems: list[Problem] = []

    def add(model_id: str, path: Path, root: Path | None = None) -> bool:
        result = inspect_folder(path)
        if isinstance(result, ModelInfo):
            result.id = model_id
            result.root = root or path
            models.setdefault(model_id, result)
            return True
        if isinstance(result, Problem):
            problems.append(result)
            return True
        return False

    if not model_dir.is_dir():
        return Discovery(models, problems)
    for hub_root in (model_dir, model_dir / "hub"):
        if hub_root.is_dir():
            for model_id, path, repo in _hub_cache_models(hub_root):
                add(model_id, path, repo)
    for child in sorted(p for p in model_dir.iterdir() if p.is_dir()):
        if child.name.startswith((".", "models--")) or child.name == "hub":
            continue
        if add(child.name, child):
            continue
        for grandchild in sorted(p for p in child.iterdir() if p.is_dir()):
            if not grandchild.name.startswith("."):
                add(f"{child.name}/{grandchild.name}", grandchild)
    return Discovery(models, problems)
