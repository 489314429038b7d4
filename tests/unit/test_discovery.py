"""Model discovery over flat, org/name and Hugging Face hub-cache layouts."""

from __future__ import annotations

import json
from pathlib import Path

from omlx.models.discovery import discover_models


def make_model(path: Path, config: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or {"model_type": "llama", "max_position_embeddings": 4096}))
    (path / "tokenizer.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"\0" * 16)
    return path


def test_flat_org_and_hub_layouts(tmp_path: Path):
    make_model(tmp_path / "flat-model")
    make_model(tmp_path / "some-org" / "nested-model")
    snap = tmp_path / "models--hf-org--hub-model" / "snapshots" / "abc123"
    make_model(snap)
    (tmp_path / "models--hf-org--hub-model" / "refs").mkdir()
    (tmp_path / "models--hf-org--hub-model" / "refs" / "main").write_text("abc123")
    make_model(tmp_path / "hub" / "models--x--in-hub-dir" / "snapshots" / "r1")
    found = discover_models(tmp_path)
    assert set(found.models) == {"flat-model", "some-org/nested-model", "hf-org/hub-model", "x/in-hub-dir"}
    assert found.models["flat-model"].context_length == 4096
    assert found.models["hf-org/hub-model"].path == snap
    assert found.problems == []


def test_malformed_folders_are_reported_not_fatal(tmp_path: Path):
    make_model(tmp_path / "good")
    bad = tmp_path / "no-weights"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    (bad / "tokenizer.json").write_text("{}")
    broken = make_model(tmp_path / "broken-config")
    (broken / "config.json").write_text("{oops")
    no_tok = tmp_path / "no-tokenizer"
    make_model(no_tok)
    (no_tok / "tokenizer.json").unlink()
    found = discover_models(tmp_path)
    assert set(found.models) == {"good"}
    reasons = {p.path.name: p.reason for p in found.problems}
    assert "weights" in reasons["no-weights"]
    assert "config.json" in reasons["broken-config"]
    assert "tokenizer" in reasons["no-tokenizer"]


def test_model_types_from_config(tmp_path: Path):
    make_model(tmp_path / "emb", {"model_type": "bert", "architectures": ["BertModel"]})
    make_model(tmp_path / "rr", {"model_type": "bert", "architectures": ["BertForSequenceClassification"]})
    make_model(tmp_path / "chat", {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]})
    found = discover_models(tmp_path)
    assert {k: v.type for k, v in found.models.items()} == {"emb": "embedding", "rr": "reranker", "chat": "llm"}


def test_missing_model_dir_is_empty(tmp_path: Path):
    assert discover_models(tmp_path / "absent").models == {}


def test_a_hub_ref_must_name_a_revision_inside_its_own_snapshots(tmp_path: Path, caplog):
    make_model(tmp_path / "victim")
    for name, ref in (("up", "../../victim"), ("sep", "abc/../../../victim"), ("dot", ".."), ("abs", str(tmp_path))):
        repo = tmp_path / f"models--evil--{name}"
        make_model(repo / "snapshots" / "abc")
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(ref)
    linked = tmp_path / "models--evil--linked"
    (linked / "snapshots").mkdir(parents=True)
    (linked / "snapshots" / "abc").symlink_to(tmp_path / "victim")
    with caplog.at_level("WARNING", logger="omlx.models"):
        found = discover_models(tmp_path)
    assert set(found.models) == {"victim"}
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert all(f"models--evil--{n}" in warned for n in ("up", "sep", "dot", "abs", "linked"))


def test_a_hub_model_s_root_is_its_repo_folder(tmp_path: Path):
    repo = tmp_path / "hub" / "models--o--m"
    make_model(repo / "snapshots" / "r1")
    make_model(tmp_path / "flat")
    found = discover_models(tmp_path)
    assert found.models["o/m"].root == repo and found.models["o/m"].path == repo / "snapshots" / "r1"
    assert found.models["flat"].root == tmp_path / "flat"
