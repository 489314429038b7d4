"""Load a chat model through mlx-lm and put it in the compute dtype this device runs fastest.

On a Linux CPU, MLX's quantized and half-precision kernels are far slower than
float32 matrix products through BLAS, so `auto` dequantizes to float32 there; on
a GPU (Metal, CUDA) the model keeps its own dtype and quantization.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import dequantize_model
from mlx_lm.utils import load as mlx_lm_load

from omlx.models.discovery import ModelInfo

log = logging.getLogger("omlx.models")

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


@dataclass
class LoadedLLM:
    info: ModelInfo
    model: nn.Module
    tokenizer: Any  # mlx_lm TokenizerWrapper
    compute_dtype: str
    context_length: int


def resolve_compute_dtype(setting: str) -> str:
    """`auto`: float32 on the CPU, the model's own ("native") on a GPU."""
    if setting != "auto":
        return setting
    return "float32" if mx.default_device() == mx.cpu else "native"


def _is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())


def load_llm(info: ModelInfo, compute_dtype: str = "auto", context_cap: int | None = None) -> LoadedLLM:
    """Load weights and tokenizer; must run on the engine's thread (it makes MLX calls)."""
    model, tokenizer = mlx_lm_load(str(info.path))
    dtype = resolve_compute_dtype(compute_dtype)
    if dtype in DTYPES:
        if _is_quantized(model):
            dequantize_model(model)
            log.info("%s: dequantized to compute in %s (faster on this device)", info.id, dtype)
        model.set_dtype(DTYPES[dtype])
        mx.eval(model.parameters())
    context = info.context_length or 4096
    if context_cap:
        context = min(context, context_cap)
    return LoadedLLM(info, model, tokenizer, dtype, context)
