"""DELETE /api/models/{id}/files removes only the named model's own folder, whatever links or
hub-cache refs the model dir holds (in-process app, fake model folders, nothing loaded)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from tests.admin.conftest import API_KEY, fake_model

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def hub_repo(models: Path, org: str, name: str, ref: str) -> Path:
    """`models--org--name` with `refs/main` holding `ref` and an empty `blobs/`."""
    repo = models / f"models--{org}--{name}"
    (repo / "refs").mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "snapshots").mkdir()
    (repo / "refs" / "main").write_text(ref)
    return repo


def model_ids(client) -> list[str]:
    r = client.post("/api/models/refresh", headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()["models"]


def test_a_ref_escaping_its_repo_cannot_delete_a_sibling(in_process_app, caplog):
    client, models = in_process_app
    victim = fake_model(models / "victim2")
    repo = hub_repo(models, "evil", "sib", "../../victim2")
    fake_model(repo / "snapshots" / "abc")  # a real snapshot too: the bad ref still wins
    with caplog.at_level(logging.WARNING, logger="omlx.models"):
        assert model_ids(client) == ["victim2"]
    assert any("models--evil--sib" in r.getMessage() for r in caplog.records)
    r = client.delete("/api/models/evil/sib/files", headers=AUTH)
    assert 400 <= r.status_code < 500, r.text
    assert (victim / "model.safetensors").exists() and repo.exists()
    assert model_ids(client) == ["victim2"]


def test_a_snapshot_linked_out_of_its_repo_cannot_delete_the_target(in_process_app):
    client, models = in_process_app
    victim = fake_model(models / "victim")
    repo = hub_repo(models, "evil", "link", "abc")
    os.symlink("../../victim", repo / "snapshots" / "abc")
    assert model_ids(client) == ["victim"]
    r = client.delete("/api/models/evil/link/files", headers=AUTH)
    assert 400 <= r.status_code < 500, r.text
    assert (victim / "config.json").exists()


def test_a_hub_cache_model_is_deleted_as_its_whole_repo_folder(in_process_app):
    client, models = in_process_app
    keep = fake_model(models / "keep")
    repo = hub_repo(models, "org", "cached", "abc")
    fake_model(repo / "snapshots" / "abc")
    (repo / "blobs" / "deadbeef").write_bytes(b"x")
    assert model_ids(client) == ["keep", "org/cached"]
    r = client.delete("/api/models/org/cached/files", headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["path"] == str(repo.resolve())
    assert not repo.exists() and keep.exists() and models.exists()


def test_a_model_folder_linked_outside_the_model_dir_is_refused(in_process_app, tmp_path):
    client, models = in_process_app
    outside = fake_model(tmp_path / "elsewhere" / "linked")
    os.symlink(outside, models / "linked")
    os.symlink(tmp_path / "elsewhere", models / "org")  # org/linked through a linked org folder
    assert model_ids(client) == ["linked", "org/linked"]
    for model in ("linked", "org/linked"):
        r = client.delete(f"/api/models/{model}/files", headers=AUTH)
        assert r.status_code == 400, r.text
        assert "outside the model dir" in r.json()["error"]["message"]
    assert (outside / "model.safetensors").exists()
    assert (models / "linked").is_symlink() and (models / "org").is_symlink()


def test_a_link_to_another_model_inside_the_model_dir_is_refused(in_process_app):
    client, models = in_process_app
    victim = fake_model(models / "victim")
    os.symlink("victim", models / "alias")
    (models / "org").mkdir()
    os.symlink("../victim", models / "org" / "alias")
    assert model_ids(client) == ["alias", "org/alias", "victim"]
    for model in ("alias", "org/alias", "victim"):
        r = client.delete(f"/api/models/{model}/files", headers=AUTH)
        assert r.status_code == 400, r.text
        assert "shares its folder" in r.json()["error"]["message"]
    assert (victim / "config.json").exists()
