"""Build a tiny random-weight Qwen2-VL (mlx-vlm's own classes, a BPE tokenizer with Qwen2-VL's
vision tokens, its image-processor config) at test time, and draw test images with Pillow."""

from __future__ import annotations

import io
import json
from pathlib import Path

from tests.support.tiny_model import train_bpe

VISION_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

# Qwen2-VL's template, reduced: content is a string or a list of text / image parts, in any role
VL_CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer(out: Path) -> dict[str, int]:
    train_bpe(out, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *VISION_SPECIALS])
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": VL_CHATML,
        "model_max_length": 4096,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "chat_template.json").write_text(json.dumps({"chat_template": VL_CHATML}))
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    return {name: vocab[name] for name in ["<|im_end|>", *VISION_SPECIALS]} | {"size": len(vocab)}


def build_tiny_qwen2_vl(out: Path, *, seed: int = 0, weight_scale: float = 4.0, model_type: str = "qwen2_vl") -> Path:
    """A random-weight `qwen2_vl` (or `qwen2_5_vl`) folder that mlx-vlm's `load` accepts (a few MB):
    2 text layers (hidden 128), a 2-block vision tower; 14-pixel patches merged 2x2, so a 56x56
    image is 4 tokens."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import save_weights

    arch = importlib.import_module(f"mlx_vlm.models.{model_type}")

    out.mkdir(parents=True, exist_ok=True)
    ids = _tokenizer(out)
    config = {
        "model_type": model_type,
        "architectures": ["Qwen2VLForConditionalGeneration" if model_type == "qwen2_vl" else "Qwen2_5_VLForConditionalGeneration"],
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": ids["size"],
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
        "tie_word_embeddings": True,
        "eos_token_id": ids["<|im_end|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_config": {
            "model_type": model_type,
            "depth": 2,
            "embed_dim": 64,
            "hidden_size": 128,
            "num_heads": 4,
            "patch_size": 14,
            "spatial_patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_chans": 3,
            "mlp_ratio": 2,
        },
    }
    if model_type == "qwen2_5_vl":  # a windowed tower: width 64 out to the text's 128, one full-attention block
        config["vision_config"] |= {"hidden_size": 64, "intermediate_size": 128, "out_hidden_size": 128,
                                    "window_size": 56, "fullatt_block_indexes": [1]}  # fmt: skip
    model_config = arch.ModelConfig.from_dict(json.loads(json.dumps(config)))
    model_config.vision_config = arch.VisionConfig.from_dict(config["vision_config"])
    model_config.text_config = arch.TextConfig.from_dict(config)
    mx.random.seed(seed)
    model = arch.Model(model_config)
    weights = [(k, v * weight_scale if v.ndim == 2 else v) for k, v in tree_flatten(model.parameters())]
    model.load_weights(weights)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    save_weights(out, model)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
        "patch_size": 14,
        "merge_size": 2,
        "temporal_patch_size": 2,
        "min_pixels": 56 * 56,
        "max_pixels": 112 * 112,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    }))  # fmt: skip
    return out


def draw_png(kind: str = "circle", size: tuple[int, int] = (56, 56)) -> bytes:
    """A small PNG drawn with Pillow: `circle`, `square` or `stripes`."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, (255, 255, 255))
    d = ImageDraw.Draw(img)
    w, h = size
    if kind == "circle":
        d.ellipse((w // 8, h // 8, w - w // 8, h - h // 8), fill=(200, 30, 30))
    elif kind == "square":
        d.rectangle((w // 4, h // 4, 3 * w // 4, 3 * h // 4), fill=(30, 30, 200))
    else:
        for x in range(0, w, 6):
            d.line((x, 0, x, h), fill=(20, 160, 20), width=3)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()
