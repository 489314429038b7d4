"""Load an embedding model or a cross-encoder reranker from a Hugging Face folder.

Handles the sentence-transformers layout (`modules.json`: Transformer → Pooling →
optional Dense → optional Normalize; `1_Pooling/config.json`; `sentence_bert_config.json`
for the maximum sequence length) and plain `*Model` / `*ForSequenceClassification`
folders. Encoders run on `omlx.models.encoder`; a decoder-only embedding model (a
sentence-transformers folder around a causal LM, usually with last-token pooling) runs
on mlx-lm's model with right padding, which a causal mask makes harmless.

Everything here that touches MLX runs on the engine thread; tokenization does not and
may run anywhere.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from tokenizers import Tokenizer

from omlx.errors import InvalidRequestError
from omlx.models.discovery import ModelInfo
from omlx.models.encoder import (
    SUPPORTED_TYPES,
    Encoder,
    EncoderConfig,
    UnsupportedModelError,
    hf_key,
)
from omlx.models.loader import DTYPES, resolve_compute_dtype

log = logging.getLogger("omlx.models")

# sentence-transformers' pooling flags, in the order it concatenates their outputs.
POOLING_FLAGS = (
    ("pooling_mode_cls_token", "cls"),
    ("pooling_mode_max_tokens", "max"),
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len"),
    ("pooling_mode_weightedmean_tokens", "weightedmean"),
    ("pooling_mode_lasttoken", "lasttoken"),
)
POOLING_MODES = {"cls", "max", "mean", "mean_sqrt_len", "lasttoken"}
DENSE_ACTIVATIONS = {
    "Tanh": mx.tanh,
    "Identity": lambda x: x,
    "ReLU": nn.relu,
    "GELU": nn.gelu,
    "Sigmoid": mx.sigmoid,
}


@dataclass
class Encoded:
    """One tokenized input: token ids and (BERT) segment ids."""

    ids: list[int]
    type_ids: list[int] | None = None


@dataclass
class DenseLayer:
    weight: mx.array
    bias: mx.array | None
    activation: Any

    def __call__(self, x: mx.array) -> mx.array:
        y = x @ self.weight.T
        if self.bias is not None:
            y = y + self.bias
        return self.activation(y)


@dataclass
class SentenceConfig:
    """What a sentence-transformers folder says about pooling and post-processing."""

    pooling: tuple[str, ...] = ("mean",)
    dense_dirs: list[Path] = field(default_factory=list)
    normalize: bool = False
    max_seq_length: int | None = None


def read_sentence_config(path: Path, model_id: str) -> SentenceConfig:
    sc = SentenceConfig()
    st_cfg = _read_json(path / "sentence_bert_config.json")
    if isinstance(st_cfg.get("max_seq_length"), int):
        sc.max_seq_length = st_cfg["max_seq_length"]
    modules_path = path / "modules.json"
    if not modules_path.exists():
        return sc  # a plain model: sentence-transformers' own fallback is mean pooling
    for module in json.loads(modules_path.read_text()):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        sub = path / module.get("path", "")
        if kind == "Transformer":
            cfg = _read_json(sub / "sentence_bert_config.json") if module.get("path") else {}
            if isinstance(cfg.get("max_seq_length"), int):
                sc.max_seq_length = cfg["max_seq_length"]
        elif kind == "Pooling":
            cfg = _read_json(sub / "config.json")
            if "pooling_mode" in cfg and not any(flag in cfg for flag, _ in POOLING_FLAGS):
                modes = (str(cfg["pooling_mode"]).replace("mean_sqrt_len_tokens", "mean_sqrt_len"),)
            else:
                modes = tuple(mode for flag, mode in POOLING_FLAGS if cfg.get(flag))
            unknown = [m for m in modes if m not in POOLING_MODES]
            if not modes or unknown:
                raise UnsupportedModelError(
                    f"Model '{model_id}' uses pooling {', '.join(unknown) or '(none)'}; supported: "
                    f"{', '.join(sorted(POOLING_MODES))}."
                )
            sc.pooling = modes
        elif kind == "Dense":
            sc.dense_dirs.append(sub)
        elif kind == "Normalize":
            sc.normalize = True
        else:
            raise UnsupportedModelError(
                f"Model '{model_id}' has a sentence-transformers module '{module.get('type')}', "
                "which oMLX cannot run; supported: Transformer, Pooling, Dense, Normalize."
            )
    return sc


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _load_dense(path: Path, model_id: str) -> DenseLayer:
    cfg = _read_json(path / "config.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(
            f"Model '{model_id}': the Dense module in {path.name}/ has no safetensors weights."
        )
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(mx.load(str(f)))
    act_name = str(cfg.get("activation_function", "torch.nn.modules.linear.Identity")).rsplit(
        ".", 1
    )[-1]
    if act_name not in DENSE_ACTIVATIONS:
        raise UnsupportedModelError(
            f"Model '{model_id}': Dense activation '{act_name}' is not supported."
        )
    return DenseLayer(
        weights["linear.weight"], weights.get("linear.bias"), DENSE_ACTIVATIONS[act_name]
    )


# ----- tokenizer ------------------------------------------------------------------------
def load_tokenizer(path: Path, model_id: str) -> tuple[Tokenizer, int | None]:
    """The folder's fast tokenizer with its own truncation and padding turned off."""
    tok_cfg = _read_json(path / "tokenizer_config.json")
    if (path / "tokenizer.json").exists():
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    else:
        from transformers import AutoTokenizer

        backend = getattr(AutoTokenizer.from_pretrained(str(path)), "backend_tokenizer", None)
        if backend is None:
            raise UnsupportedModelError(
                f"Model '{model_id}' has no fast tokenizer (tokenizer.json)."
            )
        tok = Tokenizer.from_str(backend.to_str())
    tok.no_truncation()
    tok.no_padding()
    max_len = tok_cfg.get("model_max_length")
    return tok, (int(max_len) if isinstance(max_len, int | float) and max_len < 1e7 else None)


def _pad_id(tok: Tokenizer, path: Path, fallback: int) -> int:
    cfg = _read_json(path / "tokenizer_config.json")
    pad = cfg.get("pad_token")
    if isinstance(pad, dict):
        pad = pad.get("content")
    if isinstance(pad, str) and tok.token_to_id(pad) is not None:
        return int(tok.token_to_id(pad))
    return fallback


# ----- the loaded model -----------------------------------------------------------------
@dataclass
class LoadedEncoder:
    info: ModelInfo
    kind: str  # "embedding" | "reranker"
    model: Any
    tokenizer: Tokenizer
    max_length: int
    pad_id: int
    vocab_size: int
    pooling: tuple[str, ...] = ("mean",)
    dense: list[DenseLayer] = field(default_factory=list)
    normalize: bool = False
    dimensions: int = 0
    num_labels: int = 0
    decoder: bool = False  # a causal LM under sentence-transformers pooling
    pair_tokenizer: Tokenizer | None = None

    # tokenization: thread-safe, no MLX
    def encode(self, texts: list[str]) -> list[Encoded]:
        return [Encoded(list(e.ids), list(e.type_ids)) for e in self.tokenizer.encode_batch(texts)]

    def encode_with_specials(self, texts: list[str]) -> list[tuple[Encoded, list[int]]]:
        return [
            (Encoded(list(e.ids), list(e.type_ids)), list(e.special_tokens_mask))
            for e in self.tokenizer.encode_batch(texts)
        ]

    def encode_pairs(self, query: str, docs: list[str]) -> list[Encoded]:
        """(query, document) pairs, the longer side cut until each fits `max_length`."""
        tok = self.pair_tokenizer or self.tokenizer
        try:
            encs = tok.encode_batch([(query, d) for d in docs])
        except Exception as exc:  # tokenizers raises a plain Exception when truncation cannot fit
            raise InvalidRequestError(
                f"The query is too long for this reranker ({self.max_length} tokens at most): {exc}",
                param="query",
            ) from None
        return [Encoded(list(e.ids), list(e.type_ids)) for e in encs]

    # MLX: engine thread only
    def hidden(self, batch: list[Encoded]) -> tuple[mx.array, mx.array]:
        ids, mask, types = collate(batch, self.pad_id)
        if self.decoder:
            return self.model.model(ids), mask
        return self.model(ids, mask, types), mask

    def embed(self, batch: list[Encoded]) -> mx.array:
        """(B, dimensions) float32 sentence embeddings."""
        h, mask = self.hidden(batch)
        x = pool(h.astype(mx.float32), mask, self.pooling)
        for layer in self.dense:
            x = layer(x.astype(layer.weight.dtype)).astype(mx.float32)
        if self.normalize:
            x = l2_normalize(x)
        return x

    def logits(self, batch: list[Encoded]) -> mx.array:
        ids, mask, types = collate(batch, self.pad_id)
        return self.model.classify(ids, mask, types).astype(mx.float32)

    def score(self, batch: list[Encoded]) -> mx.array:
        """(B,) relevance in 0..1: sigmoid of a single logit, or P(label 1) of two."""
        logits = self.logits(batch)
        if self.num_labels == 1:
            return mx.sigmoid(logits[:, 0])
        return mx.softmax(logits, axis=-1)[:, 1]


def collate(batch: list[Encoded], pad_id: int) -> tuple[mx.array, mx.array, mx.array]:
    """Right-pad to the batch's longest: ids, mask (1 = real), type ids."""
    longest = max(len(e.ids) for e in batch)
    ids, mask, types = [], [], []
    for e in batch:
        n = len(e.ids)
        ids.append(e.ids + [pad_id] * (longest - n))
        mask.append([1] * n + [0] * (longest - n))
        types.append((e.type_ids or [0] * n) + [0] * (longest - n))
    return (
        mx.array(ids, dtype=mx.int32),
        mx.array(mask, dtype=mx.int32),
        mx.array(types, dtype=mx.int32),
    )


def pool(h: mx.array, mask: mx.array, modes: tuple[str, ...]) -> mx.array:
    """sentence-transformers pooling over right-padded hidden states; several modes concatenate."""
    m = mask.astype(h.dtype)[..., None]
    count = mx.maximum(m.sum(axis=1), 1e-9)
    out = []
    for mode in modes:
        if mode == "cls":
            out.append(h[:, 0])
        elif mode == "max":
            out.append(mx.where(m > 0, h, -1e9).max(axis=1))
        elif mode == "mean":
            out.append((h * m).sum(axis=1) / count)
        elif mode == "mean_sqrt_len":
            out.append((h * m).sum(axis=1) / mx.sqrt(count))
        elif mode == "lasttoken":
            last = mask.sum(axis=1) - 1
            out.append(mx.take_along_axis(h, last[:, None, None].astype(mx.int32), axis=1)[:, 0])
    return out[0] if len(out) == 1 else mx.concatenate(out, axis=-1)


def l2_normalize(x: mx.array) -> mx.array:
    return x / mx.maximum(mx.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def _cast(model: nn.Module, compute_dtype: str) -> None:
    dtype = resolve_compute_dtype(compute_dtype)
    if dtype in DTYPES:
        model.set_dtype(DTYPES[dtype])


def _load_weights(model: Encoder, path: Path, model_id: str, keep_pooler: bool) -> None:
    files = sorted(path.glob("*.safetensors"))
    weights: dict[str, mx.array] = {}
    heads = model.cfg.num_labels > 0  # a classifier embedded as a plain encoder drops its head
    for f in files:
        for name, value in mx.load(str(f)).items():
            key = hf_key(name, keep_pooler=keep_pooler)
            if key is not None and (heads or not key.startswith("classifier.")):
                weights[key] = value
    expected = {k for k, _ in tree_flatten(model.parameters())}
    missing = sorted(expected - set(weights))
    extra = sorted(set(weights) - expected)
    if missing or extra:
        detail = []
        if missing:
            detail.append(f"missing {', '.join(missing[:5])}{' …' if len(missing) > 5 else ''}")
        if extra:
            detail.append(f"unexpected {', '.join(extra[:5])}{' …' if len(extra) > 5 else ''}")
        raise UnsupportedModelError(
            f"Model '{model_id}': its weights do not match a {model.cfg.model_type} encoder ({'; '.join(detail)})."
        )
    model.load_weights(list(weights.items()))


def load_encoder(info: ModelInfo, kind: str, compute_dtype: str = "auto") -> LoadedEncoder:
    """Load weights, tokenizer and sentence-transformers settings (MLX: the engine thread)."""
    path, model_id = info.path, info.id
    tok, tok_max = load_tokenizer(path, model_id)
    if kind == "embedding" and info.config.get("model_type") not in SUPPORTED_TYPES:
        return _load_decoder_embedder(info, tok, tok_max, compute_dtype)
    cfg = EncoderConfig.from_dict(info.config, model_id)
    if kind == "reranker" and cfg.num_labels not in (1, 2):
        raise UnsupportedModelError(
            f"Model '{model_id}' classifies into {cfg.num_labels} labels; a reranker needs 1 (a relevance "
            "logit) or 2 (not relevant / relevant)."
        )
    if kind == "embedding":
        cfg.num_labels = 0  # embed with the encoder; a classifier head, if any, is unused
    model = Encoder(cfg)
    _load_weights(model, path, model_id, keep_pooler=bool(cfg.num_labels) and not cfg.is_roberta)
    _cast(model, compute_dtype)
    mx.eval(model.parameters())
    limits = [cfg.max_tokens] + [v for v in (tok_max,) if v]
    sc = read_sentence_config(path, model_id) if kind == "embedding" else SentenceConfig()
    if sc.max_seq_length:
        limits.append(sc.max_seq_length)
    loaded = LoadedEncoder(
        info=info,
        kind=kind,
        model=model,
        tokenizer=tok,
        max_length=min(limits),
        pad_id=cfg.pad_token_id,
        vocab_size=cfg.vocab_size,
        num_labels=cfg.num_labels,
    )
    if kind == "reranker":
        pair = Tokenizer.from_str(tok.to_str())
        pair.enable_truncation(loaded.max_length, strategy="longest_first")
        loaded.pair_tokenizer = pair
    else:
        _apply_sentence_config(loaded, sc, cfg.hidden_size)
    return loaded


def _apply_sentence_config(loaded: LoadedEncoder, sc: SentenceConfig, hidden: int) -> None:
    loaded.pooling = sc.pooling
    loaded.normalize = sc.normalize
    loaded.dense = [_load_dense(d, loaded.info.id) for d in sc.dense_dirs]
    loaded.dimensions = (
        loaded.dense[-1].weight.shape[0] if loaded.dense else hidden * len(sc.pooling)
    )


def _load_decoder_embedder(
    info: ModelInfo, tok: Tokenizer, tok_max: int | None, compute_dtype: str
) -> LoadedEncoder:
    """A sentence-transformers folder around a causal LM (e.g. last-token pooling)."""
    if not (info.path / "modules.json").exists():
        raise UnsupportedModelError(
            f"Model '{info.id}' is a '{info.config.get('model_type')}' model without modules.json; "
            f"oMLX embeds with {', '.join(SUPPORTED_TYPES)} encoders or sentence-transformers folders."
        )
    from mlx_lm.utils import load_model

    try:
        model, _ = load_model(info.path)
    except (ValueError, ImportError) as exc:
        raise UnsupportedModelError(
            f"Model '{info.id}' cannot be loaded as an embedding model: {exc}"
        ) from None
    if not callable(getattr(model, "model", None)):
        raise UnsupportedModelError(
            f"Model '{info.id}': its architecture exposes no hidden states to pool."
        )
    _cast(model, compute_dtype)
    mx.eval(model.parameters())
    sc = read_sentence_config(info.path, info.id)
    limits = [v for v in (info.context_length, tok_max, sc.max_seq_length) if v] or [8192]
    hidden = int(info.config.get("hidden_size") or model.model.embed_tokens.weight.shape[1])
    loaded = LoadedEncoder(
        info=info,
        kind="embedding",
        model=model,
        tokenizer=tok,
        max_length=min(limits),
        pad_id=_pad_id(tok, info.path, 0),
        vocab_size=int(info.config.get("vocab_size") or tok.get_vocab_size()),
        decoder=True,
    )
    _apply_sentence_config(loaded, sc, hidden)
    return loaded
