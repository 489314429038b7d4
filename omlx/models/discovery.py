"""Find models on disk: flat, org/name, and Hugging Face hub-cache layouts.

A folder is a model when it has `config.json`, a tokenizer and `*.safetensors`
weights. Folders that look like models but are incomplete are reported with the
reason instead of failing discovery.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass
class ModelInfo:
    id: str
    path: Path
    type: str  # "llm" | "embedding" | "reranker"
    config: dict[str, Any] = field(repr=False)
    weight_bytes: int = 0

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
    return ModelInfo(id="", path=path, type=model_type_from_config(path, config), config=config, weight_bytes=size)


def _hub_cache_models(root: Path) -> list[tuple[str, Path]]:
    """`models--org--name/snapshots/<rev>/` folders, newest snapshot per repo."""
    found = []
    for repo in sorted(root.glob("models--*")):
        snapshots = [p for p in (repo / "snapshots").glob("*") if p.is_dir()]
        if not snapshots:
            continue
        ref = repo / "refs" / "main"
        chosen = None
        if ref.exists():
            candidate = repo / "snapshots" / ref.read_text().strip()
            chosen = candidate if candidate.is_dir() else None
        chosen = chosen or max(snapshots, key=lambda p: p.stat().st_mtime)
        model_id = "/".join(repo.name.split("--")[1:])
        found.append((model_id, chosen))
    return found


def discover_models(model_dir: Path) -> Discovery:
    """Scan `model_dir` (and a `hub/` cache inside it) for models."""
    models: dict[str, ModelInfo] = {}
    problems: list[Problem] = []

    def add(model_id: str, path: Path) -> bool:
        result = inspect_folder(path)
        if isinstance(result, ModelInfo):
            result.id = model_id
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
            for model_id, path in _hub_cache_models(hub_root):
                add(model_id, path)
    for child in sorted(p for p in model_dir.iterdir() if p.is_dir()):
        if child.name.startswith((".", "models--")) or child.name == "hub":
            continue
        if add(child.name, child):
            continue
        for grandchild in sorted(p for p in child.iterdir() if p.is_dir()):
            if not grandchild.name.startswith("."):
                add(f"{child.name}/{grandchild.name}", grandchild)
    return Discovery(models, problems)
