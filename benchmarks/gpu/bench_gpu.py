#!/usr/bin/env python
"""oMLX on MLX's CUDA backend vs raw mlx-lm, on random-weight models of real architectures.

Everything runs in one process tree on the GPU machine, in one run: the models are built
on the device (random weights in bf16, real Llama-3.2-1B / Llama-3.1-8B shapes, a small
synthetic BPE tokenizer), `omlx serve` runs as subprocesses, raw mlx-lm runs in this
process (only while the servers are idle), and a pool of client processes streams the
HTTP requests. Parts (see benchmarks/gpu/README.md):

  a  batch-1 decode tok/s: oMLX (a streamed chat completion of a text prompt) vs
     `mlx_lm.stream_generate` on the same rendered prompt, rounds alternating, medians
  b  N concurrent streamed chat completions, aggregate tok/s: oMLX vs raw `BatchGenerator`,
     rounds alternating, medians
  c  TTFT of long prompts: --no-cache, cache miss, hot-tier restore, RAM-tier restore, SSD restore after a
     restart (page cache dropped), and the tiers' restore bandwidth
  d  batch-1 decode as a fraction of the HBM floor (bytes read per step / copy bandwidth)
  e  host<->device copy bandwidth through MLX (and PyTorch for reference)
  f  oMLX vs `mlx_lm.server --decode-concurrency N` on text prompts: batch-1 decode and
     N (default 8) concurrent streams' aggregate tok/s (issue #3's serving comparison)
  g  TTFT of the first long prompt after a start, with the idle engine's attention-graph
     warm-up (the default) and without it (--graph-warmup-tokens 0), then of a second one
  s  N concurrent streams with half of them held to a JSON schema (`response_format`) vs all
     free, on the same server, rounds alternating, medians (issue #41's GPU row)

Usage (on the GPU machine, see README): python benchmarks/gpu/bench_gpu.py --shape llama-3.2-1b
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import multiprocessing as mp
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SERVER_ROOT = ROOT  # the checkout `omlx serve` runs from (`--server-root`)
sys.path[:0] = [str(ROOT), str(HERE)]

import httpx  # noqa: E402
import sse_client  # noqa: E402

LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
SHAPES: dict[str, dict[str, Any]] = {
    # config.json values of meta-llama/Llama-3.2-1B-Instruct and Llama-3.1-8B-Instruct
    "llama-3.2-1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        intermediate_size=8192,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling={"factor": 32.0, **LLAMA3_ROPE},
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
    ),
    "llama-3.1-8b": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling={"factor": 8.0, **LLAMA3_ROPE},
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
    ),
    # for a smoke run of this script on a CPU
    "tiny": dict(
        hidden_size=256,
        num_hidden_layers=4,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=4096,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        max_position_embeddings=65536,
        rms_norm_eps=1e-5,
    ),
}

PERF = time.perf_counter
STREAMS_MARKER = "every-token-streams"  # in a model folder built by build_model(every_token_streams=True)


STUCK_AFTER = 180  # seconds without a log line: this process's stacks go to stderr


LOG_FILE: Path | None = None  # every log line is appended here too (in the figures' folder)


def log(msg: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    if LOG_FILE is not None:  # kept when a time limit kills the run and whatever reads stdout
        with open(LOG_FILE, "a") as f:
            f.write(line + "\n")
    faulthandler.dump_traceback_later(STUCK_AFTER)  # re-armed: only a run that is stuck dumps


# ----------------------------------------------------------------------------- models
def build_model(
    models_root: Path,
    shape: str,
    *,
    name: str | None = None,
    window: int | None = None,
    tokenizer: Any = None,
    every_token_streams: bool = False,
) -> Path:
    """A random-weight bf16 model folder that `mlx_lm.load` and `omlx serve` accept.

    `name` (default: the shape's) is the folder; `window` replaces the shape's
    `max_position_embeddings` (the context window oMLX serves); `tokenizer(out)` writes the
    tokenizer files instead of the 512-token BPE (long_context.py's has a word per model id);
    `every_token_streams` zeroes the output head's rows (the tied embedding's where tied) of
    EOS and of every token that is no whole text (special tokens, lone UTF-8 bytes, which a
    streamed answer holds back until the character is whole): their logits are then 0, below
    the largest of the other random logits, so greedy output runs to `max_tokens` without a
    `logit_bias` (DESIGN.md, "Benchmark method") and each token streams as text. A folder built
    the other way is rebuilt."""
    import mlx.core as mx
    from mlx_lm.models import llama
    from mlx_lm.utils import save_model

    from tests.support.tiny_model import build_tokenizer

    out = models_root / (name or shape)
    marker = out / STREAMS_MARKER
    if (out / "config.json").exists():
        if marker.exists() == every_token_streams:
            return out
        shutil.rmtree(out)
    tic = PERF()
    shape_config = {**SHAPES[shape], **({"max_position_embeddings": window} if window else {})}
    out.mkdir(parents=True, exist_ok=True)
    # default: 512-token BPE; ids past it detokenize to "!" (mlx-lm's fallback)
    (tokenizer or build_tokenizer)(out)
    tc = json.loads((out / "tokenizer_config.json").read_text())
    tc["model_max_length"] = shape_config["max_position_embeddings"]
    (out / "tokenizer_config.json").write_text(json.dumps(tc))
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        **shape_config,
        "eos_token_id": 2,
        "bos_token_id": None,
        "torch_dtype": "bfloat16",
    }
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    if every_token_streams:
        head = model.model.embed_tokens if config["tie_word_embeddings"] else model.lm_head
        head.weight = head.weight.at[mx.array(no_text_ids(out, config["eos_token_id"]))].multiply(0.0)
    mx.eval(model.parameters())
    save_model(out, model)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if every_token_streams:
        marker.write_text("the output head's rows of EOS and of tokens without whole text are zero\n")
    del model
    mx.clear_cache()
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    log(f"built {out.name}: {size / 1e9:.2f} GB of bf16 weights in {PERF() - tic:.1f} s")
    return out


def no_text_ids(folder: Path, eos: int) -> list[int]:
    """EOS and the ids of `folder`'s tokenizer whose text a stream holds back: none (""), a
    partial UTF-8 sequence (mlx-lm's detokenizer waits for the whole character), or only
    whitespace (a chat answer's leading whitespace waits for its first other character). Ids
    past its vocabulary stream as "!" (mlx-lm's fallback)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    texts = ((i, tok.decode([i])) for i in range(tok.get_vocab_size()))
    return sorted({eos, *(i for i, t in texts if not t.strip() or "\ufffd" in t)})


def ready_for_threads(model: Any) -> None:
    """One forward pass on this thread: it evaluates what the model keeps lazily (Llama 3's
    RoPE frequencies), which first used on another thread (an engine's) names this thread's
    stream, which that thread lacks: "There is no Stream(gpu, 0) in current thread"."""
    import mlx.core as mx

    mx.eval(model(mx.array([[3, 4, 5]])))


def weight_read_bytes(model: Any) -> tuple[int, int]:
    """(parameter bytes, bytes a decode step reads): an untied embedding is only gathered."""
    from mlx.utils import tree_flatten

    params = dict(tree_flatten(model.parameters()))
    total = sum(v.nbytes for v in params.values())
    tied = "lm_head.weight" not in params
    embed = params["model.embed_tokens.weight"].nbytes
    return total, total if tied else total - embed


# ----------------------------------------------------------------------------- servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, label: str, models_root: Path, model: str, home: Path, extra: list[str]):
        self.label, self.models_root, self.model, self.home, self.extra = (
            label,
            models_root,
            model,
            home,
            extra,
        )
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.starts = 0
        self.root = SERVER_ROOT  # the oMLX checkout it runs (`--server-root`)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.starts += 1
        env = {**os.environ, "OMLX_HOME": str(self.home), "PYTHONUNBUFFERED": "1"}
        # all servers of a run share MLX's compiled CUDA kernels (each home would compile anew)
        env.setdefault("MLX_PTX_CACHE_DIR", str(self.home.parent.parent / "kernel-cache"))
        cmd = [
            sys.executable,
            "-m",
            "omlx",
            "serve",
            "--port",
            str(self.port),
            "--model-dir",
            str(self.models_root),
            "--model",
            self.model,
            *self.extra,
        ]
        self._log = open(self.home / f"server-{self.starts}.log", "ab")
        self.proc = subprocess.Popen(
            cmd, env=env, cwd=self.root, stdout=self._log, stderr=subprocess.STDOUT
        )

    def wait_ready(self, timeout: float = 600) -> float:
        tic = PERF()
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.label} exited {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                r = httpx.get(f"{self.url}/v1/models/status", timeout=2)
                if r.status_code == 200 and any(
                    m.get("state") in ("loaded", "serving") for m in r.json().get("data", [])
                ):
                    return PERF() - tic
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.label} did not load its model:\n{self.log_tail()}")

    def log_tail(self) -> str:
        try:
            return (self.home / f"server-{self.starts}.log").read_text(errors="replace")[-6000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "_log", None):
            self._log.close()

    def cache_stats(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/api/cache/stats", timeout=10).json()

    def step_times(self) -> dict[str, Any] | None:
        """The engine's decode-time split so far (`step_times` of /v1/models/status; None from a
        server without it, such as an earlier checkout's)."""
        data = httpx.get(f"{self.url}/v1/models/status", timeout=10).json()["data"]
        return next((m.get("step_times") for m in data if m["id"] == self.model), None)

    def wait_ssd_writes(self, timeout: float = 120) -> None:
        """Until the SSD writer's queue is empty and the block count stops moving."""
        deadline, last = time.time() + timeout, None
        while time.time() < deadline:
            stats = self.cache_stats()
            ssd = stats.get("ssd") or next(iter(stats.get("stores", {}).values()), {}).get(
                "ssd", {}
            )
            # blocks wait in the engine until it is idle, then in the writer's queue
            now = (stats.get("unwritten_blocks", 0) + ssd.get("queue_depth", 0), ssd.get("blocks"), ssd.get("writes"))
            if now[0] == 0 and now == last:
                return
            last = now
            time.sleep(1.0)


    def wait_idle(self, timeout: float = 120) -> float:
        """Seconds until the engine holds no request (it may still be storing a finished
        one's blocks: the status counts it until that is done)."""
        tic, deadline = PERF(), time.time() + timeout
        while time.time() < deadline:
            st = httpx.get(f"{self.url}/api/status", timeout=10).json()
            if st["active_requests"] == 0 and st["waiting_requests"] == 0:
                return PERF() - tic
            time.sleep(0.05)
        raise RuntimeError(f"{self.label} still busy after {timeout:.0f}s:\n{self.log_tail()}")

    def wait_warmed(self, timeout: float = 300) -> dict[str, Any] | None:
        """Until the model's attention-graph warm-up is over (it goes on between requests:
        a timed request could meet one of its chunks); its last progress (None: it has none)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            models = httpx.get(f"{self.url}/api/status", timeout=10).json()["models"]
            entry = next((m for m in models if m["id"] == self.model), None)
            if entry is None:
                raise RuntimeError(f"{self.label}: no model {self.model} in /api/status")
            progress = entry.get("graph_warmup")
            if progress is None or progress.get("done") or progress.get("error"):
                return progress
            time.sleep(0.1)
        raise RuntimeError(f"{self.label}: graph warm-up not over after {timeout:.0f}s:\n{self.log_tail()}")

    def wait_demoted(self, timeout: float = 60) -> None:
        """Until the blocks the hot tier let go have been copied to RAM (an idle engine does it)."""
        deadline = time.time() + timeout
        while time.time() < deadline and self.cache_stats().get("demoting_bytes"):
            time.sleep(0.05)


class PeerServer(Server):
    """`mlx_lm.server` on the same model folder: the peer of part (f)."""

    def start(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.starts += 1
        cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(self.models_root / self.model),
               "--port", str(self.port), *self.extra]  # fmt: skip
        self._log = open(self.home / f"server-{self.starts}.log", "ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, env=env, cwd=self.home, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 600) -> float:
        tic = PERF()
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.label} exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return PERF() - tic
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.label} did not start:\n{self.log_tail()}")


# ----------------------------------------------------------------------------- workload
class Workload:
    def __init__(self, model_name: str, eos: list[int], seed: int = 1234):
        self.model_name = model_name
        self.eos = eos
        self.rng = random.Random(seed)

    def prompt(self, n: int) -> list[int]:
        # ids of the 512-token tokenizer's regular vocabulary (0..2 are its special tokens)
        return [self.rng.randrange(3, 512) for _ in range(n)]

    def body(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logit_bias": {str(e): -100 for e in self.eos},
        }

    def text(self, tokenizer: Any, n: int) -> str:
        """A new text of about `n` tokens (random ids of the tokenizer's vocabulary, decoded)."""
        return tokenizer.decode(self.prompt(n))

    def chat_body(self, text: str, max_tokens: int) -> dict[str, Any]:
        """The request users send: a streamed chat completion of one user message, greedy,
        no `logit_bias` (the model's EOS is unreachable instead)."""
        return {
            "model": self.model_name,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    """The prompt ids `omlx serve` renders for `Workload.chat_body(text)`: what raw mlx-lm gets."""
    from omlx.api.chat_template import render_chat

    return render_chat(tokenizer, [{"role": "user", "content": text}])


def decode_rate(times: list[float]) -> float:
    return (
        (len(times) - 1) / (times[-1] - times[0])
        if len(times) > 1 and times[-1] > times[0]
        else 0.0
    )


def stream_rate(rec: dict[str, Any]) -> float:
    """Decode tok/s of one streamed request: tokens after the first over first text → last chunk.

    Counted from the usage, not from chunks: a chunk may carry several tokens (the server
    merges a stream's tokens when its client falls behind) or none (a partial character)."""
    first = rec["times"][0] if rec["times"] else None
    span = rec["end"] - first if first is not None else 0.0
    return (rec["completion_tokens"] - 1) / span if span > 0 and rec["completion_tokens"] > 1 else 0.0


REQUEST_TIMEOUT = 180.0  # --request-timeout


def one(url: str, body: dict[str, Any]) -> dict[str, Any]:
    with httpx.Client(timeout=REQUEST_TIMEOUT) as c:
        return sse_client.stream_completion(c, url, body, timeout=REQUEST_TIMEOUT)


def kv_bytes_per_token(shape: str) -> int:
    """Bytes of bf16 keys and values one token takes in the KV cache of `shape`."""
    c = SHAPES[shape]
    head_dim = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 2


def ttft(url: str, body: dict[str, Any]) -> tuple[float, int]:
    rec = one(url, body)
    first = rec["times"][0] if rec["times"] else rec["done"]
    return first - rec["sent"], rec["cached_tokens"]


# ----------------------------------------------------------------------------- raw mlx-lm
def logits_procs(eos: list[int]) -> list[Any]:
    from mlx_lm.sample_utils import make_logits_processors

    return make_logits_processors(logit_bias={e: -100.0 for e in eos})


def raw_decode(
    model: Any, tokenizer: Any, prompt: list[int], n: int, eos: list[int], with_procs: bool = True
) -> dict[str, float]:
    """Batch-1 `stream_generate`; `with_procs`: EOS biased off by a logits processor (the
    model of parts (a) and (b) needs none: its EOS is unreachable). `build_ms`: the model's
    forward passes (graph building) per token, timed as the server's step clock times them."""
    from mlx_lm.generate import stream_generate

    from omlx.engine.step_clock import StepClock, TimedForward

    clock = StepClock()
    clock.start_loop()
    sent = PERF()
    times = []
    procs = logits_procs(eos) if with_procs else None
    timed = TimedForward(lambda: model, clock)
    for _ in stream_generate(timed, tokenizer, prompt=prompt, max_tokens=n, logits_processors=procs):
        times.append(PERF())
    clock.end_loop(len(times))
    build_ms = 1000 * clock.totals["graph_build"] / max(1, len(times))
    return {"tps": decode_rate(times), "ttft": times[0] - sent, "tokens": len(times), "build_ms": build_ms}


def raw_decode_fresh_process(model_path: Path, prompt: list[int], n: int, eos: list[int]) -> float:
    """Batch-1 `stream_generate` tok/s in a process that does nothing else (best of 2 after a
    warm-up): the driver hosts the client pool, the in-process engine and earlier parts'
    arrays, and on a busy host its raw figure came out below the server process's."""
    job = json.dumps({"model": str(model_path), "prompt": prompt, "n": n, "eos": eos})  # no processors
    out = subprocess.run(
        [sys.executable, __file__, "--raw-worker", job], capture_output=True, text=True, timeout=900
    )
    if out.returncode != 0:
        raise RuntimeError(f"raw worker failed: {out.stderr[-2000:]}")
    return float(json.loads(out.stdout.strip().splitlines()[-1])["tps"])


def raw_worker(job: str) -> None:
    from mlx_lm import load

    spec = json.loads(job)
    model, tokenizer = load(spec["model"])
    rates = [raw_decode(model, tokenizer, spec["prompt"], spec["n"], spec["eos"], False)["tps"] for _ in range(3)]
    print(json.dumps({"tps": max(rates[1:])}))


def raw_batch_decode(model: Any, prompt: list[int], n: int, eos: list[int]) -> float:
    """Batch-1 decode tok/s through `BatchGenerator` (the engine oMLX drives), no server."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    bg = BatchGenerator(model, stop_tokens=[[e] for e in eos], completion_batch_size=1, prefill_batch_size=1)
    bg.insert([prompt], max_tokens=[n])  # no processors: the model's EOS is unreachable
    times: list[float] = []
    done = False
    while not done:
        _, gen = bg.next()
        for r in gen:
            times.append(PERF())
            done = r.finish_reason is not None
    bg.close()
    mx.clear_cache()
    return decode_rate(times)


def engine_decode(model: Any, tokenizer: Any, prompt: list[int], n: int, eos: list[int]) -> dict[str, float]:
    """Batch-1 decode through oMLX's `LLMEngine` in this process: the engine without HTTP.

    Tells the engine's own cost (raw `BatchGenerator` vs this) from the HTTP layer's
    (this vs the server)."""
    import asyncio
    from types import SimpleNamespace

    from omlx.engine.llm_engine import LLMEngine
    from omlx.engine.request import GenerationRequest, SamplingParams

    loaded = SimpleNamespace(model=model, tokenizer=tokenizer, context_length=1 << 20, draft=None)
    engine = LLMEngine("bench", lambda: loaded, max_concurrent=1)

    async def run() -> dict[str, float]:
        await engine.wait_ready()
        req = GenerationRequest("bench", prompt, n, SamplingParams(temperature=0.0))  # EOS unreachable
        first = last = 0.0
        tokens = 0
        async for ev in engine.generate(req):
            if ev.token_ids:
                last = PERF()
                first = first or last
                tokens += len(ev.token_ids)
        return {"tps": (tokens - 1) / (last - first) if last > first else 0.0, "tokens": tokens}

    try:
        return asyncio.run(run())
    finally:
        engine.shutdown()


def raw_batch(
    model: Any,
    prompts: list[list[int]],
    n: int,
    eos: list[int],
    prefill_step: int,
    with_procs: bool = True,
) -> dict[str, float]:
    """Raw `BatchGenerator` over `prompts`; `build_ms`: its forward passes (graph building) per
    step, timed as the server's step clock times them, so a slow host shows on both sides."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    from omlx.engine.step_clock import StepClock, TimedForward

    clock = StepClock()
    clock.start_loop()
    s = len(prompts)
    bg = BatchGenerator(
        TimedForward(lambda: model, clock),
        stop_tokens=[[e] for e in eos],
        completion_batch_size=s,
        prefill_batch_size=min(8, s),
        prefill_step_size=prefill_step,
    )
    procs = logits_procs(eos) if with_procs else []
    t0 = PERF()
    bg.insert(prompts, max_tokens=[n] * s, logits_processors=[procs] * s)
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    stamps: list[tuple[float, float]] = []
    finished = steps = 0
    while finished < s:
        _, gen = bg.next()
        now = PERF()
        steps += 1
        for r in gen:
            stamps.append((now, 1.0))
            first.setdefault(r.uid, now)
            last[r.uid] = now
            if r.finish_reason is not None:
                finished += 1
    t_end = PERF()
    bg.close()
    mx.clear_cache()
    out = summarize_streams(t0, t_end, len(stamps), list(first.values()), list(last.values()), stamps)
    clock.end_loop(steps)
    return {**out, "build_ms": 1000 * clock.totals["graph_build"] / max(1, steps)}


def summarize_streams(
    t0: float,
    t_end: float,
    total: int,
    firsts: list[float],
    lasts: list[float],
    stamps: list[tuple[float, float]],
) -> dict[str, float]:
    """`stamps`: (arrival time, tokens it carried) of every chunk of every stream."""
    lo, hi = max(firsts), min(lasts)
    steady = sum(w for t, w in stamps if lo < t <= hi) / (hi - lo) if hi > lo else 0.0
    return {
        "aggregate_tps": total / (t_end - t0),
        "steady_tps": steady,
        "tokens": total,
        "wall_s": t_end - t0,
        "mean_ttft": statistics.mean(f - t0 for f in firsts),
    }


def server_batch(
    pool: ProcessPoolExecutor, url: str, bodies: list[dict[str, Any]], groups: int
) -> dict[str, float]:
    start_at = PERF() + 0.5
    parts = [bodies[i::groups] for i in range(groups) if bodies[i::groups]]
    futures = [pool.submit(sse_client.stream_group, url, p, start_at, REQUEST_TIMEOUT) for p in parts]
    recs = [r for f in futures for r in f.result()]
    heads = [""] * len(bodies)  # each answer's opening, in the bodies' order
    for i, f in enumerate(futures):
        for j, rec in enumerate(f.result()):
            heads[i + j * len(parts)] = rec.get("head", "")
    errors = [r["error"] for r in recs if "error" in r]
    if errors:
        raise RuntimeError(f"{len(errors)} streams failed: {errors[:3]}")
    total = sum(r["completion_tokens"] for r in recs)
    # a chunk may carry several tokens (merged when a client falls behind): spread each
    # stream's tokens evenly over its chunks
    stamps = [(t, r["completion_tokens"] / len(r["times"])) for r in recs for t in r["times"]]
    out = summarize_streams(
        start_at,
        max(r["done"] for r in recs),
        total,
        [r["times"][0] for r in recs],
        [r["end"] for r in recs],
        stamps,
    )
    cpu = sum({id(f): r["group_cpu_s"] for f in futures for r in f.result()[:1]}.values())
    return {**out, "retries": sum(r.get("retries", 0) for r in recs), "client_cpu_s": cpu, "heads": heads}


# ----------------------------------------------------------------------------- profiling
def dump_servers(exe: str | None, servers: list[Any]) -> None:
    """Python stacks of every live server (a hung request shows up as a timeout)."""
    if not exe:
        return
    for s in servers:
        if s.proc is not None and s.proc.poll() is None:
            out = subprocess.run([exe, "dump", "--pid", str(s.proc.pid)], capture_output=True, text=True, timeout=60)
            log(f"py-spy dump of {s.label}:\n{out.stdout[-6000:]}{out.stderr[-500:]}")


class PySpy:
    """`py-spy record` on a server process while a measurement runs (raw collapsed stacks)."""

    def __init__(self, exe: str | None, out: Path | None):
        self.exe, self.out, self.proc = exe, out, None

    def start(self, pid: int, name: str, seconds: int) -> None:
        if not self.exe or not self.out:
            return
        self.proc = subprocess.Popen(
            [
                self.exe,
                "record",
                "-p",
                str(pid),
                "-r",
                "200",
                "-d",
                str(seconds),
                "--threads",
                "--nonblocking",
                "-f",
                "raw",
                "-o",
                str(self.out / f"pyspy-{name}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        time.sleep(1.0)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)  # py-spy writes its file and exits
            try:
                _, err = self.proc.communicate(timeout=60)
                if self.proc.returncode not in (0, None) and err:
                    log(f"py-spy: {err.decode(errors='replace')[-300:]}")
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.proc = None


# ----------------------------------------------------------------------------- device micro
def device_bandwidths(tmp: Path) -> dict[str, float]:
    """HBM copy bandwidth and host<->device copies through MLX (and PyTorch, for reference)."""
    import mlx.core as mx
    import numpy as np

    out: dict[str, float] = {}
    gib = 1 << 30
    n = gib  # 2 GiB of bf16
    x = mx.random.uniform(shape=(n,)).astype(mx.bfloat16)
    mx.eval(x)
    for _ in range(3):
        x = x + 1
        mx.eval(x)
    iters = 20
    tic = PERF()
    for _ in range(iters):
        x = x + 1
        mx.eval(x)
    dt = PERF() - tic
    out["hbm_copy_GBps"] = iters * 2 * x.nbytes / dt / 1e9  # read + write
    del x
    mx.clear_cache()

    host = np.random.randint(0, 65535, size=(gib // 2,), dtype=np.uint16)  # 1 GiB
    res: dict[str, list[float]] = {
        "h2d_mx_array": [],
        "h2d_first_gpu_op": [],
        "gpu_op_resident": [],
        "d2h_np_array": [],
    }
    for _ in range(3):
        tic = PERF()
        a = mx.array(host)
        mx.eval(a)
        t1 = PERF()
        b = a + 1
        mx.eval(b)
        t2 = PERF()
        c = b + 1
        mx.eval(c)
        t3 = PERF()
        back = np.array(c, copy=True)
        t4 = PERF()
        res["h2d_mx_array"].append(t1 - tic)
        res["h2d_first_gpu_op"].append(t2 - t1)
        res["gpu_op_resident"].append(t3 - t2)
        res["d2h_np_array"].append(t4 - t3)
        del a, b, c, back
    for k, v in res.items():
        out[f"{k}_GBps"] = host.nbytes / min(v) / 1e9
    # numpy -> mx.array -> first use on the GPU, together: what a restore from host RAM pays
    out["h2d_total_GBps"] = (
        host.nbytes / (min(res["h2d_mx_array"]) + min(res["h2d_first_gpu_op"])) / 1e9
    )
    # mx.load of a safetensors file already in the page cache, then first GPU use
    path = tmp / "h2d_probe.safetensors"
    mx.save_safetensors(str(path), {"x": mx.array(host)})
    loads = []
    for _ in range(3):
        tic = PERF()
        t = mx.load(str(path))["x"]
        mx.eval(t + 1)
        loads.append(PERF() - tic)
        del t
    out["mx_load_pagecache_to_gpu_GBps"] = host.nbytes / min(loads) / 1e9
    path.unlink()
    mx.clear_cache()
    try:
        import torch

        if torch.cuda.is_available():
            th = torch.from_numpy(host.view(np.int16))
            pinned = th.pin_memory()
            for label, src in (("torch_pageable_h2d_GBps", th), ("torch_pinned_h2d_GBps", pinned)):
                ts = []
                for _ in range(3):
                    torch.cuda.synchronize()
                    tic = PERF()
                    src.to("cuda", non_blocking=label.startswith("torch_pinned"))
                    torch.cuda.synchronize()
                    ts.append(PERF() - tic)
                out[label] = host.nbytes / min(ts) / 1e9
            del pinned
            torch.cuda.empty_cache()
    except Exception as exc:  # reference only
        log(f"torch reference skipped: {exc!r}")
    return out


def tier_bandwidths(cache_dir: Path, max_blocks: int, drop: bool) -> dict[str, float]:
    """Read stored block files with oMLX's SSD tier (cold disk, then page cache) and move
    them onto the GPU the way a restore does (`kv_layout.join_blocks`)."""
    from dataclasses import replace

    import mlx.core as mx

    from omlx.cache.block.kv_layout import KV_STACK, join_blocks
    from omlx.cache.tiers.ssd.tier import SSDTier, read_header

    files = sorted(cache_dir.rglob("*.safetensors"), key=lambda p: p.stat().st_size, reverse=True)
    if not files:
        return {}
    fp = read_header(files[0])["fingerprint"]
    picked = [f for f in files if read_header(f)["fingerprint"] == fp][:max_blocks]
    keys = [f.stem for f in picked]
    nbytes = sum(f.stat().st_size for f in picked)
    out: dict[str, float] = {"blocks": len(keys), "bytes": nbytes}
    for label, cold in (("disk", True), ("pagecache", False)):
        if cold and not (drop and drop_page_cache()):
            continue
        tier = SSDTier(cache_dir, 1 << 40)
        tier.wait_ready(60)
        tic = PERF()
        blocks = tier.get_many(keys, fp)
        t_read = PERF() - tic
        blocks = [b for b in blocks if b is not None]
        first = blocks[0].tensors
        layers = first[KV_STACK].shape[0] // 2 if KV_STACK in first else len(first) // 2
        tic = PERF()
        cat = [c.state[:2] for c in join_blocks([(b, b.token_count) for b in blocks], layers)]
        mx.eval(cat)
        t_dev = PERF() - tic
        out[f"ssd_read_{label}_GBps"] = nbytes / t_read / 1e9
        out[f"to_device_{label}_GBps"] = nbytes / t_dev / 1e9
        out[f"restore_{label}_GBps"] = nbytes / (t_read + t_dev) / 1e9
        # the hot tier's restore: the same join from blocks already on the device
        dev = [replace(b, tensors={k: v + 0 for k, v in b.tensors.items()}) for b in blocks]
        mx.eval([t for d in dev for t in d.tensors.values()])
        tic = PERF()
        cat = [c.state[:2] for c in join_blocks([(d, d.token_count) for d in dev], layers)]
        mx.eval(cat)
        out["hot_restore_GBps"] = nbytes / (PERF() - tic) / 1e9
        tier.close()
        del blocks, dev, cat
        mx.clear_cache()
    return out


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError as exc:
        log(f"could not drop the page cache ({exc}); 'SSD' figures are page-cache reads")
        return False


# ----------------------------------------------------------------------------- the run
def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    ap.add_argument("--parts", default="a,b,c,d,e")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/omlx-bench-gpu"))
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="Folder for the JSON figures, server logs and profiles (default: $OUT where set, as on the "
        "lent GPU machine, whose $OUT comes back; else WORK_DIR/out).",
    )
    ap.add_argument("--decode-tokens", type=int, default=512)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    # rounds of (a) and of (b)/(f): one round's ratio moves with the machine (gpu/README.md),
    # so (a) and (b) alternate server and raw rounds and compare their medians
    ap.add_argument("--repeats", type=int, default=7, help="Rounds of (a), each side (at least 5 for a median).")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--stream-tokens", type=int, default=256)
    ap.add_argument("--stream-repeats", type=int, default=5, help="Rounds of (b) each side, and of (f).")
    ap.add_argument(
        "--references",
        action="store_true",
        help="(a) also times, once each, raw stream_generate in a fresh process, raw BatchGenerator "
        "at batch 1 and oMLX's LLMEngine in this process (no HTTP).",
    )
    ap.add_argument("--client-procs", type=int, default=8)
    ap.add_argument(
        "--one-client-round", action="store_true",
        help="(b) ends with one more server round whose streams all come from one client process (its CPU time reported).",
    )  # fmt: skip
    ap.add_argument("--peer-streams", type=int, default=8, help="Concurrent streams of part (f).")
    ap.add_argument("--ttft-lengths", default="8000,32000")
    ap.add_argument(
        "--new-tokens", type=int, default=64, help="Tokens appended to a cached prompt (c)."
    )
    ap.add_argument("--ttft-samples", type=int, default=3, help="Prompts timed per path and length in (c); the best counts.")
    ap.add_argument(
        "--prefill-step-size",
        type=int,
        default=None,
        help="Passed to omlx serve (default: its own).",
    )
    ap.add_argument("--server-args", default="", help="Extra flags for both servers.")
    ap.add_argument(
        "--server-root", default=None,
        help="An oMLX checkout (e.g. an earlier commit's) whose `omlx serve` the servers run; default this one.",
    )  # fmt: skip
    ap.add_argument("--request-timeout", type=float, default=180.0, help="Seconds before a request counts as hung.")
    ap.add_argument(
        "--py-spy", default=None, help="py-spy executable: profile the server during (a) and (b)."
    )
    ap.add_argument("--raw-worker", help=argparse.SUPPRESS)  # internal: one raw decode in a fresh process
    args = ap.parse_args()
    if args.raw_worker:
        raw_worker(args.raw_worker)
        return
    global REQUEST_TIMEOUT, SERVER_ROOT
    REQUEST_TIMEOUT = args.request_timeout
    if args.server_root:
        SERVER_ROOT = Path(args.server_root).resolve()
    faulthandler.dump_traceback_later(STUCK_AFTER)  # where a stuck run is stuck (`log` re-arms it)
    parts = set(args.parts.split(","))
    work = args.work_dir
    out_dir = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else work / "out")
    out_dir.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    global LOG_FILE
    LOG_FILE = out_dir / f"bench-{args.shape}.log"
    # `timeout` sends SIGTERM: exit through the `finally` blocks, which stop the servers and
    # save their logs and the figures so far
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    import mlx.core as mx
    import mlx_lm
    from mlx_lm import load

    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "shape": args.shape,
        "argv": sys.argv[1:],
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "device": str(mx.default_device()),
        "device_info": {k: v for k, v in mx.device_info().items()}
        if mx.default_device().type == mx.gpu
        else {},
    }
    log(
        f"device {results['device']} {results['device_info'].get('device_name', '')} mlx {mx.__version__}"
    )
    pool = ProcessPoolExecutor(args.client_procs, mp_context=mp.get_context("spawn"))
    list(pool.map(sse_client.ping, range(args.client_procs * 2)))  # start the workers now

    if "e" in parts or "d" in parts:
        try:
            results["device_bw"] = device_bandwidths(work)
        except Exception:
            results["e_error"] = traceback.format_exc()
            log(results["e_error"])
        log(
            f"device bandwidths: {json.dumps({k: round(v, 1) for k, v in results.get('device_bw', {}).items()})}"
        )

    models_root = work / "models"
    model_path = build_model(models_root, args.shape, every_token_streams=True)
    tic = PERF()
    model, tokenizer = load(str(model_path))
    results["raw_load_s"] = PERF() - tic
    ready_for_threads(model)  # the engine of parts (a) and (b) runs on its own thread
    param_bytes, step_bytes = weight_read_bytes(model)
    eos = sorted(set(tokenizer.eos_token_ids or []))
    wl = Workload(args.shape, eos)
    results.update(param_bytes=param_bytes, step_weight_bytes=step_bytes, eos=eos)

    extra = args.server_args.split() if args.server_args else []
    if args.prefill_step_size:
        extra += ["--prefill-step-size", str(args.prefill_step_size)]
    homes = work / "homes"
    shutil.rmtree(homes, ignore_errors=True)
    srv = Server(
        "omlx",
        models_root,
        args.shape,
        homes / "cache",
        # part (c) at 8B stores ~26 GB before its restart and ~5 GB after it: all must stay
        ["--max-concurrent-requests", str(args.streams), "--ssd-cache-max-size", "40GB", *extra],
    )
    servers = [srv]
    nc = None
    if "c" in parts:
        nc = Server(
            "omlx --no-cache",
            models_root,
            args.shape,
            homes / "nocache",
            ["--max-concurrent-requests", str(args.streams), "--no-cache", *extra],
        )
        servers.append(nc)
        # no SSD, and a hot tier of 1.25 prompts of the longest length: part (c) pushes a prompt
        # out to RAM with two new ones before each RAM restore, which moves it back
        longest = max(int(x) for x in args.ttft_lengths.split(",") if x) + args.new_tokens
        hot_bytes = int(1.25 * longest * kv_bytes_per_token(args.shape))
        ram = Server(
            "omlx RAM tier",
            models_root,
            args.shape,
            homes / "ram",
            ["--max-concurrent-requests", str(args.streams), "--hot-cache-only", "--hot-cache-max-size",
             str(hot_bytes), "--ram-cache-max-size", "32GB", *extra],
        )  # fmt: skip
        servers.append(ram)
    peer = None
    if "f" in parts:
        n = str(args.peer_streams)
        peer = PeerServer("mlx_lm.server", models_root, args.shape, homes / "peer",
                          ["--decode-concurrency", n, "--prompt-concurrency", n])  # fmt: skip
        servers.append(peer)
    for s in servers:
        s.start()
    spy = PySpy(args.py_spy, out_dir)
    try:
        for s in servers:
            results[f"server_load_s[{s.label}]"] = s.wait_ready()
        log(f"servers up: {[s.url for s in servers]}")

        # warm-up: kernels are compiled on first use (per process)
        prompt_a = wl.prompt(args.prompt_tokens)
        # full length: the KV cache grows in steps of 256, each new shape compiles once
        warm_tokens = args.decode_tokens if ("a" in parts or "d" in parts) else 32
        warm_text = wl.text(tokenizer, args.prompt_tokens)
        chat_parts, other_parts = parts & {"a", "b", "d", "s"}, parts - {"a", "b", "d", "s"}
        if chat_parts:
            raw_decode(model, tokenizer, chat_ids(tokenizer, warm_text), warm_tokens, eos, with_procs=False)
        if other_parts:  # (c)'s raw prefill
            raw_decode(model, tokenizer, prompt_a, warm_tokens, eos)
        if args.references and ("a" in parts or "d" in parts):
            raw_batch_decode(model, prompt_a, warm_tokens, eos)
        log("raw warm")
        if "b" in parts:
            warm_ids = [chat_ids(tokenizer, wl.text(tokenizer, args.prompt_tokens)) for _ in range(args.streams)]
            raw_batch(model, warm_ids, 8, eos, args.prefill_step_size or 512, with_procs=False)
        for s in servers:
            if s is peer:  # warmed up by part (f) itself, on its own text prompts
                continue
            if chat_parts:
                one(s.url, wl.chat_body(warm_text, warm_tokens))
            if other_parts:  # the token-id completions of (c) and (g)
                one(s.url, wl.body(prompt_a, warm_tokens))
            log(f"{s.label} warm (1 stream)")
            if "b" in parts or "s" in parts:
                texts = [wl.text(tokenizer, args.prompt_tokens) for _ in range(args.streams)]
                bodies = [wl.chat_body(t, 8) for t in texts]
                if "s" in parts:  # a grammar's first compile and the held rows' masks
                    for b in bodies[: args.streams // 2]:
                        b["response_format"] = REPORT_FORMAT
                server_batch(pool, s.url, bodies, args.client_procs)
        log("warm")

        def save() -> None:
            (out_dir / f"results-{args.shape}.json").write_text(
                json.dumps(results, indent=2, default=str)
            )

        if "a" in parts or "d" in parts:
            try:
                results["a"] = part_a(args, wl, model, tokenizer, model_path, srv, spy)
                if "device_bw" in results:
                    results["d"] = part_d(args, results["a"], results["device_bw"], step_bytes)
            except Exception:
                dump_servers(args.py_spy, servers)
                results["a_error"] = traceback.format_exc()
                log(results["a_error"])
            save()

        if "b" in parts:
            try:
                results["b"] = part_b(args, wl, model, tokenizer, srv, pool, spy)
            except Exception:
                dump_servers(args.py_spy, servers)
                results["b_error"] = traceback.format_exc()
                log(results["b_error"])
            save()

        def run_part(name: str, part: Any) -> None:
            """`results[name] = part()`; a failure is logged with every server's stacks, and
            the parts after it still run."""
            if name not in parts:
                return
            try:
                results[name] = part()
            except Exception:
                dump_servers(args.py_spy, servers)
                results[f"{name}_error"] = traceback.format_exc()
                log(results[f"{name}_error"])
            save()

        run_part("s", lambda: part_s(args, wl, tokenizer, srv, pool))
        run_part("f", lambda: part_f(args, wl, tokenizer, pool, srv, peer))
        if "c" in parts:
            results["c"] = {}  # filled as it goes: a failed row keeps the rows before it
        run_part("c", lambda: part_c(args, wl, model, tokenizer, srv, nc, ram, results["c"]))
        run_part("g", lambda: part_g(args, wl, models_root, homes, extra, servers))
    finally:
        # what was measured so far (a row of (c) lands in `results` as it ends), then the logs
        (out_dir / f"results-{args.shape}.json").write_text(json.dumps(results, indent=2, default=str))
        with open(out_dir / f"servers-{args.shape}.log", "w") as logs:
            for s in servers:
                s.stop()
                for log_file in sorted(s.home.glob("server-*.log")):
                    logs.write(
                        f"===== {s.label}: {log_file.name}\n{log_file.read_text(errors='replace')}\n"
                    )
        pool.shutdown()
    (out_dir / f"results-{args.shape}.json").write_text(json.dumps(results, indent=2, default=str))
    print_table(results)


SPLIT = ("graph_build", "launch", "device_wait", "cache", "host", "engine_cpu", "event_loop_cpu")


def step_split(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, float] | None:
    """Milliseconds per engine step (decode-only loops) of each part between two `step_times`,
    and tokens per step; None where the server does not report them."""
    if not before or not after or after["loops"] <= before["loops"]:
        return None
    loops = after["loops"] - before["loops"]
    split = {"tokens_per_step": (after["tokens"] - before["tokens"]) / loops}
    for part in SPLIT:
        a, b = after.get(f"{part}_s"), before.get(f"{part}_s")
        if a is not None and b is not None:
            split[f"{part}_ms"] = 1000 * (a - b) / loops
    return split


def median_split(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    """Each part's median over the rounds that reported a split."""
    splits = [x["split"] for x in rows if x.get("split")]
    if not splits:
        return None
    return {key: statistics.median(s[key] for s in splits if key in s) for key in splits[0]}


def split_line(split: dict[str, float] | None) -> str:
    if not split:
        return "no step split (the server does not report step_times)"
    parts = ", ".join(f"{p.replace('_', ' ')} {split[f'{p}_ms']:.2f}" for p in SPLIT if f"{p}_ms" in split)
    return f"ms per engine step ({split['tokens_per_step']:.1f} tokens each), medians: {parts}"


def median_ratio(ours: list[float], raw: list[float]) -> dict[str, float]:
    """Medians, bests and the two ratios of a server's rounds against raw's."""
    m_ours, m_raw = statistics.median(ours), statistics.median(raw)
    return {"omlx_median": m_ours, "raw_median": m_raw, "ratio": m_ours / m_raw if m_raw else 0.0,
            "omlx_best": max(ours), "raw_best": max(raw), "best_ratio": max(ours) / max(raw) if max(raw) else 0.0}  # fmt: skip


def settle(srv: Server) -> None:
    """Until the server has stored what its last requests left (the SSD writer checksums and
    copies on the host, up to ~1 GB after 32 streams at 8B): a raw round then competes with
    nothing of the server's."""
    srv.wait_idle()
    srv.wait_ssd_writes()


def part_a(
    args: Any, wl: Workload, model: Any, tokenizer: Any, model_path: Path, srv: Server, spy: PySpy
) -> dict[str, Any]:
    """Batch-1 decode: a streamed chat completion through the server, then raw
    `stream_generate` on the same kind of prompt (new text each, rendered by the model's chat
    template), `--repeats` times in turn; the ratio is of the medians."""
    n, eos = args.decode_tokens, wl.eos
    rows = []
    for r in range(args.repeats):
        if r == args.repeats - 1:
            spy.start(srv.proc.pid, f"{args.shape}-a", 120)
        before = srv.step_times()
        rec = one(srv.url, wl.chat_body(wl.text(tokenizer, args.prompt_tokens), n))
        spy.stop()
        split = step_split(before, srv.step_times())
        settle(srv)
        ids = chat_ids(tokenizer, wl.text(tokenizer, args.prompt_tokens))
        raw = raw_decode(model, tokenizer, ids, n, eos, with_procs=False)
        ours = stream_rate(rec)
        rows.append({"omlx_tps": ours, "raw_tps": raw["tps"], "omlx_tokens": rec["completion_tokens"],
                     "raw_tokens": raw["tokens"], "omlx_prompt_tokens": rec["prompt_tokens"],
                     "raw_prompt_tokens": len(ids), "omlx_text_chunks": len(rec["times"]),
                     "omlx_ttft": rec["times"][0] - rec["sent"], "raw_ttft": raw["ttft"], "split": split,
                     "raw_build_ms": raw["build_ms"]})  # fmt: skip
        log(f"(a) round {r}: server {ours:.1f} tok/s ({rec['completion_tokens']} tokens), raw stream_generate "
            f"{raw['tps']:.1f} tok/s ({raw['tokens']}) -> {ours / raw['tps']:.3f}x; graph build ms/token: server "
            f"{(split or {}).get('graph_build_ms', float('nan')):.2f}, raw {raw['build_ms']:.2f}")  # fmt: skip
    a: dict[str, Any] = {"rounds": rows, "decode_tokens": n, "prompt_tokens": args.prompt_tokens,
                         **median_ratio([x["omlx_tps"] for x in rows], [x["raw_tps"] for x in rows]),
                         "split": median_split(rows), "raw_build_ms": statistics.median(x["raw_build_ms"] for x in rows)}  # fmt: skip
    log(f"(a) {split_line(a['split'])}; raw stream_generate's graph build {a['raw_build_ms']:.2f} ms per token")
    if args.references:
        prompt = chat_ids(tokenizer, wl.text(tokenizer, args.prompt_tokens))
        a["raw_fresh_process_tps"] = raw_decode_fresh_process(model_path, prompt, n, eos)
        a["raw_batchgen_tps"] = raw_batch_decode(model, prompt, n, eos)
        a["engine_tps"] = engine_decode(model, tokenizer, prompt, n, eos)["tps"]
        log(f"(a) references: raw stream_generate in a fresh process {a['raw_fresh_process_tps']:.1f}, raw "
            f"BatchGenerator {a['raw_batchgen_tps']:.1f}, LLMEngine in this process {a['engine_tps']:.1f} tok/s")  # fmt: skip
    return a


def part_d(args: Any, a: dict[str, Any], device_bw: dict[str, float], step_bytes: int) -> dict[str, Any]:
    """(a)'s medians as fractions of the HBM floor: weight + KV bytes read per step / copy bandwidth."""
    bw = device_bw["hbm_copy_GBps"] * 1e9
    per_step = step_bytes + kv_bytes_per_token(args.shape) * (args.prompt_tokens + args.decode_tokens / 2)
    floor = bw / per_step
    log(f"(d) HBM floor {floor:.0f} tok/s: raw {a['raw_median'] / floor:.2f}, omlx {a['omlx_median'] / floor:.2f}")
    return {"hbm_GBps": bw / 1e9, "bytes_per_step": per_step, "floor_tps": floor,
            "raw_fraction": a["raw_median"] / floor, "omlx_fraction": a["omlx_median"] / floor}  # fmt: skip


def part_b(
    args: Any, wl: Workload, model: Any, tokenizer: Any, srv: Server, pool: Any, spy: PySpy
) -> dict[str, Any]:
    """`--streams` concurrent streamed chat completions through the server, then raw
    `BatchGenerator` on as many new prompts of the same kind, `--stream-repeats` times in
    turn; aggregate (send to last token) and steady (all streams decoding) rates by medians."""
    k, n = args.streams, args.stream_tokens
    rows = []
    for r in range(args.stream_repeats):
        texts = [wl.text(tokenizer, args.prompt_tokens) for _ in range(k)]
        if r == args.stream_repeats - 1:
            spy.start(srv.proc.pid, f"{args.shape}-b", 120)
        before = srv.step_times()
        ours = server_batch(pool, srv.url, [wl.chat_body(t, n) for t in texts], args.client_procs)
        spy.stop()
        ours["split"] = step_split(before, srv.step_times())
        settle(srv)
        ids = [chat_ids(tokenizer, wl.text(tokenizer, args.prompt_tokens)) for _ in range(k)]
        raw = raw_batch(model, ids, n, wl.eos, args.prefill_step_size or 512, with_procs=False)
        rows.append({"omlx": ours, "raw": raw})
        log(f"(b) round {r}: server {ours['aggregate_tps']:.0f} tok/s (steady {ours['steady_tps']:.0f}), raw "
            f"BatchGenerator {raw['aggregate_tps']:.0f} tok/s (steady {raw['steady_tps']:.0f}) "
            f"-> {ours['aggregate_tps'] / raw['aggregate_tps']:.3f}x; graph build ms/step: server "
            f"{(ours['split'] or {}).get('graph_build_ms', float('nan')):.2f}, raw {raw['build_ms']:.2f} "
            "(raw's steps include its prefill)")  # fmt: skip
    side = lambda who, key: [x[who][key] for x in rows]  # noqa: E731
    steady = median_ratio(side("omlx", "steady_tps"), side("raw", "steady_tps"))
    split = median_split([x["omlx"] for x in rows])
    raw_build = statistics.median(x["raw"]["build_ms"] for x in rows)
    log(f"(b) {split_line(split)}; raw BatchGenerator's graph build {raw_build:.2f} ms per step")
    b = {"rounds": rows, "streams": k, "stream_tokens": n, "split": split, "raw_build_ms": raw_build,
         **median_ratio(side("omlx", "aggregate_tps"), side("raw", "aggregate_tps")),
         **{f"steady_{key}": v for key, v in steady.items()}}  # fmt: skip
    if args.one_client_round:  # a diagnostic: the same streams from one client process's threads
        settle(srv)
        texts = [wl.text(tokenizer, args.prompt_tokens) for _ in range(k)]
        b["one_client_process"] = single = server_batch(pool, srv.url, [wl.chat_body(t, n) for t in texts], 1)
        log(f"(b) one client process of {k} threads: {single['aggregate_tps']:.0f} tok/s, its CPU "
            f"{single['client_cpu_s']:.2f}s over {single['wall_s']:.2f}s")  # fmt: skip
    return b


# a report whose text outlasts any token budget here: a held stream's grammar is live on every token
REPORT_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "report",
        "schema": {
            "type": "object",
            "properties": {"title": {"type": "string", "maxLength": 40}, "report": {"type": "string", "minLength": 8000}},
            "required": ["title", "report"],
        },
    },
}


def part_s(args: Any, wl: Workload, tokenizer: Any, srv: Server, pool: Any) -> dict[str, Any]:
    """`--streams` concurrent streamed chat completions, half of them with a JSON-schema
    `response_format`, against all of them free, on the same server, `--stream-repeats` rounds
    in alternating order; aggregate tok/s by medians and the step split of each side."""
    k, n = args.streams, args.stream_tokens
    rows = []
    for r in range(args.stream_repeats):
        row: dict[str, Any] = {}
        for held in (0, k // 2) if r % 2 == 0 else (k // 2, 0):
            bodies = [wl.chat_body(wl.text(tokenizer, args.prompt_tokens), n) for _ in range(k)]
            for b in bodies[:held]:
                b["response_format"] = REPORT_FORMAT
            settle(srv)
            before = srv.step_times()
            res = server_batch(pool, srv.url, bodies, args.client_procs)
            res["split"] = step_split(before, srv.step_times())
            heads = res.pop("heads")
            res["held_heads"] = sorted({h[:12] for h in heads[:held]})
            row["half" if held else "free"] = res
        if row["half"]["tokens"] != k * n or row["free"]["tokens"] != k * n:
            log(f"(s) warning: {row['half']['tokens']} / {row['free']['tokens']} tokens, not {k * n}")
        rows.append(row)
        build = lambda who, row=row: (row[who]["split"] or {}).get("graph_build_ms", float("nan"))  # noqa: E731
        log(f"(s) round {r}: half held {row['half']['aggregate_tps']:.0f} tok/s, all free "
            f"{row['free']['aggregate_tps']:.0f} -> {row['half']['aggregate_tps'] / row['free']['aggregate_tps']:.3f}x; "
            f"graph build ms/step {build('half'):.2f} vs {build('free'):.2f}; held answers open with "
            f"{row['half']['held_heads'][:3]}")  # fmt: skip
    side = lambda who: [x[who]["aggregate_tps"] for x in rows]  # noqa: E731
    return {"rounds": rows, "streams": k, "held": k // 2, "stream_tokens": n,
            "split_half": median_split([x["half"] for x in rows]),
            "split_free": median_split([x["free"] for x in rows]),
            **median_ratio(side("half"), side("free"))}  # fmt: skip


def part_f(args: Any, wl: Workload, tokenizer: Any, pool: Any, ours: Server, peer: Server) -> dict[str, Any]:
    """oMLX vs `mlx_lm.server` on the same text prompts: batch-1 and N-stream decode."""
    n = args.peer_streams

    def body(server: Server, text: str, max_tokens: int) -> dict[str, Any]:
        b = wl.body([], max_tokens)
        b["prompt"] = text
        b["model"] = args.shape if server is ours else "default_model"
        return b

    def texts(k: int) -> list[str]:
        return [tokenizer.decode(wl.prompt(args.prompt_tokens)) for _ in range(k)]

    for s in (ours, peer):  # same warm-up for both: kernels compile per process and shape
        one(s.url, body(s, texts(1)[0], args.decode_tokens))
        server_batch(pool, s.url, [body(s, t, 8) for t in texts(n)], args.client_procs)
    rows = []
    for r in range(args.stream_repeats):
        row: dict[str, Any] = {}
        for label, s in (("omlx", ours), ("peer", peer)):
            rec = one(s.url, body(s, texts(1)[0], args.decode_tokens))
            batch = server_batch(pool, s.url, [body(s, t, args.stream_tokens) for t in texts(n)], args.client_procs)
            row[label] = {"b1_tps": stream_rate(rec), "b1_ttft": rec["times"][0] - rec["sent"], **batch}
        rows.append(row)
        log(
            f"(f) round {r}: batch-1 omlx {row['omlx']['b1_tps']:.1f} vs mlx_lm.server {row['peer']['b1_tps']:.1f} tok/s; "
            f"{n} streams omlx {row['omlx']['aggregate_tps']:.0f} vs {row['peer']['aggregate_tps']:.0f} tok/s "
            f"(TTFT {row['omlx']['mean_ttft']:.3f} vs {row['peer']['mean_ttft']:.3f} s)"
        )
    best = lambda side, key: max(x[side][key] for x in rows)  # noqa: E731
    out = {"rounds": rows, "streams": n, "stream_tokens": args.stream_tokens}
    for key in ("b1_tps", "aggregate_tps", "steady_tps"):
        out[f"omlx_{key}"], out[f"peer_{key}"] = best("omlx", key), best("peer", key)
        out[f"{key}_ratio"] = out[f"omlx_{key}"] / out[f"peer_{key}"] if out[f"peer_{key}"] else 0.0
    return out


def part_g(
    args: Any, wl: Workload, models_root: Path, homes: Path, extra: list[str], servers: list[Any]
) -> dict[str, Any]:
    """The first prompt of the longest `--ttft-lengths` after a `--no-cache` server starts: MLX
    builds an attention graph per prefill chunk shape on first use (~40 ms each on an H200),
    unless the idle engine's warm-up (omlx/engine/graph_warmup.py) built them already. Each
    server gets the usual short warm-up request first (kernels), then waits for the graph
    warm-up to finish (status), then two new prompts of that length: the first and a warm one."""
    n = max(int(x) for x in args.ttft_lengths.split(",") if x)
    g: dict[str, Any] = {"prompt_tokens": n}
    for label, flags in (("off", ["--graph-warmup-tokens", "0"]), ("on", [])):
        s = Server(f"omlx --no-cache, graph warm-up {label}", models_root, args.shape, homes / f"g-{label}",
                   ["--no-cache", *extra, *flags])  # fmt: skip
        servers.append(s)
        s.start()
        try:
            row: dict[str, Any] = {"load_s": s.wait_ready()}
            ttft(s.url, wl.body(wl.prompt(args.prompt_tokens), 2))
            tic = PERF()
            progress = s.wait_warmed()
            row.update(warmup=progress, waited_s=PERF() - tic)
            row["first"], _ = ttft(s.url, wl.body(wl.prompt(n), 2))
            row["second"], _ = ttft(s.url, wl.body(wl.prompt(n), 2))
            g[label] = row
            log(f"(g) graph warm-up {label}: first {n}-token prompt {row['first']:.3f}s, second {row['second']:.3f}s "
                f"(warm-up {progress}, waited {row['waited_s']:.2f}s)")  # fmt: skip
        finally:
            s.stop()
    g["first_ratio"] = g["on"]["first"] / g["off"]["first"]
    return g


def part_c(
    args: Any, wl: Workload, model: Any, tokenizer: Any, srv: Server, nc: Server, ram: Server, c: dict[str, Any]
) -> dict[str, Any]:
    """TTFT of prompts of each `--ttft-lengths` on every path, `--ttft-samples` (m) new prompts
    or suffixes each, the best of them per path (the same server's prefill of one length moved
    by up to ±10% between requests on the H200). Each cache row is compared with the
    `--no-cache` row of the same prompt lengths: a miss with fresh prompts of n tokens, hot and
    RAM restores with n + `--new-tokens` ones, the SSD after a restart with a restarted
    `--no-cache` server."""
    lengths = [int(x) for x in args.ttft_lengths.split(",") if x]
    k, m = args.new_tokens, args.ttft_samples
    c.update({"lengths": lengths, "new_tokens": k, "samples": m, "rows": {}})
    prompts: dict[int, dict[str, list[list[int]]]] = {}

    def quiet() -> None:
        """Every server done with its background work (the cache server's SSD writes checksum
        and copy GBs on the host: at 8B, a --no-cache prefill timed while they ran came out
        ~10% slower) and its graph warm-up, so that a timed request competes with nothing."""
        srv.wait_ssd_writes()
        ram.wait_demoted()
        for s in (nc, srv, ram):
            s.wait_idle()
            s.wait_warmed()

    def timed(
        server: Server, bodies: list[list[int]], row: dict[str, Any], name: str, before: Any = None
    ) -> None:
        """`row[name]`: the best TTFT of `bodies` on `server`, each sent once every server is
        quiet (after `before()`); every sample and the tokens each found cached are kept too."""
        got = []
        for b in bodies:
            if before is not None:
                before()
            quiet()
            got.append(ttft(server.url, wl.body(b, 2)))
        row[name] = min(t for t, _ in got)
        row[f"{name}_samples"] = [round(t, 4) for t, _ in got]
        row[f"{name}_cached_tokens"] = [n for _, n in got]

    for n in lengths:
        p = {"warm": [wl.prompt(n)], "P": [wl.prompt(n) for _ in range(m)]}
        p.update({name: [wl.prompt(k) for _ in range(m)] for name in ("X", "H", "R", "S", "Z")})
        prompts[n] = p
        P, row = p["P"], {}
        raw_decode(model, tokenizer, p["warm"][0], 1, wl.eos)  # same shapes, so kernels are ready
        row["raw_mlx_lm_ttft"] = min(raw_decode(model, tokenizer, q, 1, wl.eos)["ttft"] for q in P[:2])
        # warm every server for this length: prefill shapes, then a restore of n + k tokens
        for s in (nc, srv, ram):
            ttft(s.url, wl.body(p["warm"][0], 2))
            ttft(s.url, wl.body(p["warm"][0] + p["X"][0], 2))
        timed(nc, P, row, "nocache_cold")
        timed(srv, P, row, "cache_miss")  # the same prompts: new to this server
        # restores extend the prompt stored last (the hot tier's least likely to have let go)
        timed(nc, [P[-1] + x for x in p["H"]], row, "nocache_extended")
        timed(srv, [P[-1] + x for x in p["H"]], row, "hot_restore")
        quiet()
        ttft(ram.url, wl.body(P[-1], 2))  # a miss, stored in the hot tier

        def to_ram() -> None:
            """Two new prompts of the longest length push P[-1] out of the RAM server's hot tier;
            its idle engine copies the blocks to RAM (`quiet` waits for that)."""
            for _ in range(2):
                ttft(ram.url, wl.body(wl.prompt(max(lengths)), 2))

        warm_before = ram.cache_stats().get("warm", {})
        timed(ram, [P[-1] + x for x in p["R"]], row, "ram_restore", before=to_ram)
        warm_after = ram.cache_stats().get("warm", {})
        # RAM's hits are the blocks restored from it (moved back to the hot tier)
        row["ram_restore_blocks"] = warm_after.get("hits", 0) - warm_before.get("hits", 0)
        c["rows"][n] = row
        log(
            f"(c) {n} tokens: raw {row['raw_mlx_lm_ttft']:.3f}s  nocache {row['nocache_cold']:.3f}s  "
            f"miss {row['cache_miss']:.3f}s  nocache +{k} {row['nocache_extended']:.3f}s  "
            f"hot {row['hot_restore']:.3f}s (cached per sample {row['hot_restore_cached_tokens']})  "
            f"RAM {row['ram_restore']:.3f}s (cached per sample {row['ram_restore_cached_tokens']}, "
            f"{row['ram_restore_blocks']} blocks from RAM)"
        )
    srv.wait_ssd_writes()
    c["ssd_stats_before_restart"] = srv.cache_stats()
    # Both servers restart: a fresh process pays first-use costs (device allocations, kernel
    # loads) on its first prompts of each length whether it restores them or not, so the SSD
    # rows compare against a --no-cache server just as fresh.
    srv.stop()
    nc.stop()
    c["page_cache_dropped"] = drop_page_cache()
    srv.start()
    nc.start()
    c["restart_load_s"] = srv.wait_ready()
    nc.wait_ready()
    for s in (srv, nc):
        ttft(s.url, wl.body(wl.prompt(args.prompt_tokens), 2))  # kernels
        s.wait_warmed()
    # A new prompt of each row's length on both: its prefill from depth 0 builds the attention
    # graphs (~40 ms each on an H200) of the chunks the rows' prompts end in. Without it the
    # --no-cache server built them on its first row request, and the cache server, whose first
    # request starts at its restored depth, on its second (eighth session: +0.045 s at 8k,
    # +0.089 s at 32k: one and two graphs).
    for n in lengths:
        for s in (srv, nc):
            ttft(s.url, wl.body(wl.prompt(n + k), 2))
    for n in lengths:
        p, row = prompts[n], c["rows"][n]
        # each of the row's prompts was stored by its miss: restored from the SSD, or recomputed
        timed(srv, [q + x for q, x in zip(p["P"], p["S"], strict=True)], row, "ssd_restore")
        timed(nc, [q + x for q, x in zip(p["P"], p["Z"], strict=True)], row, "nocache_restarted")
        pairs = {"cache_miss": "nocache_cold", "hot_restore": "nocache_extended",
                 "ram_restore": "nocache_extended", "ssd_restore": "nocache_restarted"}  # fmt: skip
        row["slower_with_cache"] = [name for name, base in pairs.items() if row[name] > row[base] * 1.05]
        # the issue's bar is per request: any cache sample slower than the slowest of its baseline
        row["slower_with_cache_any_sample"] = [
            name for name, base in pairs.items() if max(row[f"{name}_samples"]) > max(row[f"{base}_samples"]) * 1.05
        ]
        log(
            f"(c) {n} tokens after restart: ssd {row['ssd_restore']:.3f}s "
            f"({row['ssd_restore_samples']}, cached per sample {row['ssd_restore_cached_tokens']}) "
            f"vs a restarted --no-cache server {row['nocache_restarted']:.3f}s ({row['nocache_restarted_samples']})"
        )
    c["cache_stats_after"] = srv.cache_stats()
    srv.wait_ssd_writes()
    srv.stop()
    c["tiers"] = tier_bandwidths(srv.home / "cache", max_blocks=max(lengths) // 256, drop=True)
    log(f"(c) tiers: {json.dumps({k: round(v, 2) for k, v in c['tiers'].items()})}")
    srv.start()  # the finally block stops it again
    srv.wait_ready()
    return c


def print_table(r: dict[str, Any]) -> None:
    print(
        f"\n== {r['shape']} on {r['device_info'].get('device_name', r['device'])}, MLX {r['mlx']}, mlx-lm {r['mlx_lm']} =="
    )
    if "a" in r:
        a = r["a"]
        print(f"(a) batch-1 decode, {a['decode_tokens']} tokens, {len(a['rounds'])} rounds each, server then raw:")
        for i, x in enumerate(a["rounds"]):
            print(f"    round {i}: server {x['omlx_tps']:.1f} tok/s | raw stream_generate {x['raw_tps']:.1f} tok/s "
                  f"| {x['omlx_tps'] / x['raw_tps']:.3f}x")  # fmt: skip
        print(f"    medians: server {a['omlx_median']:.1f} | raw {a['raw_median']:.1f} | ratio {a['ratio']:.3f} "
              f"(goal >= 0.95); best {a['omlx_best']:.1f} / {a['raw_best']:.1f} = {a['best_ratio']:.3f}")  # fmt: skip
        print(f"    {split_line(a.get('split'))}; raw's graph build {a.get('raw_build_ms', float('nan')):.2f}")
        if "engine_tps" in a:
            print(f"    references: raw in a fresh process {a['raw_fresh_process_tps']:.1f}, raw BatchGenerator "
                  f"{a['raw_batchgen_tps']:.1f}, LLMEngine in-process {a['engine_tps']:.1f} tok/s")  # fmt: skip
    if "b" in r:
        b = r["b"]
        print(f"(b) {b['streams']} streams x {b['stream_tokens']} tokens, {len(b['rounds'])} rounds each, "
              "server then raw BatchGenerator (aggregate tok/s, steady in brackets):")  # fmt: skip
        for i, x in enumerate(b["rounds"]):
            o, w = x["omlx"], x["raw"]
            print(f"    round {i}: server {o['aggregate_tps']:.0f} ({o['steady_tps']:.0f}) | raw "
                  f"{w['aggregate_tps']:.0f} ({w['steady_tps']:.0f}) | {o['aggregate_tps'] / w['aggregate_tps']:.3f}x")  # fmt: skip
        print(f"    medians: server {b['omlx_median']:.0f} | raw {b['raw_median']:.0f} | ratio {b['ratio']:.3f} "
              f"(goal >= 0.9); steady {b['steady_omlx_median']:.0f} vs {b['steady_raw_median']:.0f} "
              f"({b['steady_ratio']:.3f}); best {b['omlx_best']:.0f} / {b['raw_best']:.0f} = {b['best_ratio']:.3f}")  # fmt: skip
        print(f"    {split_line(b.get('split'))}; raw's graph build {b.get('raw_build_ms', float('nan')):.2f}")
    if "s" in r:
        x = r["s"]
        print(f"(s) {x['streams']} streams x {x['stream_tokens']} tokens, {x['held']} held to a JSON schema vs all free, "
              f"{len(x['rounds'])} rounds (aggregate tok/s):")  # fmt: skip
        for i, row in enumerate(x["rounds"]):
            h, f = row["half"], row["free"]
            print(f"    round {i}: half held {h['aggregate_tps']:.0f} | all free {f['aggregate_tps']:.0f} | "
                  f"{h['aggregate_tps'] / f['aggregate_tps']:.3f}x | held answers open with {h['held_heads'][:2]}")  # fmt: skip
        print(f"    medians: half held {x['omlx_median']:.0f} | all free {x['raw_median']:.0f} | ratio {x['ratio']:.3f} "
              f"(goal >= 0.9); best {x['omlx_best']:.0f} / {x['raw_best']:.0f} = {x['best_ratio']:.3f}")  # fmt: skip
        print(f"    half held: {split_line(x.get('split_half'))}")
        print(f"    all free:  {split_line(x.get('split_free'))}")
    if "c" in r:
        for n, row in r["c"].get("rows", {}).items():
            print(
                f"(c) {n:>6} tok TTFT: raw {row['raw_mlx_lm_ttft']:.3f}s | no-cache {row['nocache_cold']:.3f}s | "
                f"miss {row['cache_miss']:.3f}s | no-cache +{r['c']['new_tokens']} {row['nocache_extended']:.3f}s | "
                f"hot {row['hot_restore']:.3f}s | RAM {row.get('ram_restore', float('nan')):.3f}s | SSD after restart "
                f"{row.get('ssd_restore', float('nan')):.3f}s vs no-cache restarted "
                f"{row.get('nocache_restarted', float('nan')):.3f}s | slower with cache: {row.get('slower_with_cache')} "
                f"(best samples), {row.get('slower_with_cache_any_sample')} (any sample vs the slowest without)"
            )
        if r["c"].get("tiers"):
            t = r["c"]["tiers"]
            print(
                "(c) tiers GB/s: "
                + ", ".join(f"{k} {v:.2f}" for k, v in t.items() if k.endswith("GBps"))
            )
    if "f" in r:
        f = r["f"]
        print(
            f"(f) vs mlx_lm.server: batch-1 {f['omlx_b1_tps']:.1f} vs {f['peer_b1_tps']:.1f} tok/s "
            f"({f['b1_tps_ratio']:.3f}x); {f['streams']} streams x {f['stream_tokens']} aggregate "
            f"{f['omlx_aggregate_tps']:.0f} vs {f['peer_aggregate_tps']:.0f} tok/s ({f['aggregate_tps_ratio']:.3f}x, "
            f"goal >= 1.2); steady {f['omlx_steady_tps']:.0f} vs {f['peer_steady_tps']:.0f}"
        )
    if "g" in r:
        g = r["g"]
        print(
            f"(g) first {g['prompt_tokens']}-token prompt after a start: graph warm-up off {g['off']['first']:.3f}s "
            f"(second {g['off']['second']:.3f}s) | on {g['on']['first']:.3f}s (second {g['on']['second']:.3f}s) "
            f"| ratio {g['first_ratio']:.3f}"
        )
    if "d" in r:
        d = r["d"]
        print(
            f"(d) HBM {d['hbm_GBps']:.0f} GB/s, {d['bytes_per_step'] / 1e9:.2f} GB/step -> floor {d['floor_tps']:.0f} tok/s; "
            f"raw {d['raw_fraction']:.2f}, omlx {d['omlx_fraction']:.2f} of it"
        )
    if "device_bw" in r:
        print("(e) " + ", ".join(f"{k} {v:.1f}" for k, v in r["device_bw"].items()))


if __name__ == "__main__":
    main()
