"""Fixtures for the dashboard tests: a loopback Hugging Face hub, writable model dirs, servers."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.admin.fake_hub import FakeHub
from tests.support.server import ServerProcess

CHROMIUM = "/usr/bin/chromium"
SCREENS_COPY = Path("/tmp/omlx-screens")  # every browser test's screenshots, kept after the run
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
needs_chromium = pytest.mark.skipif(
    not os.path.exists(CHROMIUM),
    reason="needs Debian's chromium at /usr/bin/chromium (apt-get install -y chromium; scripts/setup.sh does it as root)",
)

API_KEY = "admin-test-key-123"
HUB_REPO = "test-org/tiny-llama-mlx"
BIG_REPO = "test-org/big-model"


@pytest.fixture(scope="module")
def fake_hub(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A hub serving the tiny model as `test-org/tiny-llama-mlx`, plus a repo oMLX cannot load."""
    hub = FakeHub(chunk_size=256 * 1024).start()
    hub.add_repo(HUB_REPO, tiny_model_dir / "tiny-llama")
    torch_only = tmp_path_factory.mktemp("torch-only")
    (torch_only / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (torch_only / "pytorch_model.bin").write_bytes(b"\0" * 1024)
    hub.add_repo("test-org/torch-only", torch_only, tags=["pytorch"])
    # Big enough to watch: huggingface_hub writes to disk in 10 MB pieces.
    big = tmp_path_factory.mktemp("big") / "big-model"
    shutil.copytree(tiny_model_dir / "tiny-llama", big)
    (big / "padding.dat").write_bytes(b"\0" * (24 << 20))
    hub.add_repo(BIG_REPO, big)
    yield hub
    hub.stop()


def writable_model_dir(tiny_model_dir: Path, root: Path) -> Path:
    """A model dir of our own (tests download into it and delete from it)."""
    models = root / "models"
    shutil.copytree(tiny_model_dir / "tiny-llama", models / "tiny-llama")
    return models


def start_server(home: Path, models: Path, *args: str, env: dict[str, str] | None = None) -> ServerProcess:
    server = ServerProcess(home, ["--model-dir", str(models), *args], env=env)
    server.start()
    return server


def login(base_url: str, key: str = API_KEY) -> httpx.Client:
    """An httpx client holding a dashboard session, sending the dashboard's header."""
    client = httpx.Client(base_url=base_url, headers={"X-OMLX-Admin": "1"}, timeout=60)
    r = client.post("/api/auth/login", json={"api_key": key})
    assert r.status_code == 200, r.text
    return client


def fake_model(path: Path) -> Path:
    """A folder discovery takes for a chat model (never loaded: the weights are 16 zero bytes)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 4096}))
    (path / "tokenizer.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"\0" * 16)
    return path


@pytest.fixture()
def in_process_app(omlx_home: Path, tmp_path: Path):
    """`create_app` with the API key set, on an empty model dir of its own; no model is loaded
    and the lifespan does not run. Yields (TestClient, model dir); `.app` is the FastAPI app."""
    from omlx.server.app import create_app
    from omlx.settings import load_settings

    models = tmp_path / "models"
    models.mkdir()
    unreachable_hub = "http://127.0.0.1:9"  # no test here may reach a real hub
    settings = load_settings(
        {"model_dir": str(models), "api_key": API_KEY, "no_cache": True, "hf_endpoint": unreachable_hub}
    )
    app = create_app(settings)
    client = TestClient(app, base_url="http://localhost", raise_server_exceptions=False)
    yield client, models
    client.close()
    app.state.pool.shutdown()


@pytest.fixture(scope="module")
def browser():
    """A headless Chromium (Debian's, driven by Playwright) for a browser test module."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the test extra)")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def screens(tmp_path_factory: pytest.TempPathFactory):
    """A module's screenshot folder, copied to `SCREENS_COPY` at its end."""
    folder = tmp_path_factory.mktemp("screens")
    yield folder
    SCREENS_COPY.mkdir(parents=True, exist_ok=True)
    for png in folder.glob("*.png"):
        shutil.copy(png, SCREENS_COPY / png.name)
