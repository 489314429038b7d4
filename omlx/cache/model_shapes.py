"""What a model's shapes say about its prefill cost (the prior of `prefill_cost.PrefillCost`)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn


def attention_ratio(model: Any) -> float | None:
    """The attention term against the per-token term (b/a of `PrefillCost`) that a plain
    transformer's shapes give; None where its layers' work is not told by them (weights of more
    than two dimensions, a sliding window). Reasons: docs/design/restore-or-recompute.md."""
    args, layers = getattr(model, "args", None), getattr(model, "layers", None)
    heads = getattr(args, "num_attention_heads", None)
    hidden = getattr(args, "hidden_size", None)
    head_dim = getattr(args, "head_dim", None) or (hidden // heads if heads and hidden else None)
    if not layers or not heads or not head_dim or getattr(args, "sliding_window", None):
        return None
    weights = 0
    for layer in layers:
        for _, module in layer.named_modules():
            weight = module.get("weight")  # an MLX module is a dict of its parameters and children
            if not isinstance(weight, mx.array) or weight.ndim < 2:
                continue  # norms, or a child module that happens to be called so
            if weight.ndim > 2:
                return None
            if isinstance(module, nn.QuantizedLinear):
                weights += weight.shape[0] * weight.shape[1] * 32 // module.bits
            elif isinstance(module, nn.Linear):
                weights += weight.size
            else:
                return None
    if not weights:
        return None
    return 2 * len(layers) * heads * head_dim / weights
