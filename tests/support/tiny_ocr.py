"""Build a tiny random-weight GLM-OCR (mlx-vlm's `glm_ocr` classes) at test time, with a BPE
tokenizer carrying GLM's chat and image tokens and a GLM-style template (`Text Recognition:` is
the prompt the model was trained on)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.tiny_model import train_bpe

SPECIALS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
            "<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|begin_of_video|>",
            "<|end_of_video|>", "<|video|>"]  # fmt: skip

GLM_TEMPLATE = (
    "[gMASK]<sop>{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_tiny_glm_ocr(out: Path, *, seed: int = 0, weight_scale: float = 4.0) -> Path:
    """A random-weight `glm_ocr` folder that mlx-vlm's `load` accepts: 2 text layers (hidden 128),
    a 2-block vision tower; a 56x56 image is 4 tokens."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models import glm_ocr
    from mlx_vlm.utils import save_weights

    out.mkdir(parents=True, exist_ok=True)
    tok = train_bpe(out, SPECIALS)
    ids = {name: tok.token_to_id(name) for name in SPECIALS}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "chat_template": GLM_TEMPLATE, "model_max_length": 4096,
    }))  # fmt: skip
    eos = [ids["<|endoftext|>"], ids["<|user|>"]]
    text = {
        "model_type": "glm_ocr_text", "vocab_size": tok.get_vocab_size(), "hidden_size": 128, "intermediate_size": 256,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 2,
        "max_position_embeddings": 4096, "eos_token_id": eos, "pad_token_id": ids["<|endoftext|>"],
        "rope_parameters": {"rope_type": "default", "mrope_section": [4, 6, 6], "partial_rotary_factor": 1.0, "rope_theta": 10000},
    }  # fmt: skip
    vision = {
        "model_type": "glm_ocr_vision", "depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4,
        "patch_size": 14, "out_hidden_size": 128, "spatial_merge_size": 2, "temporal_patch_size": 2,
    }  # fmt: skip
    config = {
        "model_type": "glm_ocr", "architectures": ["GlmOcrForConditionalGeneration"], "text_config": text,
        "vision_config": vision, "vocab_size": tok.get_vocab_size(), "hidden_size": 128, "eos_token_id": eos,
        "image_token_id": ids["<|image|>"], "video_token_id": ids["<|video|>"],
        "image_start_token_id": ids["<|begin_of_image|>"], "image_end_token_id": ids["<|end_of_image|>"],
        "video_start_token_id": ids["<|begin_of_video|>"], "video_end_token_id": ids["<|end_of_video|>"],
        "pad_token_id": ids["<|endoftext|>"], "max_position_embeddings": 4096,
    }  # fmt: skip
    mx.random.seed(seed)
    model = glm_ocr.Model(glm_ocr.ModelConfig.from_dict(json.loads(json.dumps(config))))
    weights = [(k, v * weight_scale if v.ndim == 2 else v) for k, v in tree_flatten(model.parameters())]
    model.load_weights(weights)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    save_weights(out, model)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps({
        "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
        "size": {"shortest_edge": 56 * 56, "longest_edge": 112 * 112},
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    }))  # fmt: skip
    return out
