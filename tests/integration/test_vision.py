"""Vision-language models through a real `omlx serve`: a tiny random-weight Qwen2-VL built with
mlx-vlm's own classes, images drawn with Pillow, talked to over all three APIs."""

from __future__ import annotations

import base64
import concurrent.futures as cf
import shutil
import struct
import zlib
from pathlib import Path

import httpx
import pytest

from tests.support.cache_costs import make_recompute_look_slow
from tests.support.server import ServerProcess
from tests.support.tiny_model import build_tiny_llama
from tests.support.tiny_ocr import build_tiny_glm_ocr
from tests.support.tiny_vlm import build_tiny_qwen2_vl, draw_png

pytest.importorskip("mlx_vlm", reason="the vision tests need omlx[vision] (scripts/setup.sh test installs it)")

VLM = "tiny-qwen2-vl"
VLM25 = "tiny-qwen2.5-vl"
OCR = "tiny-glm-ocr"
MAX_IMAGE_BYTES = 200_000


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vision-models")
    build_tiny_qwen2_vl(root / VLM)
    build_tiny_qwen2_vl(root / VLM25, model_type="qwen2_5_vl", seed=1)
    build_tiny_glm_ocr(root / OCR)
    build_tiny_llama(root / "tiny-llama")
    return root


@pytest.fixture(scope="module")
def server(models: Path, tmp_path_factory: pytest.TempPathFactory):
    home = tmp_path_factory.mktemp("vision-home")
    args = ["--model-dir", str(models), "--model", VLM, "--cache-block-size", "16",
            "--max-image-bytes", str(MAX_IMAGE_BYTES)]  # fmt: skip
    srv = ServerProcess(home, args)
    srv.start()
    yield srv
    srv.stop()
    shutil.rmtree(home, ignore_errors=True)


def data_url(png: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(png).decode()


def image_message(png: bytes, text: str = "What is in this picture?") -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png)}}, {"type": "text", "text": text}]}


def chat(server: ServerProcess, messages: list[dict], **extra) -> dict:
    body = {"model": VLM, "messages": messages, "temperature": 0, "max_tokens": 12, **extra}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def answer(reply: dict) -> tuple[str, int]:
    return reply["choices"][0]["message"]["content"], reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_models_say_which_accept_images(server):
    cards = {m["id"]: m for m in httpx.get(server.base_url + "/v1/models").json()["data"]}
    assert cards[VLM]["vision"] is True and cards[VLM]["input_modalities"] == ["text", "image"]
    assert cards[OCR]["vision"] is True
    assert cards["tiny-llama"]["vision"] is False and cards["tiny-llama"]["input_modalities"] == ["text"]


def _mlx_vlm_text(path: Path, png: bytes, text: str, n: int) -> tuple[str, int]:
    """mlx-vlm's own greedy `stream_generate` on the same model, prompt and image: its first `n` tokens
    as the tokenizer's streaming detokenizer reads them (as the server makes its text), and its prompt length."""
    import io

    from mlx_lm.utils import load_tokenizer
    from mlx_vlm import load, stream_generate
    from PIL import Image

    model, processor = load(str(path))
    prompt = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
        tokenize=False, add_generation_prompt=True,
    )  # fmt: skip
    image = Image.open(io.BytesIO(png)).convert("RGB")
    steps = list(stream_generate(model, processor, prompt, image=[image], max_tokens=n, temperature=0.0))
    detok = load_tokenizer(path).detokenizer
    detok.reset()
    for step in steps[:n]:
        detok.add_token(step.token)
    detok.finalize()
    return detok.text, steps[-1].prompt_tokens


@pytest.mark.parametrize("model", [VLM, VLM25, OCR])
def test_greedy_output_equals_mlx_vlm_generate(server, models, model):
    """Qwen2-VL, Qwen2.5-VL (a windowed vision tower), and GLM-OCR with its own prompt ("Text
    Recognition:"), through the server: the same text as mlx-vlm's own generate on the same
    model and image."""
    png = draw_png("circle")
    text = "Text Recognition:" if model == OCR else "What is in this picture?"
    reply = chat(server, [image_message(png, text)], model=model, max_tokens=12)
    want, prompt_tokens = _mlx_vlm_text(models / model, png, text, reply["usage"]["completion_tokens"])
    assert reply["usage"]["prompt_tokens"] == prompt_tokens  # the image's 4 tokens included
    assert answer(reply)[0] == want and reply["usage"]["completion_tokens"] >= 4


def _image_start(models: Path, messages: list[dict]) -> int:
    """Prompt tokens before the first image of `messages` (as the server renders them)."""
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(models / VLM)
    shown = [{**m, "content": [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]]}
             if isinstance(m["content"], list) else m for m in messages]  # fmt: skip
    text = tok.apply_chat_template(shown, tokenize=False, add_generation_prompt=True)
    return len(tok.encode(text[: text.index("<|image_pad|>")], add_special_tokens=False))


def test_cache_hit_equals_miss_and_a_different_image_misses_from_its_block(server, models):
    system = {"role": "system", "content": "You describe pictures. " * 6}  # blocks of 16 before the image
    circle, square = draw_png("circle"), draw_png("square")
    first = chat(server, [system, image_message(circle)])
    again = chat(server, [system, image_message(circle)])
    assert answer(again)[0] == answer(first)[0]
    prompt = first["usage"]["prompt_tokens"]
    assert answer(first)[1] == 0 and answer(again)[1] == prompt - 1  # all but the token fed to decode
    other = chat(server, [system, image_message(square)])
    start = _image_start(models, [system, image_message(square)])
    assert start - 16 < answer(other)[1] <= start  # the blocks before the image are shared, the image's are not
    assert answer(other)[0] != answer(first)[0]
    # a turn after the image: text and image restored, the new text computed; hit == miss
    follow = [system, image_message(circle), {"role": "assistant", "content": answer(first)[0]},
              {"role": "user", "content": "And its colour?"}]  # fmt: skip
    hit = chat(server, follow)
    assert answer(hit)[1] >= prompt - 1
    assert httpx.post(server.base_url + "/api/cache/clear", timeout=30).status_code == 200
    miss = chat(server, follow)
    assert answer(miss)[1] == 0 and answer(miss)[0] == answer(hit)[0]


def test_a_later_turn_with_a_new_image_restores_the_first_and_answers_as_a_miss(server):
    """Turn 2 adds a second image: the first turn (its image included) is restored, only the new
    turn is computed (its image encoded, positions continuing after the first image's), and the
    answer equals the one computed from nothing."""
    first = [{"role": "system", "content": "You compare pictures."}, image_message(draw_png("circle"), "First.")]
    one = chat(server, first)
    second = [*first, {"role": "assistant", "content": answer(one)[0]}, image_message(draw_png("square"), "And this?")]
    hit = chat(server, second)
    assert answer(hit)[1] >= one["usage"]["prompt_tokens"] - 1
    assert httpx.post(server.base_url + "/api/cache/clear", timeout=30).status_code == 200
    miss = chat(server, second)
    assert answer(miss)[1] == 0 and answer(miss)[0] == answer(hit)[0]


def test_a_mixed_batch_of_text_and_vision_requests_equals_each_alone(server):
    """Two image prompts and two text prompts at once decode in shared steps (the step clock
    counts fewer loops than tokens) and answer exactly as each did alone."""
    eos = {"2": -100}  # <|im_end|> never ends them early, so they overlap
    jobs = [
        [image_message(draw_png("circle"), "Describe it.")],
        [image_message(draw_png("stripes"), "What colour?")],
        [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}],
        [{"role": "user", "content": "What is the capital of France?"}],
    ]
    httpx.post(server.base_url + "/api/cache/clear", timeout=30)
    alone = [answer(chat(server, m, max_tokens=48, logit_bias=eos))[0] for m in jobs]
    httpx.post(server.base_url + "/api/cache/clear", timeout=30)

    def steps() -> dict:
        data = httpx.get(server.base_url + "/v1/models/status").json()["data"]
        return next(m for m in data if m["id"] == VLM)["step_times"]

    before = steps()
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda m: answer(chat(server, m, max_tokens=48, logit_bias=eos))[0], jobs))
    after = steps()
    assert together == alone
    tokens, loops = after["tokens"] - before["tokens"], after["loops"] - before["loops"]
    assert tokens >= 4 * 40 and loops < tokens * 0.75, (tokens, loops)  # rows shared decode steps


def _rendered_tokens(models: Path, messages: list[dict]) -> int:
    """Prompt tokens of `messages` rendered by the tiny model's template, each image as its 4 tokens."""
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(models / VLM)

    def part(p: dict) -> dict:
        return {"type": "image"} if p["type"] == "image_url" else p

    shown = [{**m, "content": [part(p) for p in m["content"]]} if isinstance(m.get("content"), list) else m
             for m in messages]  # fmt: skip
    text = tok.apply_chat_template(shown, tokenize=False, add_generation_prompt=True)
    return len(tok.encode(text, add_special_tokens=False)) + 3 * text.count("<|image_pad|>")


def test_several_images_and_an_image_in_a_tool_result(server, models):
    def two(first: str, second: str) -> dict:
        return {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(draw_png(first))}},
            {"type": "text", "text": "and"},
            {"type": "image_url", "image_url": {"url": data_url(draw_png(second))}},
        ]}  # fmt: skip

    one = chat(server, [two("circle", "square")])
    swapped = chat(server, [two("square", "circle")])
    assert one["usage"]["prompt_tokens"] == _rendered_tokens(models, [two("circle", "square")])
    assert answer(one)[0] != answer(swapped)[0]  # both images reach the model, in order
    call = {"id": "call_1", "type": "function", "function": {"name": "screenshot", "arguments": "{}"}}
    tool_turn = [
        {"role": "user", "content": "Take a screenshot."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "image_url", "image_url": {"url": data_url(draw_png("stripes"))}}]},
    ]  # fmt: skip
    reply = chat(server, tool_turn)
    assert "media_omitted" not in str(reply)  # the model saw it: no placeholder, no warning
    assert reply["usage"]["prompt_tokens"] == _rendered_tokens(models, tool_turn)


def test_anthropic_and_responses_images_answer_as_chat_does(server):
    png = draw_png("circle")
    ref, _ = answer(chat(server, [image_message(png, "Describe it.")]))
    msg = httpx.post(server.base_url + "/v1/messages", json={
        "model": VLM, "max_tokens": 12, "temperature": 0,
        "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png).decode()}},
            {"type": "text", "text": "Describe it."}]}],
    }, timeout=120)  # fmt: skip
    assert msg.status_code == 200, msg.text
    assert "".join(b.get("text", "") for b in msg.json()["content"]) == ref
    counted = httpx.post(server.base_url + "/v1/messages/count_tokens", json={
        "model": VLM, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png).decode()}},
            {"type": "text", "text": "Describe it."}]}],
    }, timeout=60)  # fmt: skip
    usage = msg.json()["usage"]  # Anthropic's input_tokens leave out what the cache read
    assert counted.status_code == 200
    assert counted.json()["input_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"]
    resp = httpx.post(server.base_url + "/v1/responses", json={
        "model": VLM, "max_output_tokens": 12, "temperature": 0,
        "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": data_url(png)}, {"type": "input_text", "text": "Describe it."}]}],
    }, timeout=120)  # fmt: skip
    assert resp.status_code == 200, resp.text
    assert resp.json()["output"][-1]["content"][0]["text"] == ref
    tool_result = httpx.post(server.base_url + "/v1/messages", json={
        "model": VLM, "max_tokens": 8, "temperature": 0, "messages": [
            {"role": "user", "content": "Take a screenshot."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "screenshot", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png).decode()}}]}]}],
    }, timeout=120)  # fmt: skip
    assert tool_result.status_code == 200, tool_result.text
    assert "media_omitted" not in tool_result.text  # the model saw the screenshot, no placeholder


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header says width x height and whose data is a few bytes: a decompression bomb's shape."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


BAD_IMAGES = {
    "not base64": ("image/png", "@@not-base64@@", "not valid base64"),
    "not an image": ("image/png", base64.b64encode(b"hello, this is text").decode(), "not an image"),
    "truncated": ("image/png", base64.b64encode(draw_png("circle")[:200]).decode(), "truncated or corrupt"),
    "too many pixels": ("image/png", base64.b64encode(_png_claiming(60_000, 60_000)).decode(), "pixels"),
    "too many bytes": ("image/png", base64.b64encode(b"\x89PNG" + bytes(MAX_IMAGE_BYTES)).decode(), "larger than"),
    "unsupported type": ("image/tiff", base64.b64encode(draw_png("circle")).decode(), "unsupported image media type"),
    "a shape the model cannot patch": ("image/png", base64.b64encode(draw_png("stripes", (3000, 2))).decode(), "cannot be prepared"),
}


@pytest.mark.parametrize("case", sorted(BAD_IMAGES))
def test_malformed_images_are_refused_on_every_api(server, case):
    media, data, words = BAD_IMAGES[case]
    url = f"data:{media};base64,{data}"
    openai = httpx.post(server.base_url + "/v1/chat/completions", json={
        "model": VLM, "max_tokens": 4,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}, timeout=60)  # fmt: skip
    anthropic = httpx.post(server.base_url + "/v1/messages", json={
        "model": VLM, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}]}]}, timeout=60)  # fmt: skip
    responses = httpx.post(server.base_url + "/v1/responses", json={
        "model": VLM, "max_output_tokens": 4,
        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": url}]}]}, timeout=60)  # fmt: skip
    for r in (openai, responses):
        assert r.status_code == 400, r.text
        assert words in r.json()["error"]["message"] and r.json()["error"]["type"] == "invalid_request_error"
    assert anthropic.status_code == 400, anthropic.text
    body = anthropic.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error" and words in body["error"]["message"]


def test_remote_image_urls_are_refused_unless_allowed(server):
    r = httpx.post(server.base_url + "/v1/chat/completions", json={
        "model": VLM, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}}]}]}, timeout=60)  # fmt: skip
    assert r.status_code == 400 and "--allow-remote-images" in r.json()["error"]["message"]


def test_a_text_model_keeps_its_image_policy(server):
    r = httpx.post(server.base_url + "/v1/chat/completions", json={
        "model": "tiny-llama", "max_tokens": 4, "messages": [image_message(draw_png("circle"))]}, timeout=60)  # fmt: skip
    assert r.status_code == 400 and "'tiny-llama' is a text model" in r.json()["error"]["message"]


def test_a_responses_chain_keeps_its_images(server):
    """`previous_response_id` brings the earlier turn's image back: the chained prompt holds it
    (its tokens are restored from the cache) and answers as the whole conversation sent at once."""
    png = draw_png("square")
    first_input = [{"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(png)}, {"type": "input_text", "text": "Describe it."}]}]  # fmt: skip

    def respond(**body) -> dict:
        r = httpx.post(server.base_url + "/v1/responses", json={"model": VLM, "max_output_tokens": 8, "temperature": 0, **body}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    first = respond(input=first_input)
    chained = respond(previous_response_id=first["id"], input="And the colour?")
    text = first["output"][-1]["content"][0]["text"]
    whole = respond(input=[*first_input, {"role": "assistant", "content": text}, {"role": "user", "content": "And the colour?"}])
    assert chained["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
    assert chained["usage"]["input_tokens_details"]["cached_tokens"] > first["usage"]["input_tokens"] - 2
    assert chained["output"][-1]["content"][0]["text"] == whole["output"][-1]["content"][0]["text"]


def test_after_a_restart_an_image_prompt_hits_the_ssd_and_answers_as_a_miss(server):
    """Blocks holding an image are keyed by its digest, so they are found again after a restart."""
    messages = [{"role": "system", "content": "You describe pictures. " * 4}, image_message(draw_png("stripes"))]
    httpx.post(server.base_url + "/api/cache/clear", timeout=30)
    miss = chat(server, messages)
    server.stop()
    make_recompute_look_slow(server.home)  # a tiny model recomputes faster than the SSD restores
    server.start()
    hit = chat(server, messages)
    assert answer(miss)[1] == 0 and answer(hit)[1] == miss["usage"]["prompt_tokens"] - 1
    assert answer(hit)[0] == answer(miss)[0]
    ssd = httpx.get(server.base_url + "/api/cache/stats").json()["ssd"]
    assert ssd["hits"] > 0


def test_the_pool_unloads_loads_and_pins_a_vision_model_as_any_model(server):
    def state() -> str:
        return next(m for m in httpx.get(server.base_url + "/v1/models").json()["data"] if m["id"] == VLM)["state"]

    ref = answer(chat(server, [image_message(draw_png("circle"), "Again?")]))[0]
    assert httpx.post(server.base_url + f"/v1/models/{VLM}/unload", timeout=30).json()["unloaded"] is True
    assert state() == "unloaded"
    assert answer(chat(server, [image_message(draw_png("circle"), "Again?")]))[0] == ref  # loaded again on use
    assert state() == "loaded"
    r = httpx.put(server.base_url + f"/api/models/{VLM}/settings", json={"pinned": True}, timeout=30)
    assert r.status_code == 200
    status = next(m for m in httpx.get(server.base_url + "/v1/models/status").json()["data"] if m["id"] == VLM)
    assert status["pinned"] is True


def test_text_only_requests_to_a_vision_model_work(server):
    reply = chat(server, [{"role": "user", "content": "The quick brown fox."}])
    assert reply["choices"][0]["finish_reason"] in ("stop", "length") and reply["usage"]["completion_tokens"] > 0
