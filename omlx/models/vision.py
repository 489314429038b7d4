"""Vision-language models: told from text models by their config, loaded through mlx-vlm (the
`omlx[vision]` extra), and their images turned into what the vision tower takes.

Discovery marks a model `vision` by its config alone (`discovery.is_vision_config`); `load_vlm` and
`process_images` need mlx-vlm. A VLM found
while the extra is missing is listed and refused on use with a 400 naming the extra, never loaded
as a text model (docs/design/vision.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from omlx.errors import InvalidRequestError
from omlx.models.discovery import ModelInfo

log = logging.getLogger("omlx.models")

EXTRA = "omlx[vision]"
# served: the M-RoPE models whose language model takes explicit positions (engine/vision_lm.py) and
# DeepSeek-OCR, whose prompt layout its own processor builds (engine/vision_ocr.py,
# server/ocr_prompt.py); others with a vision tower are refused by name
SERVED = frozenset({"qwen2_vl", "qwen2_5_vl", "glm_ocr", "deepseekocr"})


def vision_installed() -> bool:
    """Whether mlx-vlm and Pillow import (imported once here; later imports are free)."""
    try:
        import mlx_vlm  # noqa: F401
        import PIL  # noqa: F401
    except ImportError:
        return False
    return True


def check_servable(info: ModelInfo) -> None:
    """A 400 when this VLM cannot be served here: the extra is missing, or its architecture is not yet."""
    kind = info.config.get("model_type")
    if not vision_installed():
        raise InvalidRequestError(
            f"model '{info.id}' is a vision-language model ({kind}); serving it needs the {EXTRA} extra "
            f"(pip install '{EXTRA}'), which is not installed.",
            param="model",
        )
    if kind not in SERVED:
        raise InvalidRequestError(
            f"model '{info.id}' is a vision-language model of architecture '{kind}', which oMLX does not "
            f"serve yet (served: {', '.join(sorted(SERVED))}).",
            param="model",
        )


@dataclass
class VisionParts:
    """What a loaded VLM adds to its text side: the image processor and its image token."""

    image_processor: Any
    image_token_id: int
    merge_size: int
    heads: int = 16  # the vision tower's attention heads
    width: int = 1280  # its hidden size
    # DeepSeek-OCR: mlx-vlm's `DeepseekOCRProcessor`, which tokenizes the prompt with its images
    # (tiles, newline and view-separator slots) in place of `image_processor` (server/ocr_prompt.py)
    ocr: Any = None

    def tokens_for(self, grid_thw: Any) -> int:
        """Prompt tokens one image of this (t, h, w) patch grid takes."""
        t, h, w = (int(x) for x in grid_thw)
        return t * h * w // (self.merge_size**2)

    def activation_bytes(self, grid: Any) -> int:
        """An estimate of the vision tower's peak for the largest of these images (they are encoded
        one at a time): float32 attention scores over all its patches plus a few hidden states."""
        patches = max((int(t) * int(h) * int(w) for t, h, w in grid), default=0)
        return 4 * (self.heads * patches * patches + 8 * patches * self.width)


def load_vlm(info: ModelInfo, dtype: Any | None) -> tuple[Any, Any, VisionParts]:
    """(engine model, mlx-lm tokenizer, vision parts) of a VLM folder; on the engine's thread (MLX)."""
    import mlx.core as mx
    from mlx_lm.utils import load_tokenizer
    from mlx_vlm.utils import load_model, load_processor

    from omlx.engine.vision_lm import VisionLM

    check_servable(info)
    vlm = load_model(info.path)
    if dtype is not None:
        vlm.set_dtype(dtype)
    mx.eval(vlm.parameters())
    eos = info.config.get("eos_token_id")
    tokenizer = load_tokenizer(info.path, eos_token_ids=eos if eos is not None else None)
    processor = load_processor(info.path, add_detokenizer=False)
    if info.config["model_type"] == "deepseekocr":
        from omlx.engine.vision_ocr import SAM_HEADS, SAM_WIDTH, OcrLM

        token = int(vlm.config.image_token_index)
        ocr = VisionParts(None, token, 1, heads=SAM_HEADS, width=SAM_WIDTH, ocr=processor)
        return OcrLM(vlm, info.config["model_type"]), tokenizer, ocr
    parts = VisionParts(
        image_processor=processor.image_processor,
        image_token_id=int(vlm.config.image_token_id),
        merge_size=int(vlm.config.vision_config.spatial_merge_size),
        heads=int(getattr(vlm.config.vision_config, "num_heads", 16)),
        width=int(getattr(vlm.config.vision_config, "embed_dim", None) or getattr(vlm.config.vision_config, "hidden_size", 1280)),
    )
    return VisionLM(vlm, info.config["model_type"]), tokenizer, parts


def process_images(parts: VisionParts, images: list[Any]) -> tuple[Any, Any]:
    """(pixel_values, grid_thw) as numpy arrays for decoded RGB Pillow images (CPU, numpy: any thread)."""
    import numpy as np

    out = parts.image_processor(images=images, return_tensors="np")
    return np.asarray(out["pixel_values"]), np.asarray(out["image_grid_thw"]).reshape(-1, 3)
