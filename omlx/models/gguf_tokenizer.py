"""The tokenizer of an imported GGUF model: ``tokenizer.json`` rebuilt with the
``tokenizers`` package from the GGUF vocabulary, merges and pre-tokenizer name."""

from __future__ import annotations

from typing import Any

from omlx.models.gguf_reader import GGUFImportError, need

__all__ = ["SUPPORTED_PRE_TOKENIZERS", "build_tokenizer"]

_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre value -> pre-tokenizer family
_PRE_TOKENIZER_FAMILIES: dict[str, str] = {
    # StarCoder-style: every digit on its own, then GPT-2 byte-level regex
    "smollm": "digits+bytelevel",
    "starcoder": "digits+bytelevel",
    "refact": "digits+bytelevel",
    # Qwen2 regex (single digits)
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
    # Llama 3 regex (digits in groups of up to three)
    "llama-bpe": "llama3",
    "llama3": "llama3",
    "smaug-bpe": "llama3",
    # Plain GPT-2 byte-level
    "gpt-2": "gpt2",
    "gpt2": "gpt2",
    "default": "gpt2",
}
SUPPORTED_PRE_TOKENIZERS = tuple(sorted(_PRE_TOKENIZER_FAMILIES))

# GGUF token types
_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 2, 3, 4
_TOKEN_UNUSED, _TOKEN_BYTE = 5, 6


# --------------------------------------------------------------------------- tokenizer


def _pre_tokenizer(pre: str | None):
    from tokenizers import Regex, pre_tokenizers

    family = _PRE_TOKENIZER_FAMILIES.get(pre or "default")
    if family is None:
        raise GGUFImportError(
            f"unsupported tokenizer pre-tokenizer {pre!r} (tokenizer.ggml.pre). Supported: "
            f"{', '.join(SUPPORTED_PRE_TOKENIZERS)}. A wrong pre-tokenizer would split text "
            "differently from the model's training, so the import stops here."
        )
    if family == "digits+bytelevel":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if family in ("qwen2", "llama3"):
        pattern = _QWEN2_REGEX if family == "qwen2" else _LLAMA3_REGEX
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _token_at(tokens: list[str], idx: Any) -> str | None:
    if idx is None:
        return None
    idx = int(idx)
    return tokens[idx] if 0 <= idx < len(tokens) else None


def build_tokenizer(meta: dict[str, Any]):
    """Return (tokenizers.Tokenizer, tokenizer_config, special_tokens_map, gen_ids)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise GGUFImportError(
            "the GGUF file has no tokenizer (tokenizer.ggml.model is missing); this importer "
            "needs the vocabulary embedded in the file."
        )
    if kind != "gpt2":
        raise GGUFImportError(
            f"tokenizer model {kind!r} is not supported; only byte-level BPE ('gpt2', used by "
            "Llama 3, Qwen2/3, SmolLM2 and most recent models) is. SentencePiece ('llama') "
            "vocabularies are not imported yet."
        )
    tokens: list[str] = list(need(meta, "tokenizer.ggml.tokens"))
    types = list(meta.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens))
    merges_raw: list[str] = list(meta.get("tokenizer.ggml.merges") or [])
    if len(types) != len(tokens):
        raise GGUFImportError("tokenizer.ggml.token_type and tokens differ in length; corrupt.")

    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    merges: list[tuple[str, str]] = []
    for m in merges_raw:
        a, sep, b = m.partition(" ")
        if not sep:
            raise GGUFImportError(f"malformed BPE merge {m!r} in tokenizer.ggml.merges.")
        merges.append((a, b))

    pre = meta.get("tokenizer.ggml.pre")
    pre_tokenizer = _pre_tokenizer(pre)  # raises for an unsupported one
    family = _PRE_TOKENIZER_FAMILIES[pre or "default"]
    bpe = models.BPE(
        vocab=vocab,
        merges=merges,
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=(family == "llama3"),
    )
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()

    specials = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty in (_TOKEN_CONTROL, _TOKEN_UNKNOWN)
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty == _TOKEN_USER_DEFINED
    ]
    if specials:
        tok.add_special_tokens(specials)
    if user:
        tok.add_tokens(user)

    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    bos = _token_at(tokens, bos_id)
    eos = _token_at(tokens, eos_id)
    unk = _token_at(tokens, meta.get("tokenizer.ggml.unknown_token_id"))
    pad = _token_at(tokens, meta.get("tokenizer.ggml.padding_token_id"))
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None

    if add_bos or add_eos:
        single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
        pair = (
            single
            + ([f"{bos}:1"] if add_bos else [])
            + ["$B:1"]
            + ([f"{eos}:1"] if add_eos else [])
        )
        special_ids = []
        if add_bos:
            special_ids.append((bos, int(bos_id)))
        if add_eos and eos != bos:
            special_ids.append((eos, int(eos_id)))
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=special_ids
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    special_map: dict[str, Any] = {}
    for key, value in (
        ("bos_token", bos),
        ("eos_token", eos),
        ("unk_token", unk),
        ("pad_token", pad),
    ):
        if value is not None:
            special_map[key] = value

    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        **special_map,
    }
    ctx = next((v for k, v in meta.items() if k.endswith(".context_length")), None)
    if ctx:
        tok_config["model_max_length"] = int(ctx)
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        tok_config["chat_template"] = template

    eos_ids: list[int] = []
    for key in (
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ):
        v = meta.get(key)
        if v is not None and int(v) not in eos_ids and 0 <= int(v) < len(tokens):
            eos_ids.append(int(v))
    ids = {
        "bos_token_id": int(bos_id) if bos is not None else None,
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
        "pad_token_id": int(meta["tokenizer.ggml.padding_token_id"]) if pad is not None else None,
    }
    return tok, tok_config, special_map, ids
