"""Screenshot-agent trace on a vision model, side by side in one run: oMLX vs oMLX --no-cache vs
mlx-vlm's own server (`mlx_vlm.server`).

Each round is one session of T turns: a system prompt, the first user turn carrying a screenshot
(re-sent every turn, as agents do), then each turn appends the previous answer (a fixed text, so
every server sees the same prompts) and a new user message. The metric is the mean time to the
first streamed token over the turns; each round uses a new image (no hits across rounds); the
table shows best and median over rounds and the ratios. Every server first answers one unrelated
request (kernels compiled outside the measurement).

    .venv/bin/python benchmarks/bench_vision.py --peer-python /path/to/venv/bin/python
    .venv/bin/python benchmarks/bench_vision.py --quick

`--peer-python` names an interpreter with the full `mlx-vlm` install (its server needs mlx-audio,
which oMLX's own install leaves out: docs/design/vision.md); without it the peer is skipped. The
model is a tiny random-weight Qwen2-VL built here (tests/support/tiny_vlm.py) unless --model.
"""

from __future__ import annotations

import argparse
import base64
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import bench_env  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A server child process on a free loopback port, ready once `ready_path` answers 200."""

    def __init__(self, label: str, cmd: list[str], ready_path: str, model_name: str, env: dict[str, str]):
        self.label, self.model_name, self.port = label, model_name, free_port()
        self.log = tempfile.NamedTemporaryFile(prefix=f"bench-vision-{label.replace(' ', '_')}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([*cmd, "--port", str(self.port)], stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{label} exited; log: {self.log.name}")
            try:
                if httpx.get(self.url + ready_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{label} did not start; log: {self.log.name}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ttft(self, messages: list[dict], max_tokens: int) -> float:
        """Seconds to the first streamed chunk carrying text."""
        body = {"model": self.model_name, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        tic = time.perf_counter()
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[6:]).get("choices") or [{}]
                if (choices[0].get("delta") or {}).get("content"):
                    return time.perf_counter() - tic
        raise RuntimeError(f"{self.label}: no text streamed")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def screenshot(seed: int, size: int) -> str:
    """A data URL of a PNG drawn like a window with text lines (differs per seed)."""
    import io
    import random

    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    img = Image.new("RGB", (size, size), (240, 240, 240))
    d = ImageDraw.Draw(img)
    d.rectangle((0, 0, size, size // 12), fill=(rng.randrange(256), 60, 120))
    for y in range(size // 8, size, size // 16):
        d.text((size // 20, y), " ".join(rng.choice(["def", "error", "line", "ok", "fail", "x"]) for _ in range(6)), fill=(0, 0, 0))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def trace(image: str, turns: int, words: int) -> list[list[dict]]:
    """The messages of each turn of one session."""
    from tests.support.tiny_model import CORPUS

    text = " ".join(CORPUS)
    system = {"role": "system", "content": "You are a coding agent. " + text[: words * 6]}
    first = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                         {"type": "text", "text": "Here is the screen. What failed?"}]}  # fmt: skip
    messages, out = [system, first], []
    for t in range(turns):
        out.append([*messages])
        messages += [{"role": "assistant", "content": f"Step {t}: the test on line {t * 7} failed."},
                     {"role": "user", "content": f"Fix it and look again (turn {t + 1}). " + text[: words]}]  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a Qwen2-VL folder (default: a tiny random-weight one built here)")
    ap.add_argument("--peer-python", help="python of a venv with the full mlx-vlm (for mlx_vlm.server)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--image-size", type=int, default=448)
    ap.add_argument("--words", type=int, default=300, help="about this many words of system prompt")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="1 round, 2 turns, a 224-pixel image")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.turns, args.image_size = 1, 2, 224
    work = Path(tempfile.mkdtemp(prefix="bench-vision-"))
    if args.model:
        model = Path(args.model)
    else:
        from tests.support.tiny_vlm import build_tiny_qwen2_vl

        model = build_tiny_qwen2_vl(work / "models" / "tiny-qwen2-vl")
        cfg = json.loads((model / "preprocessor_config.json").read_text())
        cfg["max_pixels"] = args.image_size * args.image_size  # screenshots keep their size
        (model / "preprocessor_config.json").write_text(json.dumps(cfg))
    env = bench_env(preload=False)  # oMLX preloads OpenBLAS itself; the peer gets it preloaded below
    omlx = [sys.executable, "-m", "omlx", "serve", "--model-dir", str(model.parent), "--model", model.name]
    specs = [("oMLX", omlx, "/health", model.name, {"OMLX_HOME": str(work / "home-a")}),
             ("oMLX --no-cache", [*omlx, "--no-cache"], "/health", model.name, {"OMLX_HOME": str(work / "home-b")})]  # fmt: skip
    if args.peer_python:
        peer = [args.peer_python, "-m", "mlx_vlm.server", "--host", "127.0.0.1", "--model", str(model)]
        specs.append(("mlx_vlm.server", peer, "/health", str(model), {"LD_PRELOAD": bench_env().get("LD_PRELOAD", "")}))
    results: dict[str, list[float]] = {}
    for label, cmd, ready, name, extra in specs:
        server = Proc(label, cmd, ready, name, {**env, **extra})
        try:
            server.ttft(trace(screenshot(10_000, args.image_size), 1, 20)[0], 4)  # warm-up
            means = []
            for r in range(args.rounds):
                ttfts = [server.ttft(m, args.max_tokens) for m in trace(screenshot(r, args.image_size), args.turns, args.words)]
                means.append(statistics.mean(ttfts))
                print(f"{label:16s} round {r}: TTFT per turn " + " ".join(f"{t:.3f}" for t in ttfts), flush=True)
            results[label] = means
        finally:
            server.stop()
    print(f"\nscreenshot trace: {args.turns} turns, {args.image_size}px image, {args.rounds} rounds; mean TTFT (s)")
    print(f"{'server':16s} {'best':>8s} {'median':>8s} {'oMLX / it':>10s}")
    ours = statistics.median(results["oMLX"])
    for label, means in results.items():
        med = statistics.median(means)
        print(f"{label:16s} {min(means):8.3f} {med:8.3f} {ours / med:10.3f}")


if __name__ == "__main__":
    main()
