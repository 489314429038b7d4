"""A sticky CUDA error (the GPU context is gone) fails what is in flight, turns new work away
with a 503, makes `/health` say so, and shuts the server down with exit code 75.

A real one cannot be caused on purpose; the H200 produced one in the seventh session (MLX
0.32.4, an attention-graph cache of 8 with CUDA graphs on). Here the model's forward pass
raises the error text CUDA gave there, on the engine thread, where a real fault surfaces.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from omlx.engine.device_fault import (
    DEVICE,
    EXIT_DEVICE_LOST,
    DeviceLostError,
    is_sticky_device_error,
)
from omlx.engine.llm_engine import LLMEngine
from omlx.engine.request import GenerationRequest, SamplingParams
from omlx.server.runner import shut_down_when_device_lost

SEEN_ON_THE_H200 = "cudaGetLastError() failed: an illegal memory access was encountered"


@pytest.fixture(autouse=True)
def fresh_device():
    DEVICE.reset()
    yield
    DEVICE.reset()


@pytest.mark.parametrize(
    "message, sticky",
    [
        (SEEN_ON_THE_H200, True),
        ("[cudaMallocManaged(&data, size)] failed: an illegal memory access was encountered", True),
        ("CUDA error: unspecified launch failure", True),
        ("device-side assert triggered", True),
        ("[metal::malloc] Attempting to allocate 90000000000 bytes which is greater than the maximum", False),
        ("Cache thrashing is happening, please set the environment variable MLX_CUDA_SDPA_CACHE_SIZE", False),
        ("[cudaMalloc] failed: out of memory", False),
    ],
)
def test_only_errors_that_leave_the_context_unusable_count(message: str, sticky: bool) -> None:
    assert is_sticky_device_error(RuntimeError(message)) is sticky


def test_the_first_sticky_error_marks_the_device_lost_once() -> None:
    heard: list[str] = []
    DEVICE.on_lost(heard.append)
    assert DEVICE.check(ValueError("bad shape")) is False and DEVICE.lost is None
    assert DEVICE.check(RuntimeError(SEEN_ON_THE_H200)) is True
    assert DEVICE.check(RuntimeError("[cudaMallocManaged] failed: an illegal memory access was encountered"))
    assert heard == [SEEN_ON_THE_H200] and DEVICE.lost == SEEN_ON_THE_H200
    with pytest.raises(DeviceLostError) as caught:
        DEVICE.raise_if_lost()
    assert caught.value.status == 503 and "illegal memory access" in caught.value.message


class FaultyModel:
    """The real model, whose forward passes raise CUDA's error once `armed`."""

    def __init__(self, model: Any):
        self._model = model
        self.armed = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.armed:
            raise RuntimeError(SEEN_ON_THE_H200)
        return self._model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def faulty_engine(model_path: Path) -> tuple[LLMEngine, FaultyModel]:
    from mlx_lm import load

    model, tokenizer = load(str(model_path))
    faulty = FaultyModel(model)
    loaded = SimpleNamespace(model=faulty, tokenizer=tokenizer, context_length=2048, draft=None)
    return LLMEngine("tiny", lambda: loaded, max_concurrent=1, max_waiting=4), faulty


async def finish_of(engine: LLMEngine, rid: str) -> tuple[str | None, str | None]:
    req = GenerationRequest(rid, [5 + i % 300 for i in range(40)], 8, SamplingParams(temperature=0.0))
    async for ev in engine.generate(req):
        if ev.finish_reason is not None:
            return ev.finish_reason, ev.error
    return None, None


def test_a_lost_gpu_fails_the_requests_in_flight_and_queued_and_refuses_new_ones(tiny_model_dir: Path) -> None:
    engine, faulty = faulty_engine(tiny_model_dir / "tiny-llama")
    heard: list[str] = []
    DEVICE.on_lost(heard.append)

    async def main() -> None:
        await engine.wait_ready()
        assert await finish_of(engine, "before") == ("length", None)
        faulty.armed = True
        gate = threading.Event()  # both requests in the inbox before the engine takes either
        held = asyncio.ensure_future(engine.call(gate.wait))
        await asyncio.sleep(0.05)
        tasks = [asyncio.create_task(finish_of(engine, rid)) for rid in ("running", "queued")]
        await asyncio.sleep(0.05)
        gate.set()
        await held
        (r1, e1), (r2, e2) = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        assert (r1, r2) == ("error", "error")
        assert "illegal memory access" in e1 and "illegal memory access" in e2  # type: ignore[operator]
        with pytest.raises(DeviceLostError):
            await finish_of(engine, "after")
        with pytest.raises(DeviceLostError):
            await engine.call(lambda: None)

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    assert heard == [SEEN_ON_THE_H200]
    assert engine.active_count == 0 and engine.waiting_count == 0


def test_health_and_new_requests_get_503_in_each_dialect_once_the_gpu_is_lost(tiny_model_dir: Path, tmp_path) -> None:
    from omlx.server.app import create_app
    from omlx.settings import load_settings

    settings = load_settings(
        {"model_dir": str(tiny_model_dir), "no_cache": True}, env={"OMLX_HOME": str(tmp_path / "home")}
    )
    app = create_app(settings)

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://omlx") as client:
            assert (await client.get("/health")).json() == {"status": "ok"}
            assert (await client.get("/api/status")).json()["device_lost"] is None
            DEVICE.check(RuntimeError(SEEN_ON_THE_H200))
            assert (await client.get("/api/status")).json()["device_lost"] == SEEN_ON_THE_H200
            r = await client.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "unhealthy"
            assert "illegal memory access" in r.json()["reason"]
            body = {"model": "tiny-llama", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "device_lost"
            r = await client.post("/v1/messages", json=body)
            assert r.status_code == 503 and r.json()["type"] == "error"
            assert "GPU failed" in r.json()["error"]["message"]
            r = await client.post("/v1/models/tiny-llama/load")
            assert r.status_code == 503 and r.json()["error"]["code"] == "device_lost"
            assert app.state.pool.entries == {}  # no model was loaded onto the lost device

    try:
        asyncio.run(main())
    finally:
        app.state.pool.shutdown()


def test_the_server_shuts_down_after_a_grace_and_exits_75_if_the_shutdown_hangs() -> None:
    killed, left = threading.Event(), []
    listener = shut_down_when_device_lost(grace_s=0.05, deadline_s=0.2, kill=killed.set, leave=left.append)
    listener(SEEN_ON_THE_H200)
    assert not killed.is_set()  # the failed requests' answers go out first
    assert killed.wait(5)
    deadline = threading.Event()
    deadline.wait(1.0)
    assert left == [EXIT_DEVICE_LOST] == [75]
