"""A loaded model's objects are frozen out of the collector's passes, and still freed at unload.

The real pool of a real app (`create_app`) on the tiny model, driven through its HTTP routes.
"""

from __future__ import annotations

import asyncio
import gc
import weakref
from pathlib import Path

import httpx


def test_a_load_freezes_the_heap_and_an_unload_still_frees_the_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    from omlx.server.app import create_app
    from omlx.settings import load_settings

    settings = load_settings({"model_dir": str(tiny_model_dir)}, env={"OMLX_HOME": str(tmp_path / "home")})
    app = create_app(settings)

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://omlx", timeout=120) as client:
            gc.unfreeze()
            assert (await client.post("/v1/models/tiny-llama/load")).status_code == 200
            # everything alive after the load is out of the collector's scans: a full pass
            # looks only at what came since (~120 ms vs 0.1 ms on a 2-core CPU with SmolLM2)
            assert gc.get_freeze_count() > 10_000
            assert len(gc.get_objects()) < gc.get_freeze_count() / 10
            body = {"model": "tiny-llama", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
            held = app.state.pool.entries["tiny-llama"].engine
            held.itself = held  # a cycle, frozen at the load: only the collector can free it
            engine = weakref.ref(held)
            del held
            r = await client.post("/v1/models/tiny-llama/unload")
            assert r.status_code == 200 and r.json()["unloaded"] is True
            for _ in range(50):  # its thread may still be on its way out
                if engine() is None:
                    break
                await asyncio.sleep(0.05)
                gc.collect()
            assert engine() is None  # frozen at its load, collected at its unload all the same
            assert gc.get_freeze_count() > 0  # and the rest frozen again

    try:
        asyncio.run(main())
    finally:
        app.state.pool.shutdown()


def test_a_model_evicted_for_another_is_collected_before_that_one_is_measured(tmp_path: Path) -> None:
    # the evicted model's memory must be gone when the next one's load measures what it took
    # (the LRU accounting uses that figure), and its cycles must not be frozen for good
    from omlx.server.app import create_app
    from omlx.settings import load_settings
    from tests.support.tiny_model import build_tiny_llama

    root = tmp_path / "models"
    for i, name in enumerate(("model-a", "model-b")):
        build_tiny_llama(root / name, seed=i)
    one = sum(f.stat().st_size for f in (root / "model-a").glob("*.safetensors"))
    settings = load_settings(
        {"model_dir": str(root), "max_model_memory": str(int(one * 1.5))}, env={"OMLX_HOME": str(tmp_path / "home")}
    )
    app = create_app(settings)

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://omlx", timeout=120) as client:
            assert (await client.post("/v1/models/model-a/load")).status_code == 200
            held = app.state.pool.entries["model-a"].engine
            held.itself = held  # only the collector can free it
            engine, a_bytes = weakref.ref(held), held.memory_bytes
            del held
            seen: list[bool] = []  # model-a still alive when model-b's engine was made?
            factory = app.state.pool.factories["llm"]

            def watching(*args, **kwargs):
                seen.append(engine() is not None)
                return factory(*args, **kwargs)

            app.state.pool.factories["llm"] = watching
            assert (await client.post("/v1/models/model-b/load")).status_code == 200
            assert list(app.state.pool.entries) == ["model-b"]
            assert seen == [False]
            assert app.state.pool.entries["model-b"].engine.memory_bytes >= 0.9 * a_bytes

    try:
        asyncio.run(main())
    finally:
        app.state.pool.shutdown()
