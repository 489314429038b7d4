"""Load a chat model through mlx-lm and put it in the compute dtype this device runs fastest.

On a Linux CPU, MLX's quantized and half-precision kernels are far slower than
float32 matrix products through BLAS, so `auto` dequantizes to float32 there; on
a GPU (Metal, CUDA) the model keeps its own dtype and quantization. A dequantized model's
weights are kept in the compute dtype (`kept_weights`), so only its first load converts them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import dequantize_model, load_model, load_tokenizer
from mlx_lm.utils import load as mlx_lm_load

from omlx.models import kept_weights
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
    vision: Any = None  # a VLM's `models.vision.VisionParts`; None for a text model
    draft: Any = None  # the model of its `draft_model` setting, loaded beside it (`load_with_draft`)
    draft_id: str | None = None


def resolve_compute_dtype(setting: str) -> str:
    """`auto`: float32 on the CPU, the model's own ("native") on a GPU."""
    if setting != "auto":
        return setting
    return "float32" if mx.default_device() == mx.cpu else "native"


def _is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())


def load_llm(
    info: ModelInfo, compute_dtype: str = "auto", context_cap: int | None = None, kept_root: Path | None = None
) -> LoadedLLM:
    """Load weights and tokenizer; must run on the engine's thread (it makes MLX calls).
    With `kept_root`, a model dequantized here is saved there once and later read back."""
    dtype = resolve_compute_dtype(compute_dtype)
    if info.vision:  # through mlx-vlm, never as a text model (models/vision.py)
        from omlx.models.vision import load_vlm

        model, tokenizer, parts = load_vlm(info, DTYPES.get(dtype))
        context = min(info.context_length or 4096, context_cap or 1 << 30)
        return LoadedLLM(info, model, tokenizer, dtype, context, vision=parts)
    kept = None
    if kept_root is not None and dtype in DTYPES and kept_weights.converts(info.config):
        kept = kept_weights.kept_dir(kept_root, info, dtype)
    if kept is not None and kept_weights.is_kept(kept):
        model, config = load_model(kept)
        tokenizer = load_tokenizer(info.path, eos_token_ids=config.get("eos_token_id"))
        log.info("%s: read its %s weights kept in %s", info.id, dtype, kept)
    else:
        model, tokenizer = mlx_lm_load(str(info.path))
    if dtype in DTYPES:
        dequantized = _is_quantized(model)
        if dequantized:
            dequantize_model(model)
            log.info("%s: dequantized to compute in %s (faster on this device)", info.id, dtype)
        model.set_dtype(DTYPES[dtype])
        mx.eval(model.parameters())
        if dequantized and kept is not None:
            kept_weights.keep(model, info, dtype, kept_root)
    context = info.context_length or 4096
    if context_cap:
        context = min(context, context_cap)
    return LoadedLLM(info, model, tokenizer, dtype, context)


def draft_incompatible(target: Any, draft: Any) -> str | None:
    """Why the tokenizer `draft` cannot draft for `target` (None: it can): the vocabulary must be
    the same, token for token, and so must the end-of-sequence tokens."""
    if target.get_vocab() != draft.get_vocab():
        return "its tokenizer's vocabulary differs"
    if sorted(target.eos_token_ids or []) != sorted(draft.eos_token_ids or []):
        return "its end-of-sequence tokens differ"
    return None


def load_with_draft(
    info: ModelInfo, draft_info: ModelInfo | None, compute_dtype: str = "auto", kept_root: Path | None = None
) -> LoadedLLM:
    """`load_llm`, and the model of its `draft_model` setting beside it (engine thread). A draft
    model that cannot draft for it is left out, with a warning: the model serves without it."""
    loaded = load_llm(info, compute_dtype, kept_root=kept_root)
    if draft_info is None:
        return loaded
    draft = load_llm(draft_info, compute_dtype, kept_root=kept_root)
    why = "it is a vision model" if draft.vision is not None else draft_incompatible(loaded.tokenizer, draft.tokenizer)
    if why is not None:
        log.warning("%s: draft model %s is not used: %s", info.id, draft_info.id, why)
        return loaded
    loaded.draft, loaded.draft_id = draft.model, draft_info.id
    log.info("%s: drafts from %s when a request decodes alone", info.id, draft_info.id)
    return loaded
