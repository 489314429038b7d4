"""DeepSeek-OCR through a real `omlx serve`: a tiny random-weight `deepseekocr` built with
mlx-vlm's own classes (its SAM encoder at full size: every image is a 1024-pixel SAM pass, ~30 s on
a 2-core CPU with OpenBLAS, so this file encodes three images in the server and one in the
reference run), images drawn with Pillow, the prompt in the model's own format."""

from __future__ import annotations

import base64
import shutil
from pathlib import Path

import httpx
import pytest

from tests.support.server import ServerProcess
from tests.support.tiny_deepseek_ocr import build_tiny_deepseek_ocr, mlx_vlm_reference
from tests.support.tiny_vlm import draw_png

pytest.importorskip("mlx_vlm", reason="the vision tests need omlx[vision] (scripts/setup.sh test installs it)")

OCR = "tiny-deepseek-ocr"
PROMPT = "Free OCR."


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ocr-models")
    build_tiny_deepseek_ocr(root / OCR)
    return root


@pytest.fixture(scope="module")
def server(models: Path, tmp_path_factory: pytest.TempPathFactory):
    home = tmp_path_factory.mktemp("ocr-home")
    srv = ServerProcess(home, ["--model-dir", str(models), "--model", OCR, "--cache-block-size", "16"])
    srv.start()
    yield srv
    srv.stop()
    shutil.rmtree(home, ignore_errors=True)


def _mlx_vlm(path: Path, png: bytes, n: int) -> tuple[str, int]:
    """mlx-vlm's own greedy generate (`mlx_vlm_reference`): its first `n` tokens as the server's
    streaming detokenizer reads them, and the prompt's length."""
    from mlx_lm.utils import load_tokenizer

    tokens, prompt_tokens = mlx_vlm_reference(path, png, PROMPT, n)
    detok = load_tokenizer(path).detokenizer
    detok.reset()
    for t in tokens:
        detok.add_token(t)
    detok.finalize()
    return detok.text, prompt_tokens


def test_deepseek_ocr_answers_as_mlx_vlm_and_a_repeat_is_a_cache_hit(server, models):
    """Greedy output equals mlx-vlm's generate on the same model and image (the prompt's 273 image
    slots included); the same request again restores the whole prompt, image included, from the
    prefix cache and answers the same."""
    png = draw_png("circle", (96, 64))
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    body = {"model": OCR, "temperature": 0, "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": PROMPT}]}]}  # fmt: skip
    replies = []
    for _ in range(2):
        r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=900)
        assert r.status_code == 200, r.text
        replies.append(r.json())
    first, again = replies
    text = first["choices"][0]["message"]["content"]
    want, prompt_tokens = _mlx_vlm(models / OCR, png, first["usage"]["completion_tokens"])
    assert first["usage"]["prompt_tokens"] == prompt_tokens > 273
    assert text == want and first["usage"]["completion_tokens"] >= 4
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt_tokens - 1  # all but the token fed to decode
    assert again["choices"][0]["message"]["content"] == text


def test_an_image_request_and_a_text_request_share_decode_steps(server):
    """The image request and a text request at once decode in shared steps and answer as each did
    alone (after the test above the image's prompt is cached, so no tower runs here)."""
    import concurrent.futures as cf

    png = draw_png("circle", (96, 64))
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": PROMPT}]}]
    text = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]

    def ask(messages: list[dict]) -> tuple[str, int]:
        body = {"model": OCR, "temperature": 0, "max_tokens": 40, "logit_bias": {"1": -100}, "messages": messages}
        r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=900)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    def steps() -> dict:
        data = httpx.get(server.base_url + "/v1/models/status").json()["data"]
        return next(m for m in data if m["id"] == OCR)["step_times"]

    alone = [ask(m) for m in (image, text)]
    before = steps()
    with cf.ThreadPoolExecutor(2) as pool:
        together = list(pool.map(ask, (image, text)))
    after = steps()
    assert [t for t, _ in together] == [t for t, _ in alone]
    tokens, loops = after["tokens"] - before["tokens"], after["loops"] - before["loops"]
    assert tokens >= 2 * 36 and loops < tokens * 0.75, (tokens, loops)  # the rows shared decode steps


def test_a_different_image_misses_from_its_block_and_the_text_before_it_is_shared(server, models):
    """A system prompt before the image fills whole blocks of 16: a second image after the same system
    prompt restores those blocks and computes the rest (its own image encoded: two tower passes)."""
    system = {"role": "system", "content": "You read scanned documents and write out their text. " * 4}

    def ask(png: bytes) -> dict:
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        body = {"model": OCR, "temperature": 0, "max_tokens": 4, "messages": [system, {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": PROMPT}]}]}  # fmt: skip
        r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=900)
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(models / OCR)
    start = 1 + len(tok.encode(system["content"] + " ", add_special_tokens=False))  # BOS, then the system text
    assert start > 32
    assert ask(draw_png("stripes", (96, 64)))["prompt_tokens_details"]["cached_tokens"] == 0
    other = ask(draw_png("square", (96, 64)))
    assert start - 16 < other["prompt_tokens_details"]["cached_tokens"] <= start  # shared up to the image's block


def test_anthropic_count_tokens_counts_the_processors_layout(server):
    """`/v1/messages/count_tokens` counts an image as the processor lays it out (BOS, 273 slots, the
    text), and a tool offered to this model is refused (its format has none); no tower runs."""
    png = base64.b64encode(draw_png("circle", (96, 64))).decode()
    content = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}},
               {"type": "text", "text": PROMPT}]  # fmt: skip
    body = {"model": OCR, "messages": [{"role": "user", "content": content}]}
    r = httpx.post(server.base_url + "/v1/messages/count_tokens", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["input_tokens"] == 283  # as the chat request of the first test
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=120, json={
        "model": OCR, "max_tokens": 2, "tools": [tool], "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert r.status_code == 400 and "no tools" in r.text


class _Engine:
    """What `ocr_prompt` needs of an engine: `call` runs on the caller's thread here."""

    async def call(self, fn):
        return fn()


def test_the_prompt_is_the_processors_layout_keyed_by_image(tmp_path: Path):
    """mlx-vlm's processor lays out the prompt (a small image: the global view's 16 rows of 16 slots
    and a newline slot, then the view separator; a large one adds its tiles' rows) and each image's
    slots carry its digest: the same image gives the same tokens, another differs from its first
    slot on, the text before it stays the same (no tower runs here: the processor only)."""
    import asyncio
    from dataclasses import dataclass

    import mlx_vlm.models.deepseekocr  # noqa: F401  (installs mlx-vlm's AutoProcessor hook, as loading the model does)
    from mlx_vlm.utils import load_processor

    from omlx.api.images import IMAGE_MARK, ImageLimits, ImageRef
    from omlx.server.ocr_prompt import ocr_prompt
    from omlx.server.vision_prompt import KEY_BASE

    @dataclass
    class Parts:
        ocr: object

    path = build_tiny_deepseek_ocr(tmp_path / OCR, weights=False)
    parts = Parts(load_processor(path, add_detokenizer=False))

    def prompt(*pngs: bytes) -> tuple[list[int], object]:
        marks = "".join(IMAGE_MARK + f"Page {i}." for i in range(len(pngs)))
        refs = [ImageRef(f"messages.0.content.{i}", data=p) for i, p in enumerate(pngs)]
        messages = [{"role": "user", "content": marks + " " + PROMPT}]
        return asyncio.run(ocr_prompt(_Engine(), parts, messages, refs, ImageLimits()))

    circle, square, wide = draw_png("circle", (96, 64)), draw_png("square", (96, 64)), draw_png("stripes", (900, 500))
    a, ocr = prompt(circle)
    assert a[0] == 0 and ocr.spans == [(1, 273)] and ocr.views[0][2] == (1, 1)
    assert all(t >= KEY_BASE for t in a[1:274]) and all(t < KEY_BASE for t in a[274:])
    assert prompt(circle)[0] == a
    b, _ = prompt(square)
    assert b[:1] == a[:1] and b[1] != a[1] and b[274:] == a[274:]
    both, ocr = prompt(wide, circle)  # 900x500: 2x1 tiles of 640, each 10 rows of 10 slots + newline
    assert ocr.views[0][2] == (2, 1) and ocr.views[0][0].shape == (2, 3, 640, 640)
    assert [n for _, n in ocr.spans] == [273 + 10 * 21, 273]
