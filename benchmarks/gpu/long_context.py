"""Long contexts through `omlx serve` on an NVIDIA GPU: cold prompts, cache hits with short and
2,000-token suffixes, and two sessions at different depths at once, for prompts up to 120k
tokens of a random-weight Llama-3.1-8B shape with a 131,072-token window.

Every request must answer with the server alive after it (a 47,872-token hit once lost the
GPU). Each hit's greedy output is compared with the same prompt on a `--no-cache` server
(identical tokens expected in float32; in bfloat16 the first token and the largest difference
of its top-5 logprobs are reported), and TTFT against `--no-cache` and `mlx_lm.server`.

    python benchmarks/gpu/long_context.py --out DIR [--dtype bfloat16|float32]
        [--lengths 8000,32000,48000,64000,120000] [--peer]
    python benchmarks/gpu/long_context.py --shape tiny --lengths 600,1200 --out /tmp/lc   # CPU smoke

The model's vocabulary is the test tokenizer's 512 tokens (the shape's attention and KV are
the 8B's), so each generated token decodes to its own text and outputs compare token by token.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]

import httpx  # noqa: E402
from bench_gpu import SHAPES, PeerServer, Server, build_model, log  # noqa: E402

VOCAB = 512
SUFFIX_SHORT, SUFFIX_LONG = 16, 2000
results: dict[str, Any] = {"rows": []}


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def ask(url: str, tokens: list[int] | str, max_tokens: int, model: str) -> dict[str, Any]:
    """One streamed greedy completion: TTFT, the tokens' texts and logprobs, cached tokens.
    `mlx_lm.server` takes the prompt as text (its completions do not take token ids)."""
    body = {"model": model, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "logit_bias": {"2": -100}, "stream_options": {"include_usage": True}}
    if not isinstance(tokens, str):
        body["logprobs"] = 5
    tic, first, texts, lps, tops, cached = time.perf_counter(), None, [], [], [], None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=900) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code} {r.read()[:300]!r}"}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": str(chunk["error"])[:300]}
            if chunk.get("usage"):
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
            for choice in chunk.get("choices", []):
                lp = choice.get("logprobs") or {}
                if choice.get("text") or lp.get("tokens"):
                    first = first or time.perf_counter() - tic
                if lp.get("tokens"):
                    texts += lp["tokens"]
                    lps += lp["token_logprobs"]
                    tops += lp["top_logprobs"]
    return {"ttft": first, "tokens": texts, "logprobs": lps, "top": tops, "cached": cached}


def healthy(server: Server) -> bool:
    try:
        return httpx.get(server.url + "/health", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def compare(got: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    if "error" in got or "error" in ref:
        return {"error": got.get("error") or ref.get("error")}
    diff = None
    if got["top"] and ref["top"]:
        a, b = got["top"][0] or {}, ref["top"][0] or {}
        shared = set(a) & set(b)
        diff = max((abs(a[t] - b[t]) for t in shared), default=None)
    return {"identical": got["tokens"] == ref["tokens"], "first_identical": got["tokens"][:1] == ref["tokens"][:1],
            "first_top5_max_diff": diff}


def start(server: Server) -> Server:
    server.start()
    log(f"{server.label} ready in {server.wait_ready():.1f}s")
    if not isinstance(server, PeerServer):
        server.wait_warmed()
    return server


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--lengths", default="8000,32000,48000,64000,120000")
    ap.add_argument("--tokens", type=int, default=8, help="generated per request")
    ap.add_argument("--peer", action="store_true", help="also time mlx_lm.server")
    ap.add_argument("--peer-lengths", default=None, help="lengths for mlx_lm.server (default: all)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/omlx-long-context"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"{args.shape}-v{VOCAB}"
    SHAPES[name] = {**SHAPES[args.shape], "vocab_size": VOCAB, "max_position_embeddings": 131072}
    model_dir = build_model(Path("/tmp/omlx-bench-gpu/models"), name)
    results.update(shape=name, dtype=args.dtype, lengths=args.lengths)
    flags = ["--compute-dtype", args.dtype, "--max-concurrent-requests", "32", "--log-level", "info"]
    homes = out / "homes"
    shutil.rmtree(homes, ignore_errors=True)  # every run starts cold
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    lengths = [int(x) for x in args.lengths.split(",")]
    peer_lengths = [int(x) for x in (args.peer_lengths or args.lengths).split(",")] if args.peer else []
    requests: list[tuple[int, str, list[int]]] = []
    for i, n in enumerate(lengths):
        base = prompt(n, 1000 + i)
        requests += [(n, "cold", base), (n, "hit+16", base + prompt(SUFFIX_SHORT, 2000 + i)),
                     (n, "hit+2000", base + prompt(SUFFIX_LONG, 3000 + i))]
    save = lambda: (out / f"long-context-{args.dtype}.json").write_text(json.dumps(results, indent=1))  # noqa: E731
    signal.signal(signal.SIGTERM, lambda *_: (save(), sys.exit(1)))
    # each server alone on the GPU, one after the other: the same requests, compared afterwards
    answers: dict[str, dict[tuple[int, str], dict[str, Any]]] = {"omlx": {}, "nocache": {}, "peer": {}}
    phases = [("omlx", Server("omlx", model_dir.parent, name, homes / "cache", flags)),
              ("nocache", Server("omlx --no-cache", model_dir.parent, name, homes / "nocache", [*flags, "--no-cache"]))]
    if peer_lengths:
        phases.append(("peer", PeerServer("mlx_lm.server", model_dir.parent, name, homes / "peer", [])))
    for label, server in phases:
        start(server)
        bases: list[list[int]] = []  # the cold prompts so far: a pair hits this one and the one before
        for n, row, tokens in requests:
            if label == "peer" and (n not in peer_lengths or row == "hit+2000"):
                continue
            got = ask(server.url, tokenizer.decode(tokens) if label == "peer" else tokens, args.tokens,
                      str(model_dir) if label == "peer" else name)
            got["alive"] = healthy(server) if label != "peer" else True
            answers[label][(n, row)] = got
            log(f"{label} {n} {row}: ttft={got.get('ttft')} cached={got.get('cached')} error={got.get('error')}")
            if not got["alive"]:
                results.setdefault("deaths", []).append({"server": label, "length": n, "row": row,
                                                         "log": server.log_tail()[-3000:]})
                server.stop()
                start(server)
            if row == "cold":
                bases.append(tokens)
            if label == "omlx" and row == "hit+2000" and len(bases) > 1:  # two sessions at once
                pair = [bases[-1] + prompt(SUFFIX_SHORT, 4000 + n), bases[-2] + prompt(SUFFIX_SHORT, 5000 + n)]
                with cf.ThreadPoolExecutor(2) as pool:
                    both = list(pool.map(ask, [server.url] * 2, pair, [args.tokens] * 2, [name] * 2))
                answers[label][(n, "pair")] = {"ttfts": [b.get("ttft") for b in both],
                                               "cached": [b.get("cached") for b in both],
                                               "errors": [b.get("error") for b in both], "alive": healthy(server)}
                log(f"pair {n}: {answers[label][(n, 'pair')]}")
        server.stop()
        (out / f"server-{label}.log").write_text(server.log_tail())
        results["rows"] = rows_of(answers)
        save()
    for row in results["rows"]:
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()})


def rows_of(answers: dict[str, dict[tuple[int, str], dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for (n, label), got in answers["omlx"].items():
        if label == "pair":
            rows.append({"length": n, "row": label, **got})
            continue
        ref = answers["nocache"].get((n, label))
        peer = answers["peer"].get((n, label), {})
        row = {"length": n, "row": label, "ttft": got.get("ttft"), "cached": got.get("cached"),
               "alive": got.get("alive"), "error": got.get("error"),
               "ttft_nocache": ref.get("ttft") if ref else None, "ttft_peer": peer.get("ttft")}
        if ref:
            row.update(compare(got, ref))
        rows.append(row)
    return rows

if __name__ == "__main__":
    main()
