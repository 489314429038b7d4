"""GGUF importer: synthetic GGUF files built at test time with gguf.GGUFWriter."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from omlx.models.gguf_import import GGUFImportError, _llama3_rope_scaling, import_gguf

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2024 and numbers like 12345 matter.",
    "def main():\n    print('hello world')  # greet\n\treturn 0\n",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "Ünïcödé text — “quotes”, émigré, naïve café. Ça va? 東京 tokyo!",
    "we'll they're I'M you've she'd can't won't\r\n   spaced    out   ",
] * 20
SAMPLES = [
    "Hello world! The capital of France is Paris.",
    "Numbers 0123456789 and 3.14159, year 2024.",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "  two  spaces\tand tabs\r\nand newlines\n\n",
    "Ünïcödé — “quotes” 東京 🤖",
]

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 256, 4, 2, 512, 2
HEAD_DIM = HIDDEN // HEADS


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def bpe():
    """A tiny byte-level BPE (SmolLM2-style pre-tokenizer) trained on local text."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    types = [3 if t in SPECIALS else 1 for t in tokens]
    return {"tokenizer": tok, "tokens": tokens, "merges": merges, "types": types}


def _hf_weights(rng, vocab, *, qkv_bias=False, qk_norm=False, tied=True):
    def mat(rows, cols):
        return (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)

    w = {
        "model.embed_tokens.weight": mat(vocab, HIDDEN),
        "model.norm.weight": (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32),
    }
    if not tied:
        w["lm_head.weight"] = mat(vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
        w[p + "post_attention_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(
            np.float32
        )
        w[p + "self_attn.q_proj.weight"] = mat(HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = mat(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = mat(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = mat(HIDDEN, HEADS * HEAD_DIM)
        w[p + "mlp.gate_proj.weight"] = mat(FFN, HIDDEN)
        w[p + "mlp.up_proj.weight"] = mat(FFN, HIDDEN)
        w[p + "mlp.down_proj.weight"] = mat(HIDDEN, FFN)
        if qkv_bias:
            for x, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                w[p + f"self_attn.{x}_proj.bias"] = (
                    rng.standard_normal(rows * HEAD_DIM) * 0.1
                ).astype(np.float32)
        if qk_norm:
            for x in ("q", "k"):
                w[p + f"self_attn.{x}_norm.weight"] = (
                    1 + 0.1 * rng.standard_normal(HEAD_DIM)
                ).astype(np.float32)
    return w


_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        _, _, layer, rest = hf.split(".", 3)
        module, _, kind = rest.rpartition(".")
        return f"blk.{layer}.{_TO_GGUF[module]}.{kind}"
    module, _, kind = hf.rpartition(".")
    return {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}[
        module
    ] + f".{kind}"


def _llamacpp_permute(x: np.ndarray, heads: int) -> np.ndarray:
    """The row order llama.cpp's converter writes for llama Q/K (HF halves -> pairs)."""
    return (
        x.reshape(heads, 2, x.shape[0] // heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)
    )


def _random_q4_k(rng, rows: int, cols: int) -> np.ndarray:
    """Valid Q4_K blocks with random codes (the gguf package cannot quantize to Q4_K)."""
    n = rows * cols // 256
    blocks = rng.integers(0, 256, size=(n, 144), dtype=np.uint8)
    blocks[:, 0:2] = np.full((n, 1), 0.002, np.float16).view(np.uint8)  # d
    blocks[:, 2:4] = np.full((n, 1), 0.001, np.float16).view(np.uint8)  # dmin
    return blocks.reshape(rows, cols // 256 * 144)


def write_gguf(
    path: Path,
    hf: dict[str, np.ndarray],
    bpe: dict,
    *,
    arch: str = "llama",
    types: dict[str, Q] | None = None,
    pre: str = "smollm",
    permute: bool | None = None,
    rng=None,
    add_bos: bool = False,
) -> dict[str, np.ndarray]:
    """Write *hf* weights as GGUF; return the float32 weights a reader of the file sees
    (HF layout, after the quantization round trip), the reference for the import."""
    types = types or {}
    rng = rng or np.random.default_rng(0)
    permute = (arch == "llama") if permute is None else permute
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(HEAD_DIM)
    if arch == "qwen3":
        w.add_key_length(HEAD_DIM)
        w.add_value_length(HEAD_DIM)
    w.add_vocab_size(len(bpe["tokens"]))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(bpe["tokens"])
    w.add_token_types(bpe["types"])
    w.add_token_merges(bpe["merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(CHAT_TEMPLATE)
    seen: dict[str, np.ndarray] = {}
    for name, arr in hf.items():
        data = arr
        if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = _llamacpp_permute(arr, HEADS)
        elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = _llamacpp_permute(arr, KV_HEADS)
        qtype = types.get(name, Q.F32)
        if qtype == Q.F32:
            w.add_tensor(_gguf_name(name), data)
            stored = data
        elif qtype == Q.F16:
            w.add_tensor(_gguf_name(name), data.astype(np.float16))
            stored = data.astype(np.float16).astype(np.float32)
        elif qtype == Q.Q4_K:
            raw = _random_q4_k(rng, *data.shape)
            w.add_tensor(_gguf_name(name), raw, raw_dtype=qtype)
            stored = gguf.quants.dequantize(raw, qtype)
        else:
            raw = gguf.quants.quantize(data, qtype)
            w.add_tensor(_gguf_name(name), raw, raw_dtype=qtype)
            stored = gguf.quants.dequantize(raw, qtype)
        stored = np.asarray(stored, np.float32).reshape(arr.shape)
        if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
            stored = _unpermute(stored, HEADS)
        elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
            stored = _unpermute(stored, KV_HEADS)
        seen[name] = stored
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return seen


def _unpermute(x: np.ndarray, heads: int) -> np.ndarray:
    return (
        x.reshape(heads, x.shape[0] // heads // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)
    )


def _reference_logits(out_dir: Path, weights: dict[str, np.ndarray], tokens: list[int]):
    """Logits of an mlx-lm model built from the imported config and *weights* (float32)."""
    from mlx_lm.utils import _get_classes

    config = json.loads((out_dir / "config.json").read_text())
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()], strict=True)
    return model(mx.array([tokens]))[0].astype(mx.float32)


def _imported_logits(out_dir: Path, tokens: list[int]):
    from mlx_lm import load

    model, _ = load(str(out_dir))
    return model(mx.array([tokens]))[0].astype(mx.float32)


def _rel_err(a, b) -> float:
    return float(mx.max(mx.abs(a - b)).item() / mx.max(mx.abs(b)).item())


TOKENS = [5, 17, 42, 99, 120, 7, 250, 3, 64, 1]


# --------------------------------------------------------------------------- tests


def test_f32_llama_import_loads_and_undoes_qk_permutation(tmp_path, bpe):
    rng = np.random.default_rng(1)
    hf = _hf_weights(rng, len(bpe["tokens"]))
    src = tmp_path / "tiny.gguf"
    write_gguf(src, hf, bpe)
    calls: list[tuple[str, float]] = []
    out = import_gguf(src, tmp_path / "out", progress=lambda s, f: calls.append((s, f)))

    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    ):
        assert (out / name).is_file(), name
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_attention_heads"] == HEADS and config["num_key_value_heads"] == KV_HEADS
    assert config["tie_word_embeddings"] is True
    assert "quantization" not in config

    got = _imported_logits(out, TOKENS)
    want = _reference_logits(out, hf, TOKENS)
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()
    # Sensitivity check: a model that kept llama.cpp's row order gives other logits.
    permuted = dict(hf)
    for i in range(LAYERS):
        q = f"model.layers.{i}.self_attn.q_proj.weight"
        k = f"model.layers.{i}.self_attn.k_proj.weight"
        permuted[q] = _llamacpp_permute(hf[q], HEADS)
        permuted[k] = _llamacpp_permute(hf[k], KV_HEADS)
    wrong = _reference_logits(out, permuted, TOKENS)
    assert _rel_err(wrong, want) > 1e-2

    # progress: each stage goes 0 -> 1, ends with "done"
    stages = [s for s, _ in calls]
    assert stages[-1] == "done" and calls[-1][1] == 1.0
    for stage in ("reading", "tokenizer", "tensors", "writing"):
        fr = [f for s, f in calls if s == stage]
        assert fr and fr == sorted(fr) and fr[-1] == 1.0 and all(0 <= f <= 1 for f in fr)


def test_tokenizer_and_metadata_files(tmp_path, bpe):
    from mlx_lm import load

    src = tmp_path / "tiny.gguf"
    write_gguf(src, _hf_weights(np.random.default_rng(2), len(bpe["tokens"])), bpe)
    out = import_gguf(src, tmp_path / "out")

    rebuilt = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in SAMPLES:
        want = bpe["tokenizer"].encode(text).ids
        assert rebuilt.encode(text).ids == want, text
        assert rebuilt.decode(want, skip_special_tokens=False) == text
    assert rebuilt.encode("<|im_end|>").ids == [2]

    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == CHAT_TEMPLATE
    assert tok_config["bos_token"] == "<|im_start|>" and tok_config["eos_token"] == "<|im_end|>"
    assert json.loads((out / "generation_config.json").read_text()) == {
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }
    assert json.loads((out / "special_tokens_map.json").read_text())["eos_token"] == "<|im_end|>"

    _, tokenizer = load(str(out))
    assert tokenizer.eos_token_id == 2
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi 123"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nHi 123<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.encode(SAMPLES[0]) == bpe["tokenizer"].encode(SAMPLES[0]).ids


def test_quantized_types_native_and_dequantized(tmp_path, bpe):
    rng = np.random.default_rng(3)
    hf = _hf_weights(rng, len(bpe["tokens"]), tied=False)
    types = {"model.embed_tokens.weight": Q.Q8_0, "lm_head.weight": Q.Q6_K}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        types[p + "self_attn.q_proj.weight"] = Q.Q4_0
        types[p + "self_attn.k_proj.weight"] = Q.Q4_1
        types[p + "self_attn.v_proj.weight"] = Q.Q8_0
        types[p + "self_attn.o_proj.weight"] = Q.F16
        types[p + "mlp.gate_proj.weight"] = Q.Q5_0
        types[p + "mlp.up_proj.weight"] = Q.Q4_1
        types[p + "mlp.down_proj.weight"] = Q.Q4_K
    if not _can_quantize(Q.Q6_K):
        types["lm_head.weight"] = Q.Q4_K
    src = tmp_path / "mixed.gguf"
    seen = write_gguf(src, hf, bpe, types=types)
    out = import_gguf(src, tmp_path / "out")

    config = json.loads((out / "config.json").read_text())
    quant = config["quantization"]
    assert config["tie_word_embeddings"] is False
    assert (quant["group_size"], quant["bits"]) == (32, 4)
    assert quant["model.embed_tokens"]["bits"] == 8
    assert quant["model.layers.0.self_attn.v_proj"]["bits"] == 8

    stored = mx.load(str(out / "model.safetensors"))
    # Native types stay quantized and decode exactly to what gguf decodes (after unpermute).
    for name, bits in (
        ("model.layers.0.self_attn.q_proj", 4),
        ("model.layers.1.self_attn.k_proj", 4),
        ("model.layers.0.self_attn.v_proj", 8),
        ("model.embed_tokens", 8),
    ):
        deq = mx.dequantize(
            stored[name + ".weight"],
            stored[name + ".scales"],
            stored[name + ".biases"],
            group_size=32,
            bits=bits,
        ).astype(mx.float32)
        assert np.allclose(np.array(deq), seen[name + ".weight"], atol=1e-3, rtol=1e-3), name
    # K-quants / Q5_0 are dequantized to float16.
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.gate_proj.weight"):
        assert stored[name].dtype == mx.float16
        assert np.allclose(np.array(stored[name].astype(mx.float32)), seen[name], atol=1e-3)
    assert stored["lm_head.weight"].dtype == mx.float16
    assert stored["model.layers.0.self_attn.o_proj.weight"].dtype == mx.float16

    got = _imported_logits(out, TOKENS)
    want = _reference_logits(out, seen, TOKENS)
    assert _rel_err(got, want) < 2e-2


def _can_quantize(qtype) -> bool:
    try:
        gguf.quants.quantize(np.zeros((1, 256), np.float32), qtype)
        return True
    except NotImplementedError:
        return False


def test_q_bits_requantizes_float_and_k_quant_matrices(tmp_path, bpe):
    rng = np.random.default_rng(4)
    hf = _hf_weights(rng, len(bpe["tokens"]))
    types = {"model.embed_tokens.weight": Q.Q8_0}
    for i in range(LAYERS):
        types[f"model.layers.{i}.mlp.down_proj.weight"] = Q.Q4_K
    src = tmp_path / "k.gguf"
    seen = write_gguf(src, hf, bpe, types=types)
    out = import_gguf(src, tmp_path / "out", q_bits=4)
    config = json.loads((out / "config.json").read_text())
    quant = config["quantization"]
    assert (quant["group_size"], quant["bits"]) == (64, 4)
    # Natively quantized Q8_0 embedding is kept as it is.
    assert quant["model.embed_tokens"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    stored = mx.load(str(out / "model.safetensors"))
    assert "model.layers.0.mlp.down_proj.scales" in stored
    assert stored["model.norm.weight"].dtype == mx.float32  # norms are never quantized
    for name in ("model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj"):
        deq = mx.dequantize(
            stored[name + ".weight"],
            stored[name + ".scales"],
            stored[name + ".biases"],
            group_size=64,
            bits=4,
        ).astype(mx.float32)
        ref = seen[name + ".weight"]
        assert np.linalg.norm(np.array(deq) - ref) / np.linalg.norm(ref) < 0.15, name
    assert bool(mx.all(mx.isfinite(_imported_logits(out, TOKENS))).item())


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_architectures_are_not_unpermuted(tmp_path, bpe, arch):
    rng = np.random.default_rng(5)
    hf = _hf_weights(rng, len(bpe["tokens"]), qkv_bias=(arch == "qwen2"), qk_norm=(arch == "qwen3"))
    src = tmp_path / f"{arch}.gguf"
    write_gguf(src, hf, bpe, arch=arch, pre="qwen2")
    out = import_gguf(src, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == arch
    got = _imported_logits(out, TOKENS)
    want = _reference_logits(out, hf, TOKENS)
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()
    pre = json.loads((out / "tokenizer.json").read_text())["pre_tokenizer"]
    assert pre["pretokenizers"][0]["type"] == "Split"


def test_llama3_pre_tokenizer_and_add_bos(tmp_path, bpe):
    src = tmp_path / "l3.gguf"
    write_gguf(
        src,
        _hf_weights(np.random.default_rng(10), len(bpe["tokens"])),
        bpe,
        pre="llama-bpe",
        add_bos=True,
    )
    out = import_gguf(src, tmp_path / "out")
    spec = json.loads((out / "tokenizer.json").read_text())
    assert spec["model"]["ignore_merges"] is True
    rebuilt = Tokenizer.from_file(str(out / "tokenizer.json"))
    pieces = [p for p, _ in rebuilt.pre_tokenizer.pre_tokenize_str("year 12345!")]
    assert pieces == ["year", "Ġ", "123", "45", "!"]
    assert rebuilt.encode("hi").ids[0] == 1  # bos added
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is True


def test_large_models_are_sharded(tmp_path, bpe, monkeypatch):
    monkeypatch.setattr("omlx.models.gguf_import._SHARD_BYTES", 1 << 20)
    rng = np.random.default_rng(11)
    hf = _hf_weights(rng, len(bpe["tokens"]))
    src = tmp_path / "big.gguf"
    write_gguf(src, hf, bpe)
    out = import_gguf(src, tmp_path / "out")
    shards = sorted(p.name for p in out.glob("model*.safetensors"))
    assert len(shards) > 1 and "model.safetensors" not in shards
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    got = _imported_logits(out, TOKENS)
    assert mx.allclose(got, _reference_logits(out, hf, TOKENS), atol=1e-4, rtol=1e-4).item()


# --------------------------------------------------------------------------- errors


@pytest.fixture()
def good_gguf(tmp_path, bpe) -> Path:
    src = tmp_path / "good.gguf"
    write_gguf(src, _hf_weights(np.random.default_rng(6), len(bpe["tokens"])), bpe)
    return src


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b'{"this": "is json"}' * 10)
    with pytest.raises(GGUFImportError, match="not a GGUF file") as info:
        import_gguf(bad, tmp_path / "out")
    assert "Pass a .gguf model file" in str(info.value)

    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFImportError, match="empty"):
        import_gguf(empty, tmp_path / "out")

    with pytest.raises(GGUFImportError, match="not found"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "out")


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.01])
def test_truncated_file(tmp_path, good_gguf, keep):
    data = good_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: max(32, int(len(data) * keep))])
    with pytest.raises(GGUFImportError, match="truncated") as info:
        import_gguf(cut, tmp_path / "out")
    assert "download" in str(info.value).lower()


def test_corrupt_header(tmp_path, good_gguf):
    data = bytearray(good_gguf.read_bytes())
    data[8:24] = b"\xff" * 16  # absurd tensor / key counts
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFImportError, match="corrupt") as info:
        import_gguf(bad, tmp_path / "out")
    assert "Download it again" in str(info.value)


def test_unknown_architecture(tmp_path, bpe):
    src = tmp_path / "bert.gguf"
    w = gguf.GGUFWriter(str(src), "bert")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFImportError, match="unsupported GGUF architecture 'bert'") as info:
        import_gguf(src, tmp_path / "out")
    msg = str(info.value)
    assert "llama" in msg and "qwen2" in msg and "mlx-lm needs a matching model class" in msg


def test_unsupported_tensor_type(tmp_path, bpe):
    rng = np.random.default_rng(7)
    hf = _hf_weights(rng, len(bpe["tokens"]))
    src = tmp_path / "q81.gguf"
    write_gguf(src, hf, bpe)
    # Rewrite the same model with one tensor stored as Q8_1 (not decodable here).
    src2 = tmp_path / "q81b.gguf"
    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(src2), "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, value, vtype, sub_type=sub)
    for t in reader.tensors:
        if t.name == "blk.0.ffn_up.weight":
            block, size = gguf.GGML_QUANT_SIZES[Q.Q8_1]
            raw = np.zeros((FFN, HIDDEN // block * size), np.uint8)
            w.add_tensor(t.name, raw, raw_dtype=Q.Q8_1)
        else:
            w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFImportError, match="Q8_1") as info:
        import_gguf(src2, tmp_path / "out")
    assert "blk.0.ffn_up.weight" in str(info.value)


def test_unsupported_pre_tokenizer_and_bad_q_bits(tmp_path, bpe):
    src = tmp_path / "pre.gguf"
    write_gguf(src, _hf_weights(np.random.default_rng(8), len(bpe["tokens"])), bpe, pre="klingon")
    with pytest.raises(GGUFImportError, match="pre-tokenizer 'klingon'"):
        import_gguf(src, tmp_path / "out")
    with pytest.raises(GGUFImportError, match="q_bits"):
        import_gguf(src, tmp_path / "out", q_bits=3)


def test_missing_tensor(tmp_path, bpe):
    hf = _hf_weights(np.random.default_rng(9), len(bpe["tokens"]))
    del hf["model.layers.1.mlp.up_proj.weight"]
    src = tmp_path / "missing.gguf"
    write_gguf(src, hf, bpe)
    with pytest.raises(GGUFImportError, match="lacks 1 tensor"):
        import_gguf(src, tmp_path / "out")


def test_llama3_rope_factors_are_recovered():
    head_dim, base = 64, 500000.0
    factor, low, high, orig = 32.0, 1.0, 4.0, 8192
    wavelen = 2 * np.pi * base ** (np.arange(0, head_dim, 2) / head_dim)
    smooth = (orig / wavelen - low) / (high - low)
    freqs = np.where(
        wavelen < orig / high,
        1.0,
        np.where(wavelen > orig / low, factor, 1 / ((1 - smooth) / factor + smooth)),
    ).astype(np.float32)
    got = _llama3_rope_scaling(freqs, head_dim, base)
    assert got == {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    with pytest.raises(GGUFImportError):
        _llama3_rope_scaling(np.linspace(1, 3, head_dim // 2), head_dim, base)
