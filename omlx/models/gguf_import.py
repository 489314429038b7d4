"""Import a GGUF file (llama.cpp's format) as an MLX model folder.

The result is a folder that ``mlx_lm.load`` loads directly:

* ``config.json`` -- Hugging Face style config (llama / qwen2 / qwen3) with an MLX
  ``quantization`` section when some weights stay quantized;
* ``model.safetensors`` -- the weights under Hugging Face names (sharded into
  ``model-0000N-of-0000M.safetensors`` + index only for very large models);
* ``tokenizer.json`` -- rebuilt with the ``tokenizers`` package from the GGUF vocabulary;
* ``tokenizer_config.json``, ``special_tokens_map.json``, ``generation_config.json``.

Weights
-------
* ``F32``/``F16``/``BF16`` tensors keep their dtype (``F64`` becomes float32).
* ``Q4_0``, ``Q4_1`` and ``Q8_0`` map exactly onto MLX affine quantization with group
  size 32 (Q4_0: scale ``d``, bias ``-8d``; Q4_1: scale ``d``, bias ``m``; Q8_0: unsigned
  codes ``q+128``, scale ``d``, bias ``-128d``), so they stay quantized, bit-exact.
* Every other type the ``gguf`` package can dequantize (Q4_K, Q5_K, Q6_K, Q2_K, Q3_K,
  Q5_0, Q5_1, IQ*, ...) is dequantized in numpy and stored as float16 (bfloat16 when a
  value would overflow float16).
* ``q_bits`` (4 or 8) re-quantizes every weight matrix that is *not* already natively
  quantized (dequantized K-quants and float matrices) with ``mx.quantize`` (group 64, or
  32 when the row length needs it).  Natively quantized Q4_0/Q4_1/Q8_0 tensors are kept
  as they are: re-quantizing them would only lose precision.

llama.cpp permutes the rows of the Q and K projections of *llama* models (its rotary
embedding works on interleaved pairs, Hugging Face's on halves); the importer undoes
that so the weights match the Hugging Face layout mlx-lm expects.  qwen2/qwen3 GGUF files
are not permuted.  The permutation is row-wise, so it is applied to packed quantized
rows, scales and biases alike.

Reading the file is in :mod:`omlx.models.gguf_reader`, the tokenizer rebuild in
:mod:`omlx.models.gguf_tokenizer`; this module converts the weights and writes the folder.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from omlx.models.gguf_reader import GGUFImportError, need, open_reader, read_gguf_metadata
from omlx.models.gguf_tokenizer import SUPPORTED_PRE_TOKENIZERS, build_tokenizer

__all__ = [
    "GGUFImportError",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_PRE_TOKENIZERS",
    "import_gguf",
    "read_gguf_metadata",
]

ProgressFn = Callable[[str, float], None]

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    # GGUF general.architecture -> (mlx-lm model_type)
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
}

_HF_ARCH_NAMES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# Architectures whose GGUF converter permutes the rows of attn_q / attn_k.
_PERMUTED_QK = {"llama"}

_SHARD_BYTES = 4 << 30  # split the weights above 4 GiB


_LAYER_TENSORS: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Modules whose weight is a matrix that MLX can quantize (Linear / Embedding).
_QUANTIZABLE_SUFFIXES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "embed_tokens",
    "lm_head",
)
_BLK_RE = re.compile(r"^blk\.(\d+)\.([A-Za-z0-9_]+)\.(weight|bias)$")


# --------------------------------------------------------------------------- tensors


def _split_blocks(data: np.ndarray, block_bytes: int) -> np.ndarray:
    """(…, row_bytes) uint8 -> (rows, n_blocks, block_bytes)."""
    rows = int(np.prod(data.shape[:-1])) if data.ndim > 1 else 1
    return np.ascontiguousarray(data).reshape(rows, -1, block_bytes)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Values 0..15 in order along the last axis -> MLX 4-bit packing (uint8 pairs)."""
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def _native_quant(data: np.ndarray, qtype, shape: tuple[int, ...]):
    """Q4_0 / Q4_1 / Q8_0 raw blocks -> (uint32 weight, f16 scales, f16 biases), group 32."""
    from gguf import GGMLQuantizationType as T

    lead, cols = shape[:-1], shape[-1]
    if qtype == T.Q4_0:
        blocks = _split_blocks(data, 18)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
        qs = blocks[..., 2:18]
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
        packed = _pack_nibbles(codes)
        scales, biases = d, (d.astype(np.float32) * -8.0).astype(np.float16)
    elif qtype == T.Q4_1:
        blocks = _split_blocks(data, 20)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
        qs = blocks[..., 4:20]
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
        packed = _pack_nibbles(codes)
        scales, biases = d, m
    elif qtype == T.Q8_0:
        blocks = _split_blocks(data, 34)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
        packed = blocks[..., 2:34] ^ np.uint8(0x80)  # signed int8 -> unsigned (q + 128)
        scales, biases = d, (d.astype(np.float32) * -128.0).astype(np.float16)
    else:  # pragma: no cover - guarded by the caller
        raise AssertionError(qtype)
    rows = packed.shape[0]
    weight = np.ascontiguousarray(packed).reshape(rows, -1).view(np.uint32)
    n_groups = cols // 32
    return (
        weight.reshape(*lead, -1) if lead else weight.reshape(-1),
        np.ascontiguousarray(scales).reshape(*lead, n_groups),
        np.ascontiguousarray(biases).reshape(*lead, n_groups),
    )


_DEQUANT_OK: dict[int, bool] = {}


def _can_dequantize(qtype) -> bool:
    import gguf

    if int(qtype) not in _DEQUANT_OK:
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        try:
            gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
            _DEQUANT_OK[int(qtype)] = True
        except Exception:
            _DEQUANT_OK[int(qtype)] = False
    return _DEQUANT_OK[int(qtype)]


def _check_tensor_type(tensor) -> None:
    from gguf import GGMLQuantizationType as T

    t = tensor.tensor_type
    if t in (T.F32, T.F16, T.BF16, T.F64, T.Q4_0, T.Q4_1, T.Q8_0):
        return
    if t in (T.I8, T.I16, T.I32, T.I64):
        raise GGUFImportError(
            f"tensor {tensor.name!r} has integer type {t.name}, which is not a weight format "
            "this importer understands."
        )
    if not _can_dequantize(t):
        raise GGUFImportError(
            f"tensor {tensor.name!r} uses GGML type {t.name}, which neither MLX nor the "
            "installed 'gguf' package can decode. Use a GGUF build of the model with a "
            "common type (F16, BF16, Q8_0, Q4_0, Q4_1 or a K-quant such as Q4_K_M), or "
            "upgrade the 'gguf' package."
        )


def _to_float_mx(arr: np.ndarray):
    """float32 numpy -> float16 mx.array (bfloat16 when float16 would overflow)."""
    import mlx.core as mx

    finite_max = float(np.max(np.abs(arr))) if arr.size else 0.0
    if finite_max > 65000.0:
        return mx.array(arr).astype(mx.bfloat16)
    return mx.array(arr.astype(np.float16))


def _convert_tensor(tensor, requantize: tuple[int, int] | None, keep_native: bool):
    """Return ({"weight": mx.array, plus "scales"/"biases" if quantized}, quant info).

    ``keep_native``: the tensor is the weight matrix of a Linear/Embedding, so Q4_0/Q4_1/
    Q8_0 data may stay quantized; anything else is decoded to floats.
    """
    import gguf
    import mlx.core as mx
    from gguf import GGMLQuantizationType as T

    t = tensor.tensor_type
    shape = tuple(int(x) for x in reversed(tensor.shape.tolist()))
    data = tensor.data
    if keep_native and len(shape) == 2 and t in (T.Q4_0, T.Q4_1, T.Q8_0):
        w, s, b = _native_quant(data, t, shape)
        bits = 8 if t == T.Q8_0 else 4
        return (
            {"weight": mx.array(w), "scales": mx.array(s), "biases": mx.array(b)},
            {"bits": bits, "group_size": 32, "native": True},
        )
    if t == T.F32:
        arr = mx.array(np.ascontiguousarray(data).reshape(shape))
    elif t == T.F16:
        arr = mx.array(np.ascontiguousarray(data).reshape(shape))
    elif t == T.F64:
        arr = mx.array(np.ascontiguousarray(data).reshape(shape).astype(np.float32))
    elif t == T.BF16:
        raw = np.ascontiguousarray(data).view(np.uint16).reshape(shape)
        arr = mx.array(raw).view(mx.bfloat16)
    else:
        deq = gguf.quants.dequantize(data, t)
        arr = _to_float_mx(np.asarray(deq, dtype=np.float32).reshape(shape))
    if requantize is not None and arr.ndim == 2:
        bits, group = requantize
        wq, scales, biases = mx.quantize(arr, group_size=group, bits=bits)
        return (
            {"weight": wq, "scales": scales, "biases": biases},
            {"bits": bits, "group_size": group, "native": False},
        )
    return {"weight": arr}, None


def _unpermute_rows(x, n_heads: int):
    """Undo llama.cpp's Q/K row permutation (rows grouped per head, pairs interleaved)."""
    rows = x.shape[0]
    if rows % (2 * n_heads):
        raise GGUFImportError(
            f"cannot undo the Q/K permutation: {rows} rows do not split into {n_heads} "
            "heads of even size; the head counts in the metadata do not match the tensors."
        )
    return x.reshape(n_heads, rows // n_heads // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _hf_name(gguf_name: str) -> str | None:
    """GGUF tensor name -> HF module path + param ('...weight'), or None if unknown."""
    m = _BLK_RE.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        target = _LAYER_TENSORS.get(part)
        return f"model.layers.{layer}.{target}.{kind}" if target else None
    base, _, kind = gguf_name.rpartition(".")
    if kind in ("weight", "bias") and base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{kind}"
    return None


# --------------------------------------------------------------------------- config


def _llama3_rope_scaling(rope_freqs: np.ndarray, head_dim: int, base: float) -> dict[str, Any]:
    """Recover Llama-3 rope scaling parameters from llama.cpp's rope_freqs tensor."""
    factors = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    if np.allclose(factors, 1.0):
        return {}
    factor = float(factors.max())
    for orig in (8192, 4096, 16384, 32768, 2048):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0)):
            wavelen = 2 * math.pi * base ** (np.arange(0, head_dim, 2) / head_dim)
            low_wl, high_wl = orig / low, orig / high
            smooth = (orig / wavelen - low) / (high - low)
            expected = np.where(
                wavelen < high_wl,
                1.0,
                np.where(wavelen > low_wl, factor, 1.0 / ((1 - smooth) / factor + smooth)),
            )
            if expected.shape == factors.shape and np.allclose(expected, factors, rtol=1e-3):
                return {
                    "rope_type": "llama3",
                    "factor": factor,
                    "low_freq_factor": low,
                    "high_freq_factor": high,
                    "original_max_position_embeddings": orig,
                }
    raise GGUFImportError(
        "the file carries per-frequency RoPE factors (rope_freqs) that do not follow the "
        "Llama 3 scaling rule, so mlx-lm cannot reproduce them."
    )


def _build_config(
    arch: str,
    meta: dict[str, Any],
    tensors: dict[str, Any],
    vocab_size: int,
    tie: bool,
) -> dict[str, Any]:
    p = arch + "."
    hidden = int(need(meta, p + "embedding_length"))
    n_heads = int(need(meta, p + "attention.head_count"))
    n_kv = meta.get(p + "attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):  # per-layer head counts (not for these architectures)
        if len(set(n_kv)) != 1:
            raise GGUFImportError("per-layer KV head counts are not supported.")
        n_kv = n_kv[0]
    n_kv = int(n_kv)
    head_dim = int(meta.get(p + "attention.key_length") or hidden // n_heads)
    value_dim = int(meta.get(p + "attention.value_length") or head_dim)
    if value_dim != head_dim:
        raise GGUFImportError("attention key and value head sizes differ; not supported.")
    rope_dims = int(meta.get(p + "rope.dimension_count") or head_dim)
    if rope_dims != head_dim:
        raise GGUFImportError(
            f"partial rotary embeddings ({rope_dims} of {head_dim} dims) are not supported "
            f"for {arch}."
        )
    ffn = need(meta, p + "feed_forward_length")
    if isinstance(ffn, list):
        if len(set(ffn)) != 1:
            raise GGUFImportError("per-layer feed-forward sizes are not supported.")
        ffn = ffn[0]
    rope_theta = float(meta.get(p + "rope.freq_base") or 10000.0)
    config: dict[str, Any] = {
        "architectures": [_HF_ARCH_NAMES[arch]],
        "model_type": SUPPORTED_ARCHITECTURES[arch],
        "hidden_size": hidden,
        "intermediate_size": int(ffn),
        "num_hidden_layers": int(need(meta, p + "block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": float(meta.get(p + "attention.layer_norm_rms_epsilon") or 1e-6),
        "vocab_size": vocab_size,
        "max_position_embeddings": int(meta.get(p + "context_length") or 4096),
        "rope_theta": rope_theta,
        "tie_word_embeddings": tie,
    }
    if arch == "llama":
        config["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in tensors
        config["mlp_bias"] = "model.layers.0.mlp.gate_proj.bias" in tensors
    # RoPE scaling
    scaling_type = meta.get(p + "rope.scaling.type")
    factor = meta.get(p + "rope.scaling.factor")
    if scaling_type in (None, "none") and factor and float(factor) != 1.0 and arch == "llama":
        scaling_type = "linear"  # old files only store the factor
    if scaling_type == "linear" and factor and float(factor) != 1.0:
        config["rope_scaling"] = {"type": "linear", "factor": float(factor)}
    elif scaling_type == "yarn":
        config["rope_scaling"] = {
            "type": "yarn",
            "factor": float(factor or 1.0),
            "original_max_position_embeddings": int(
                meta.get(p + "rope.scaling.original_context_length")
                or config["max_position_embeddings"]
            ),
        }
    elif scaling_type not in (None, "none", "linear"):
        raise GGUFImportError(f"RoPE scaling type {scaling_type!r} is not supported.")
    return config


# --------------------------------------------------------------------------- writing


def _save_weights(out_dir: Path, weights: dict[str, Any], progress: ProgressFn) -> None:
    import mlx.core as mx

    for old in out_dir.glob("model*.safetensors"):
        old.unlink()
    index = out_dir / "model.safetensors.index.json"
    if index.exists():
        index.unlink()
    total = sum(v.nbytes for v in weights.values())
    names = sorted(weights)
    if total <= _SHARD_BYTES:
        progress("writing", 0.0)
        mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
        progress("writing", 1.0)
        return
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = weights[name].nbytes
        if shards[-1] and size + nbytes > _SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(
            str(out_dir / fname), {k: weights[k] for k in shard}, metadata={"format": "mlx"}
        )
        weight_map.update(dict.fromkeys(shard, fname))
        progress("writing", i / len(shards))
    index.write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------- main entry


def import_gguf(
    gguf_path: Path,
    out_dir: Path,
    *,
    q_bits: int | None = None,
    progress: ProgressFn | None = None,
) -> Path:
    """Convert *gguf_path* into an MLX model folder at *out_dir*; return *out_dir*.

    ``q_bits`` (4 or 8) quantizes the weight matrices that are not already natively
    quantized in the file (see the module docstring).  ``progress(stage, fraction)`` is
    called with stages ``"reading"``, ``"tensors"``, ``"tokenizer"``, ``"writing"`` and
    ``"done"`` and fractions in ``[0, 1]``.
    """
    import mlx.core as mx

    report: ProgressFn = progress or (lambda stage, fraction: None)
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    if q_bits not in (None, 4, 8):
        raise GGUFImportError(f"q_bits must be 4, 8 or None, not {q_bits!r}.")

    report("reading", 0.0)
    reader = open_reader(gguf_path)
    meta = read_gguf_metadata(reader)
    report("reading", 1.0)

    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFImportError(
            f"unsupported GGUF architecture {arch!r}. Supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}. mlx-lm needs a matching model class and "
            "this importer's tensor-name map (GGUF -> Hugging Face names) covers only these; "
            "for other models use an MLX or Hugging Face safetensors build instead."
        )

    # Validate names and types before any heavy work.
    by_name: dict[str, Any] = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        hf = _hf_name(t.name)
        if hf is None:
            raise GGUFImportError(
                f"tensor {t.name!r} has no Hugging Face counterpart in the {arch} name map; "
                "the file is not a standard llama.cpp conversion of this architecture."
            )
        _check_tensor_type(t)
        by_name[hf] = t
    if "model.embed_tokens.weight" not in by_name:
        raise GGUFImportError("the file has no token_embd.weight tensor; it is incomplete.")

    p = arch + "."
    n_heads = int(need(meta, p + "attention.head_count"))
    n_kv = meta.get(p + "attention.head_count_kv", n_heads)
    n_kv = int(n_kv[0] if isinstance(n_kv, list) else n_kv)
    n_layers = int(need(meta, p + "block_count"))
    tie = "lm_head.weight" not in by_name

    # The row count of token_embd is the real vocabulary size of the model.
    emb = by_name["model.embed_tokens.weight"]
    vocab_size = int(emb.shape.tolist()[-1]) if len(emb.shape) > 1 else int(emb.shape[0])

    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    per_layer = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ]
    if arch == "qwen2":
        per_layer += [f"self_attn.{x}_proj.bias" for x in "qkv"]
    if arch == "qwen3":
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    for i in range(n_layers):
        expected.update(f"model.layers.{i}.{x}" for x in per_layer)
    missing = sorted(expected - set(by_name))
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise GGUFImportError(
            f"the file lacks {len(missing)} tensor(s) a {arch} model needs ({shown}); it is "
            "incomplete or not a standard conversion."
        )
    extra_layers = {
        int(m.group(1))
        for m in (re.match(r"model\.layers\.(\d+)\.", k) for k in by_name)
        if m and int(m.group(1)) >= n_layers
    }
    if extra_layers:
        raise GGUFImportError(
            f"the file has tensors for layer {min(extra_layers)} but declares {n_layers} layers."
        )

    config = _build_config(arch, meta, by_name, vocab_size, tie)
    rope_tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_tensor is not None:
        from gguf import GGMLQuantizationType as T

        if rope_tensor.tensor_type != T.F32:
            raise GGUFImportError("rope_freqs.weight must be F32.")
        scaling = _llama3_rope_scaling(
            np.asarray(rope_tensor.data), config["head_dim"], config["rope_theta"]
        )
        if scaling:
            config["rope_scaling"] = scaling

    # Tokenizer first: it is cheap and fails fast on unsupported vocabularies.
    report("tokenizer", 0.0)
    tokenizer, tok_config, special_map, ids = build_tokenizer(meta)
    report("tokenizer", 1.0)

    # Convert the tensors.
    weights: dict[str, Any] = {}
    quant_info: dict[str, dict[str, int]] = {}
    float_dtypes: Counter[str] = Counter()
    names = list(by_name)
    report("tensors", 0.0)
    for n, hf in enumerate(names):
        tensor = by_name[hf]
        module, _, kind = hf.rpartition(".")
        requant = None
        matrix = (
            kind == "weight"
            and module.endswith(_QUANTIZABLE_SUFFIXES)
            and len(tensor.shape.tolist()) == 2
        )
        if q_bits is not None and matrix:
            cols = int(tensor.shape.tolist()[0])
            group = 64 if cols % 64 == 0 else (32 if cols % 32 == 0 else None)
            requant = (q_bits, group) if group else None
        try:
            parts, qinfo = _convert_tensor(tensor, requant, keep_native=matrix)
        except GGUFImportError:
            raise
        except Exception as exc:
            raise GGUFImportError(
                f"tensor {tensor.name!r} ({tensor.tensor_type.name}) could not be decoded: "
                f"{exc}. The file may be corrupt; download it again."
            ) from exc
        if qinfo is not None:
            quant_info[module] = {"group_size": qinfo["group_size"], "bits": qinfo["bits"]}
        if arch in _PERMUTED_QK and module.endswith(("self_attn.q_proj", "self_attn.k_proj")):
            heads = n_heads if module.endswith("q_proj") else n_kv
            parts = {k: _unpermute_rows(v, heads) for k, v in parts.items()}
        if kind == "bias":
            weights[hf] = parts["weight"]
        else:
            for k, v in parts.items():
                weights[f"{module}.{k}"] = v
        if qinfo is None and parts["weight"].ndim == 2:
            float_dtypes[str(parts["weight"].dtype).split(".")[-1]] += 1
        report("tensors", (n + 1) / len(names))
    mx.eval(list(weights.values()))

    # Quantization section: most common (group, bits) as default, others per module.
    if quant_info:
        common = Counter((q["group_size"], q["bits"]) for q in quant_info.values())
        (g, b), _ = common.most_common(1)[0]
        quant: dict[str, Any] = {"group_size": g, "bits": b, "mode": "affine"}
        for module, q in sorted(quant_info.items()):
            if (q["group_size"], q["bits"]) != (g, b):
                quant[module] = {"group_size": q["group_size"], "bits": q["bits"], "mode": "affine"}
        config["quantization"] = quant
        config["quantization_config"] = dict(quant)
    if float_dtypes:
        dtype = float_dtypes.most_common(1)[0][0]
    elif quant_info:
        dtype = "float16"  # GGUF block scales are float16
    else:
        dtype = "float32"
    config["torch_dtype"] = dtype
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if ids.get(key) is not None:
            config[key] = ids[key]

    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        _save_weights(out_dir, weights, report)
        del weights
        tokenizer.save(str(out_dir / "tokenizer.json"))
        _write_json(out_dir / "tokenizer_config.json", tok_config)
        _write_json(out_dir / "special_tokens_map.json", special_map)
        gen = {k: v for k, v in ids.items() if v is not None}
        _write_json(out_dir / "generation_config.json", gen)
        # config.json last: a folder without it is not mistaken for a finished model.
        _write_json(out_dir / "config.json", config)
        # Make sure everything is on disk before a caller renames the folder into place.
        for f in out_dir.iterdir():
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
    except BaseException:
        if created:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    report("done", 1.0)
    return out_dir
