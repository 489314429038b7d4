"""Build a tiny random-weight Llama (with a real BPE tokenizer and ChatML template) at test time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mlx.core as mx

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# a reasoning model's template: the answer opens inside a think block
THINKING_CHATML = CHATML.replace("<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>\n{% endif %}")

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Local language models answer questions, write code and call tools.",
    "def add(a, b):\n    return a + b\n",
    "Numbers like 12345 and 678 appear in text; so do punctuation marks!?",
] * 20


def train_bpe(out: Path, specials: list[str], vocab_size: int = 512) -> Any:
    """A byte-level BPE tokenizer trained on `CORPUS` with `specials` first (ids 0, 1, …), saved
    as `out / "tokenizer.json"`; the `tokenizers.Tokenizer`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(out / "tokenizer.json"))
    return tok


def build_tokenizer(out: Path, vocab_size: int = 512, thinking: bool = False) -> None:
    """A BPE tokenizer with ChatML's special tokens (and `<think>`/`</think>` with `thinking`,
    whose template opens a think block for the answer)."""
    train_bpe(out, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + (["<think>", "</think>"] if thinking else []), vocab_size)
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": THINKING_CHATML if thinking else CHATML,
                "model_max_length": 2048,
            }
        )
    )


def build_tiny_llama(
    out: Path,
    *,
    seed: int = 0,
    hidden: int = 256,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    context: int = 2048,
    model_type: str = "llama",
    extra_config: dict | None = None,
    dtype: str = "float32",
    eos_unreachable: bool = False,
    weight_scale: float = 4.0,
    thinking: bool = False,
) -> Path:
    """A random-weight model folder that mlx_lm.load() accepts; ~2 MB, loads in ~0.05 s.
    `dtype="bfloat16"` gives the half-precision path (MLX's CUDA prefill attention runs
    cuDNN only for half-precision inputs). `eos_unreachable`: the end-of-sequence token's
    logit is far below every other token's after any input, so that greedy (or sampled)
    output only ends at max_tokens or the context window; for APIs without `logit_bias`.
    `weight_scale=1.0` keeps MLX's default init: a model whose greedy output repeats one token
    (for tests of repetition penalties). `thinking`: a reasoning model's tokenizer and template."""
    import importlib

    import mlx.core as mx
    from mlx_lm.utils import save_model

    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, thinking=thinking)
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    config = {
        "model_type": model_type,
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 2,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": len(vocab) + 3,
        "max_position_embeddings": context,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "eos_token_id": 2,
        **(extra_config or {}),
    }
    arch = importlib.import_module(f"mlx_lm.models.{model_type}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    # Default inits give a model that repeats one token; scaled-up weights (the default 4x)
    # give varied output, so "same output" assertions in tests can actually fail.
    from mlx.utils import tree_flatten

    weights = [(k, v * weight_scale if v.ndim == 2 else v) for k, v in tree_flatten(model.parameters())]
    if eos_unreachable:
        weights = _eos_unreachable(weights, config["eos_token_id"])
    model.load_weights(weights)
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    save_model(out, model)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _eos_unreachable(weights: list[tuple[str, mx.array]], eos: int) -> list[tuple[str, mx.array]]:
    """Residual dimension 0 carries a constant: every token embeds to +C there, and no layer
    writes to it (its rows of `o_proj` and `down_proj` are zero), so after the final norm it
    is positive at every position whose input is not EOS. EOS's (tied) embedding is -M along
    it alone, so EOS's logit sits (M + C) * C / rms below every other token's; the other
    tokens all gain the same C * C / rms, which changes none of their order (after an input
    ending in EOS the sign flips, but no prompt ends there and no output token is EOS)."""
    import mlx.core as mx

    C, M = 1.0, 1e4
    out = []
    for name, w in weights:
        if name.endswith("embed_tokens.weight"):
            w = w.at[:, 0].add(C - w[:, 0])
            w = w.at[eos].multiply(0.0)
            w = w.at[eos, 0].add(-M)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            w = w.at[0].multiply(0.0)
        out.append((name, w))
    mx.eval([w for _, w in out])
    return out


def build_tiny_draft(out: Path, like: Path, *, seed: int = 1, hidden: int = 64, layers: int = 2) -> Path:
    """A tiny random-weight Llama with the tokenizer (files, vocabulary size, end tokens) of the
    model in `like`: a draft model for it whose drafts are mostly wrong."""
    import shutil

    import mlx.core as mx
    from mlx_lm.models import llama
    from mlx_lm.utils import save_model

    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (like / name).exists():
            shutil.copy(like / name, out / name)
    base = json.loads((like / "config.json").read_text())
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
        "num_hidden_layers": layers, "intermediate_size": hidden * 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "rms_norm_eps": 1e-5, "vocab_size": base["vocab_size"],
        "max_position_embeddings": base.get("max_position_embeddings", 8192), "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        **{k: base[k] for k in ("bos_token_id", "eos_token_id") if k in base},
    }  # fmt: skip
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    save_model(out, model)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
