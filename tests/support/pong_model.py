"""A tiny model that answers every prompt with the one word "pong", with a real tokenizer and a
32k window: for runs of the real agent CLIs, whose prompts are tens of thousands of tokens and
whose answers a test must recognise.

Built at test time from Qwen2.5-Coder-0.5B's tokenizer and chat template (tests/support/
qwen_coder.py): a random-weight Llama of 2 layers and width 64 whose layers write nothing, so
the output is a function of the last token alone. Its embeddings make "pong" follow any token
but "pong", and the end of sequence follow "pong", by margins no sampling setting overturns.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

ANSWER = "pong"
HIDDEN = 64
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def build_pong_model(out: Path, tokenizer_dir: Path, context: int = 32768) -> Path:
    """The model folder at `out`, tokenizer and template copied from `tokenizer_dir`."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama
    from mlx_lm.utils import save_model
    from tokenizers import Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    (pong,) = tok.encode(ANSWER).ids
    eos = tok.token_to_id("<|im_end|>")
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN,
        "num_hidden_layers": 2, "intermediate_size": 2 * HIDDEN, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": vocab,
        "max_position_embeddings": context, "rope_theta": 10000.0, "tie_word_embeddings": True,
        "eos_token_id": eos,
    }  # fmt: skip
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    weights = []
    for name, w in tree_flatten(model.parameters()):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w = mx.zeros_like(w)  # the layers add nothing to the residual stream
        elif name.endswith("embed_tokens.weight"):
            w = w * 0.01
            w[:, 0] = 10.0  # every token: +10 along dimension 0
            w[pong] = 0.0
            w[pong, 0], w[pong, 1] = 1000.0, 1000.0  # after any token: pong (logit ~100x the rest)
            w[eos] = 0.0
            w[eos, 1] = 3000.0  # after pong: the end (3000 against pong's 2000)
        weights.append((name, w))
    model.load_weights(weights)
    mx.eval(model.parameters())
    save_model(out, model)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
