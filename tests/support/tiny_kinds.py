"""Tiny random-weight models of real mlx-lm architectures whose caches are not all `KVCache`
(sliding windows, recurrent / linear attention, hybrids), built at test time like
`tiny_model.build_tiny_llama`: their real layer patterns, a few MB, the test tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.tiny_model import build_tokenizer

VOCAB = 515  # the test tokenizer's 512 entries and a margin (`build_tiny_llama` uses len + 3)


def gpt_oss_config(window: int) -> dict:
    """gpt-oss: sliding and full attention alternating, a mixture of experts."""
    return {
        "model_type": "gpt_oss", "num_hidden_layers": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
        "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "hidden_size": 64, "intermediate_size": 64, "head_dim": 16,
        "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": window, "rope_theta": 150000,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    }  # fmt: skip


def gemma3_text_config(window: int) -> dict:
    """Gemma 3: five sliding-window layers to one global, as the real models."""
    return {
        "model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 6, "intermediate_size": 128,
        "num_attention_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": VOCAB,
        "num_key_value_heads": 1, "query_pre_attn_scalar": 16, "sliding_window": window,
        "sliding_window_pattern": 6, "max_position_embeddings": 4096,
    }  # fmt: skip


def qwen3_next_config() -> dict:
    """Qwen3-Next: three gated delta-net (linear) layers to one full-attention layer, MoE."""
    return {
        "model_type": "qwen3_next", "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
        "num_attention_heads": 4, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 64, "mlp_only_layers": [], "moe_intermediate_size": 32,
        "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "num_key_value_heads": 2, "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25, "max_position_embeddings": 4096, "head_dim": 16,
        "full_attention_interval": 4,
    }  # fmt: skip


def lfm2_config() -> dict:
    """LFM2: short-convolution layers with attention layers among them."""
    return {
        "model_type": "lfm2", "vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
        "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3, "block_dim": 64, "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": True, "block_ff_dim": 128,
        "full_attn_idxs": [2, 5],
    }  # fmt: skip


def mamba2_config() -> dict:
    """Mamba 2: every layer a state-space layer (conv state and SSM state), no attention."""
    return {
        "model_type": "mamba2", "num_heads": 4, "head_dim": 16, "vocab_size": VOCAB, "hidden_size": 32,
        "intermediate_size": 64, "state_size": 16, "num_hidden_layers": 3, "layer_norm_epsilon": 1e-5,
        "conv_kernel": 4, "n_groups": 1, "use_bias": False, "use_conv_bias": True,
        "tie_word_embeddings": True, "time_step_limit": [0.0, 1e9], "time_step_rank": 4,
    }  # fmt: skip


def build_tiny_arch(out: Path, config: dict, *, seed: int = 0, weight_scale: float = 2.0) -> Path:
    """A random-weight model folder of `config`'s architecture that mlx_lm.load() accepts (float32);
    matrices scaled by `weight_scale` so that greedy output varies from token to token."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import save_model

    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    config = {"eos_token_id": 2, "tie_word_embeddings": True, **config}
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    weights = [(k, v * weight_scale if v.ndim == 2 else v) for k, v in tree_flatten(model.parameters())]
    model.load_weights(weights)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    save_model(out, model)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


ARCHS = {
    "gpt_oss": lambda window=8: gpt_oss_config(window),
    "gemma3_text": lambda window=8: gemma3_text_config(window),
    "qwen3_next": lambda window=0: qwen3_next_config(),
    "lfm2": lambda window=0: lfm2_config(),
    "mamba2": lambda window=0: mamba2_config(),
}


def qwen3_5_config() -> dict:
    """Qwen3.5 (text): three gated delta-net layers to one full-attention layer, dense MLP."""
    return {
        "model_type": "qwen3_5",
        "text_config": {
            "model_type": "qwen3_5_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": VOCAB,
            "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
            "max_position_embeddings": 4096, "tie_word_embeddings": True,
        },
    }  # fmt: skip


def falcon_h1_config() -> dict:
    """Falcon-H1: every layer a Mamba-2 mixer beside attention (`CacheList` of both)."""
    return {
        "model_type": "falcon_h1", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": VOCAB,
        "mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_d_conv": 4,
        "mamba_chunk_size": 16, "max_position_embeddings": 4096, "rope_theta": 10000.0,
    }  # fmt: skip


ARCHS["qwen3_5"] = lambda window=0: qwen3_5_config()
ARCHS["falcon_h1"] = lambda window=0: falcon_h1_config()


def llama4_config() -> dict:
    """Llama 4 (text): chunked-attention layers (`ChunkedKVCache`, a kind the prefix cache does
    not serve) to one global layer, a mixture of experts."""
    return {
        "model_type": "llama4",
        "text_config": {
            "model_type": "llama4_text", "attention_bias": False, "attention_chunk_size": 16, "head_dim": 16,
            "hidden_size": 64, "interleave_moe_layer_step": 2, "intermediate_size": 64,
            "intermediate_size_mlp": 128, "max_position_embeddings": 4096, "num_attention_heads": 4,
            "num_experts_per_tok": 1, "num_hidden_layers": 4, "num_key_value_heads": 2, "num_local_experts": 2,
            "rms_norm_eps": 1e-5, "rope_scaling": None, "rope_theta": 500000.0, "use_qk_norm": True,
            "vocab_size": VOCAB,
        },
    }  # fmt: skip
