"""BERT-family encoders in MLX: BERT, RoBERTa, XLM-RoBERTa (and CamemBERT), with the
sequence-classification heads that cross-encoder rerankers use.

The module tree has its own short names; `hf_key()` maps Hugging Face checkpoint names
onto them (`bert.encoder.layer.3.attention.self.query` → `layers.3.attn.query`).
Architectures we cannot compute faithfully are refused with `UnsupportedModelError`
instead of producing wrong vectors.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from omlx.errors import InvalidRequestError

BERT_TYPES = ("bert",)
ROBERTA_TYPES = ("roberta", "xlm-roberta", "camembert")
SUPPORTED_TYPES = BERT_TYPES + ROBERTA_TYPES

ACTIVATIONS = {
    "gelu": nn.gelu,
    "gelu_python": nn.gelu,
    "gelu_new": nn.gelu_approx,
    "gelu_pytorch_tanh": nn.gelu_approx,
    "gelu_fast": nn.gelu_approx,
    "relu": nn.relu,
    "silu": nn.silu,
    "swish": nn.silu,
    "tanh": mx.tanh,
}


class UnsupportedModelError(InvalidRequestError):
    """The model's architecture or configuration is one this encoder cannot run."""

    def __init__(self, message: str):
        super().__init__(message, param="model", code="unsupported_model")


@dataclass
class EncoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    hidden_act: str = "gelu"
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    num_labels: int = 0  # 0: no classification head
    architectures: list[str] = field(default_factory=list)

    @property
    def is_roberta(self) -> bool:
        return self.model_type in ROBERTA_TYPES

    @property
    def position_offset(self) -> int:
        """RoBERTa numbers positions from padding_idx + 1; BERT from 0."""
        return self.pad_token_id + 1 if self.is_roberta else 0

    @property
    def max_tokens(self) -> int:
        """The longest input the position table can hold."""
        return self.max_position_embeddings - self.position_offset

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], model_id: str = "model") -> EncoderConfig:
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_TYPES:
            raise UnsupportedModelError(
                f"Model '{model_id}' is a '{model_type or 'unknown'}' encoder, which oMLX cannot run "
                f"yet; supported encoder types: {', '.join(SUPPORTED_TYPES)}."
            )
        pet = cfg.get("position_embedding_type", "absolute")
        if pet != "absolute":
            raise UnsupportedModelError(
                f"Model '{model_id}' uses position_embedding_type '{pet}'; only 'absolute' is supported."
            )
        act = cfg.get("hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"Model '{model_id}' uses activation '{act}', which is not supported."
            )
        archs = list(cfg.get("architectures") or [])
        classifies = any(a.endswith("ForSequenceClassification") for a in archs)
        num_labels = 0
        if classifies:
            num_labels = int(cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 2)
        try:
            return cls(
                model_type=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=int(cfg["hidden_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=int(cfg["num_attention_heads"]),
                intermediate_size=int(cfg["intermediate_size"]),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 512)),
                hidden_act=act,
                type_vocab_size=int(cfg.get("type_vocab_size") or 1),
                layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
                pad_token_id=int(
                    cfg.get("pad_token_id")
                    if cfg.get("pad_token_id") is not None
                    else (1 if model_type in ROBERTA_TYPES else 0)
                ),
                num_labels=num_labels,
                architectures=archs,
            )
        except KeyError as exc:
            raise UnsupportedModelError(
                f"Model '{model_id}': config.json lacks {exc.args[0]!r}."
            ) from None


class Packing:
    """Real tokens of a right-padded (B, L) batch, packed into (T, …) rows and back.

    The dense layers (most of the work) run on the T real tokens only, so a batch of
    mixed lengths wastes nothing on padding there; only attention uses the padded layout.
    """

    def __init__(self, mask: mx.array):
        m = np.array(mask, dtype=bool).reshape(-1)
        self.shape = tuple(mask.shape)
        self.count = int(m.sum())
        slot = np.full(m.size, self.count, dtype=np.int32)  # padding → an all-zero row
        slot[m] = np.arange(self.count, dtype=np.int32)
        self.real = mx.array(np.flatnonzero(m).astype(np.int32))
        self.slot = mx.array(slot)

    def pack(self, x: mx.array) -> mx.array:
        """(B·L, …) → (T, …)"""
        return x[self.real]

    def pad(self, x: mx.array) -> mx.array:
        """(T, D) → (B·L, D), zeros at padding."""
        return mx.concatenate([x, mx.zeros((1, x.shape[-1]), dtype=x.dtype)])[self.slot]


class Embeddings(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(max(1, cfg.type_vocab_size), cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def __call__(self, ids: mx.array, type_ids: mx.array, positions: mx.array) -> mx.array:
        h = self.word_embeddings(ids) + self.position_embeddings(positions)
        h = h + self.token_type_embeddings(type_ids)
        return self.norm(h)


class Attention(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        d = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.head_dim = d // self.heads
        self.query = nn.Linear(d, d)
        self.key = nn.Linear(d, d)
        self.value = nn.Linear(d, d)
        self.out = nn.Linear(d, d)

    def __call__(self, x: mx.array, mask: mx.array, packing: Packing) -> mx.array:
        """x: packed real tokens (T, D); attention runs on the padded (B, H, L, Dh) layout."""
        b, n = packing.shape

        def split(t: mx.array) -> mx.array:
            t = packing.pad(t)
            return t.reshape(b, n, self.heads, self.head_dim).transpose(0, 2, 1, 3)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        o = mx.fast.scaled_dot_product_attention(
            q, k, v, scale=1.0 / math.sqrt(self.head_dim), mask=mask
        )
        return self.out(packing.pack(o.transpose(0, 2, 1, 3).reshape(b * n, -1)))


class Layer(nn.Module):
    """Post-norm transformer block, as in BERT."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.attn = Attention(cfg)
        self.attn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.ffn_in = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.ffn_out = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.ffn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def __call__(self, x: mx.array, mask: mx.array, packing: Packing) -> mx.array:
        x = self.attn_norm(x + self.attn(x, mask, packing))
        return self.ffn_norm(x + self.ffn_out(self.act(self.ffn_in(x))))


class Pooler(nn.Module):
    """BERT's pooler: tanh(dense(hidden state of [CLS]))."""

    def __init__(self, d: int):
        super().__init__()
        self.dense = nn.Linear(d, d)

    def __call__(self, h: mx.array) -> mx.array:
        return mx.tanh(self.dense(h[:, 0]))


class RobertaHead(nn.Module):
    """RoBERTa's classification head: out_proj(tanh(dense(hidden state of <s>)))."""

    def __init__(self, d: int, labels: int):
        super().__init__()
        self.dense = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, labels)

    def __call__(self, h: mx.array) -> mx.array:
        return self.out_proj(mx.tanh(self.dense(h[:, 0])))


class Encoder(nn.Module):
    """Token ids → last hidden states; with a head, also classification logits."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.embeddings = Embeddings(cfg)
        self.layers = [Layer(cfg) for _ in range(cfg.num_hidden_layers)]
        if cfg.num_labels and cfg.is_roberta:
            self.classifier = RobertaHead(cfg.hidden_size, cfg.num_labels)
        elif cfg.num_labels:
            self.pooler = Pooler(cfg.hidden_size)
            self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels)

    def positions(self, mask: mx.array) -> mx.array:
        """Position ids for right-padded inputs; RoBERTa counts real tokens from pad+1."""
        if self.cfg.is_roberta:
            m = mask.astype(mx.int32)
            return mx.cumsum(m, axis=1) * m + self.cfg.pad_token_id
        return mx.broadcast_to(mx.arange(mask.shape[1])[None], mask.shape)

    def __call__(self, ids: mx.array, mask: mx.array, type_ids: mx.array | None = None) -> mx.array:
        """ids, mask (1 = real token), type_ids: (B, L) → hidden states (B, L, D), 0 at padding."""
        if type_ids is None or self.cfg.is_roberta:
            type_ids = mx.zeros_like(ids)
        packing = Packing(mask)
        flat = packing.pack
        h = self.embeddings(
            flat(ids.reshape(-1)),
            flat(type_ids.reshape(-1)),
            flat(self.positions(mask).reshape(-1)),
        )
        additive = mx.where(mask[:, None, None, :].astype(mx.bool_), 0.0, -1e9).astype(h.dtype)
        for layer in self.layers:
            h = layer(h, additive, packing)
        return packing.pad(h).reshape(*packing.shape, -1)

    def classify(self, ids: mx.array, mask: mx.array, type_ids: mx.array | None = None) -> mx.array:
        """Classification logits (B, num_labels)."""
        h = self(ids, mask, type_ids)
        if self.cfg.is_roberta:
            return self.classifier(h)
        return self.classifier(self.pooler(h))


# ----- checkpoint names ----------------------------------------------------------------
_PREFIXES = ("bert.", "roberta.", "xlm_roberta.", "camembert.", "model.")
_RENAMES = (
    (r"\.LayerNorm\.gamma$", ".LayerNorm.weight"),
    (r"\.LayerNorm\.beta$", ".LayerNorm.bias"),
    (r"^embeddings\.LayerNorm\.", "embeddings.norm."),
    (r"^encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\.", r"layers.\1.attn.\2."),
    (r"^encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"layers.\1.attn.out."),
    (r"^encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.", r"layers.\1.attn_norm."),
    (r"^encoder\.layer\.(\d+)\.intermediate\.dense\.", r"layers.\1.ffn_in."),
    (r"^encoder\.layer\.(\d+)\.output\.dense\.", r"layers.\1.ffn_out."),
    (r"^encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"layers.\1.ffn_norm."),
)
# Weights a checkpoint may carry that no encoder or head here uses.
_UNUSED = re.compile(r"(^|\.)position_ids$|^(cls|lm_head|qa_outputs)\.|^pooler\.")


def hf_key(name: str, *, keep_pooler: bool) -> str | None:
    """A Hugging Face weight name → our module path, or None for weights we do not use."""
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    if _UNUSED.search(name) and not (keep_pooler and name.startswith("pooler.")):
        return None
    for pattern, repl in _RENAMES:
        name = re.sub(pattern, repl, name)
    return name
