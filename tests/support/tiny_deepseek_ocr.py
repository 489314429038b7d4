"""Build a tiny random-weight DeepSeek-OCR (mlx-vlm's `deepseekocr` classes) at test time, with a
BPE tokenizer carrying DeepSeek's BOS (id 0, which the processor prepends itself), its image,
grounding and chat tokens, and the processor config mlx-vlm's `DeepseekOCRProcessor` reads.

mlx-vlm 0.7.10 builds the SAM encoder at full size whatever the config says (`SAMViTConfig()`:
width 768, 12 layers, 1024-pixel input, ~90M parameters, ~360 MB in float32), and its output
(1024 channels) fixes the CLIP tower's width at 1024; only the CLIP depth, the projector and the
text model are small here. An image of at most 640x640 pixels is the global view only: 273
tokens (16 rows of 16 feature slots and a newline slot, then the view separator)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.tiny_model import train_bpe

SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<image>", "<|ref|>", "<|/ref|>",
            "<|det|>", "<|/det|>", "<|grounding|>", "<|User|>", "<|Assistant|>"]  # fmt: skip


def build_tiny_deepseek_ocr(out: Path, *, seed: int = 0, weight_scale: float = 4.0, weights: bool = True) -> Path:
    """A random-weight `deepseekocr` folder that mlx-vlm's `load` accepts: 2 text layers (hidden
    128, the second a 4-expert MoE as in the real model), a 1-layer CLIP tower, the full SAM encoder
    (`weights=False`: the tokenizer and configs only, enough for mlx-vlm's processor)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models import deepseekocr
    from mlx_vlm.utils import save_weights

    out.mkdir(parents=True, exist_ok=True)
    tok = train_bpe(out, SPECIALS)
    ids = {name: tok.token_to_id(name) for name in SPECIALS}
    assert ids["<｜begin▁of▁sentence｜>"] == 0  # the processor prepends id 0 as BOS
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizerFast", "bos_token": "<｜begin▁of▁sentence｜>",
        "eos_token": "<｜end▁of▁sentence｜>", "pad_token": "<｜▁pad▁｜>", "add_bos_token": False,
        "add_eos_token": False, "model_max_length": 8192,
    }))  # fmt: skip
    eos = ids["<｜end▁of▁sentence｜>"]
    text = {
        "model_type": "deepseek_v2", "vocab_size": tok.get_vocab_size(), "hidden_size": 128, "intermediate_size": 256,
        "moe_intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "n_shared_experts": 1, "n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "qk_nope_head_dim": 0, "qk_rope_head_dim": 0, "max_position_embeddings": 8192, "bos_token_id": 0,
        "eos_token_id": eos,
    }  # fmt: skip
    vision = {"model_type": "vision", "layers": 1, "width": 1024, "hidden_size": 1024, "intermediate_size": 1024,
              "num_attention_heads": 4, "image_size": 224, "patch_size": 14}  # fmt: skip
    config = {
        "model_type": "deepseekocr", "architectures": ["DeepseekOCRForCausalLM"], "language_config": text,
        "vision_config": vision, "projector_config": {"projector_type": "linear", "input_dim": 2048, "n_embed": 128},
        "image_token_index": ids["<image>"], "tile_tag": "2D", "global_view_pos": "head", "eos_token_id": eos,
        "bos_token_id": 0, "vocab_size": tok.get_vocab_size(), "hidden_size": 128,
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "processor_config.json").write_text(json.dumps({
        "processor_class": "DeepseekOCRProcessor", "candidate_resolutions": [[1024, 1024]], "patch_size": 16,
        "downsample_ratio": 4, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "normalize": True,
        "image_token": "<image>", "pad_token": "<｜▁pad▁｜>", "add_special_token": False, "sft_format": "deepseek",
        "mask_prompt": False, "ignore_id": -100,
    }))  # fmt: skip
    if not weights:
        return out
    mx.random.seed(seed)
    model = deepseekocr.Model(deepseekocr.ModelConfig.from_dict(json.loads(json.dumps(config))))
    scaled = [(k, v * weight_scale if v.ndim == 2 and k.startswith("language_model") else v)
               for k, v in tree_flatten(model.parameters())]  # fmt: skip
    model.load_weights(scaled)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    save_weights(out, model)
    return out


def mlx_vlm_reference(path: Path, png: bytes, prompt: str, n: int) -> tuple[list[int], int]:
    """mlx-vlm's own greedy `stream_generate` on this model and image, with its own prompt formatting
    for the model (`apply_chat_template`): the first `n` tokens and the prompt's length. Run in a
    child process with OpenBLAS preloaded where installed, as `omlx serve` runs (the reference BLAS
    bundled with mlx-cpu makes the 1024-pixel SAM pass take minutes instead of seconds)."""
    import os
    import subprocess
    import sys
    import tempfile

    from omlx.platform_info import find_openblas

    env = dict(os.environ)
    lib = find_openblas()
    if lib is not None and sys.platform == "linux":
        env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    with tempfile.NamedTemporaryFile(suffix=".png") as f:
        f.write(png)
        f.flush()
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run([sys.executable, "-m", "tests.support.tiny_deepseek_ocr", str(path), f.name, prompt, str(n)],
                             env=env, cwd=root,
                             capture_output=True, text=True, timeout=900, check=True)  # fmt: skip
    tokens, prompt_tokens = json.loads(out.stdout.strip().splitlines()[-1])
    return tokens, prompt_tokens


def _reference_main(path: str, png_path: str, prompt: str, n: int) -> None:
    from mlx_vlm import load, stream_generate
    from mlx_vlm.prompt_utils import apply_chat_template
    from PIL import Image

    model, processor = load(path)
    text = apply_chat_template(processor, model.config, prompt, num_images=1)
    image = Image.open(png_path).convert("RGB")
    steps = list(stream_generate(model, processor, text, image=[image], max_tokens=n, temperature=0.0))
    print(json.dumps([[int(s.token) for s in steps[:n]], int(steps[-1].prompt_tokens)]), flush=True)


if __name__ == "__main__":
    import sys

    _reference_main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
