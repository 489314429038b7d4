"""A vision prompt's prefill on the engine's side (in process, tiny Qwen2-VL): image features are
computed only for images not wholly inside the restored prefix, and a prefix that ends inside an
image gives the same embeddings as computing it all; a VLM without the extra is refused by name."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx_vlm", reason="needs omlx[vision]")

from tests.support.tiny_vlm import build_tiny_qwen2_vl, draw_png  # noqa: E402


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory):
    import mlx.core as mx

    from omlx.models.discovery import inspect_folder
    from omlx.models.vision import load_vlm

    info = inspect_folder(build_tiny_qwen2_vl(tmp_path_factory.mktemp("vlm") / "tiny-qwen2-vl"))
    info.id = "tiny-qwen2-vl"
    return info, *load_vlm(info, mx.float32)


class CountingTower:
    """The model's own vision tower, counting its calls."""

    def __init__(self, tower):
        self.tower, self.calls = tower, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.tower(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tower, name)


def _prompt(tokenizer, parts, pngs: list[bytes]):
    from PIL import Image

    from omlx.engine.vision_input import VisionInput
    from omlx.models.vision import process_images
    from omlx.server.vision_prompt import expand

    images = [Image.open(io.BytesIO(p)).convert("RGB") for p in pngs]
    pixel_values, grid = process_images(parts, images)
    content = [{"type": "image"} for _ in pngs] + [{"type": "text", "text": "Compare them."}]
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    tokens, spans = expand(tokenizer.encode(text, add_special_tokens=False), parts, grid, [p[:32] for p in pngs])
    return tokens, VisionInput(pixel_values, grid, spans)


def test_images_inside_the_cached_prefix_are_not_encoded_again(loaded):
    import mlx.core as mx

    from omlx.engine.vision_lm import VisionPrefill

    info, model, tokenizer, parts = loaded
    tokens, vision = _prompt(tokenizer, parts, [draw_png("circle"), draw_png("square")])
    counting = CountingTower(model.vlm.vision_tower)
    model.vlm.vision_tower = counting
    try:
        full = VisionPrefill(model, tokens, vision, 0)
        assert counting.calls == 2
        (s0, n0), (s1, n1) = vision.spans
        after_first = VisionPrefill(model, tokens, vision, s0 + n0)
        assert counting.calls == 3  # the second image only
        inside_second = VisionPrefill(model, tokens, vision, s1 + 2)
        assert counting.calls == 4  # cut inside an image: that image is encoded, its cached rows skipped
        after_all = VisionPrefill(model, tokens, vision, s1 + n1)
        assert counting.calls == 4
    finally:
        model.vlm.vision_tower = counting.tower
    for part in (after_first, inside_second, after_all):
        k = part.start
        assert mx.array_equal(part.embeds, full.embeds[:, k:]) and mx.array_equal(part.positions, full.positions[:, :, k:])
        assert part.delta == full.delta < 0  # two images of 4 tokens take fewer positions than tokens


def test_a_vlm_without_the_extra_is_refused_naming_it(loaded, monkeypatch):
    from omlx.errors import InvalidRequestError
    from omlx.models.vision import check_servable

    info = loaded[0]
    check_servable(info)  # installed: servable
    monkeypatch.setitem(sys.modules, "mlx_vlm", None)  # what an install without the extra looks like
    with pytest.raises(InvalidRequestError) as refused:
        check_servable(info)
    assert refused.value.status == 400 and "omlx[vision]" in str(refused.value) and "tiny-qwen2-vl" in str(refused.value)


def test_discovery_tells_a_vlm_from_a_text_model(loaded, tmp_path: Path):
    from omlx.models.discovery import inspect_folder
    from tests.support.tiny_model import build_tiny_llama

    assert loaded[0].vision is True and loaded[0].type == "llm"
    assert inspect_folder(build_tiny_llama(tmp_path / "llama")).vision is False
