"""What the dashboard's chat needs from the admin API, in-process (no model loaded):
prompt presets as profiles with a system prompt, renamed in place."""

from __future__ import annotations

import json

from tests.admin.conftest import API_KEY, fake_model

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_a_preset_is_a_profile_with_a_system_prompt_and_renames_in_place(in_process_app, omlx_home):
    client, models = in_process_app
    fake_model(models / "m")
    base = "/api/models/m/profiles"
    assert client.post(f"{base}/terse", json={"system_prompt": "Be terse.", "temperature": 0.2}, headers=AUTH).status_code == 200
    assert client.post(f"{base}/later", json={"system_prompt": "Later."}, headers=AUTH).status_code == 200
    r = client.post(f"{base}/terse/rename", json={"to": "short"}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["settings"]["system_prompt"] == "Be terse." and r.json()["profile"] == "short"
    profiles = client.get("/api/models/m/settings", headers=AUTH).json()["settings"]["profiles"]
    assert list(profiles) == ["short", "later"]  # its place kept
    assert profiles["short"]["temperature"] == 0.2
    on_disk = json.loads((omlx_home / "model_settings.json").read_text())
    assert on_disk["m"]["profiles"]["short"] == {"temperature": 0.2, "system_prompt": "Be terse."}
    for body, status, param in [({"to": "later"}, 400, "to"), ({"to": "a:b"}, 400, "to"), ({}, 400, "to")]:
        r = client.post(f"{base}/short/rename", json=body, headers=AUTH)
        assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    assert client.post(f"{base}/gone/rename", json={"to": "x"}, headers=AUTH).status_code == 404
    r = client.put(f"{base}/short", json={"system_prompt": 5}, headers=AUTH)
    assert r.status_code == 400 and "system_prompt" in r.json()["error"]["message"]
    # the model's own system prompt: its "System default"
    assert client.put("/api/models/m/settings", json={"system_prompt": "Default."}, headers=AUTH).status_code == 200
