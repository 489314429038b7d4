#!/usr/bin/env python
"""What the prefix cache costs on a GPU against recomputing, in one run (issue #40).

Parts (`--parts`, any of them; each prints its rows in the one table at the end):

  restart  Llama-3.1-8B shape: one server process stores a conversation of each `--lengths` (a
           cold prompt each) and stops. Then `--restarts` times: the saved measurements put back as
           it left them (or with the SSD rate set to `--wrong-ssd-rate` GB/s, as a page cache can
           make it), the page cache dropped (`--keep-page-cache` keeps it), the server and a
           `--no-cache` one started fresh (the same attention graphs built), and per length the
           conversation + 16 new tokens (restored from the SSD, cut short, or recomputed: its own
           decision) against a new prompt of that length on the --no-cache server (cold). The
           ratio per restart, medians over the restarts (goal <= 1.1). Each timed request comes
           after the server has been idle `IDLE_BEFORE` s.
  cold     cold prompts of `--cold-lengths` on a server with the cache (defaults) and one with
           `--no-cache`, rounds alternating (`--rounds`, after one untimed warm-up round): TTFT and
           the decode rate of the 16 tokens after the prompt, for a plain-KV model (8B shape), a
           sliding-window one (gemma3_text at Gemma-3-4B shape) and a recurrent hybrid (lfm2 at
           LFM2-1.2B shape); goals: TTFT <= 1.1x, decode >= 0.9x of --no-cache.
  decode   bench_gpu.py --parts a,b on the 8B shape in a subprocess: batch-1 vs raw
           `stream_generate` and 32 streams vs raw `BatchGenerator` (client processes), plus one
           diagnostic round of the 32 streams from a single client process with its CPU time.

Models are random-weight bf16 folders built on the device (bench_gpu.py's builder for Llama;
mlx-lm's own classes for the others), EOS unreachable through a zero output-head row. Requests
are streamed `/v1/completions` of random token ids. Figures: `--out`/cache-cost.json (saved as
parts end and on SIGTERM) and the servers' logs (with `--log-level debug`: every restore
decision and cut). Usage lines: benchmarks/gpu/README.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import bench_gpu as bg
from bench_gpu import SHAPES, Server, Workload, build_model, log, one

HERE = Path(__file__).resolve().parent
EOS = 2  # the test BPE's <|im_end|>
# config.json values of the real models (text part), at their sizes; "tiny-*" for a CPU smoke run
ARCH_SHAPES: dict[str, dict[str, Any]] = {
    "gemma3-4b": dict(
        model_type="gemma3_text", hidden_size=2560, num_hidden_layers=34, intermediate_size=10240,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=1024, sliding_window_pattern=6, vocab_size=262208, rms_norm_eps=1e-6,
        rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling={"factor": 8.0, "rope_type": "linear"},
        max_position_embeddings=131072,
    ),
    "lfm2-1.2b": dict(
        model_type="lfm2", vocab_size=65536, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=128000, norm_eps=1e-5, conv_bias=False, conv_L_cache=3,
        block_dim=2048, block_multiple_of=256, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True,
        block_ff_dim=12288, full_attn_idxs=[2, 5, 8, 10, 12, 14], rope_theta=1000000.0,
    ),
    "tiny-gemma3": dict(
        model_type="gemma3_text", hidden_size=128, num_hidden_layers=6, intermediate_size=256,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64,
        sliding_window=256, sliding_window_pattern=6, vocab_size=4096, rms_norm_eps=1e-6,
        max_position_embeddings=16384,
    ),
    "tiny-lfm2": dict(
        model_type="lfm2", vocab_size=4096, hidden_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16384, norm_eps=1e-5, conv_bias=False, conv_L_cache=3,
        block_dim=128, block_multiple_of=32, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True,
        block_ff_dim=256, full_attn_idxs=[2, 5],
    ),
}  # fmt: skip


def build_arch(models_root: Path, name: str) -> Path:
    """A random-weight bf16 folder of `ARCH_SHAPES[name]` (the output head's EOS row zero)."""
    import importlib

    import mlx.core as mx
    from mlx_lm.utils import save_model

    from tests.support.tiny_model import build_tokenizer

    out = models_root / name
    if (out / "config.json").exists():
        return out
    tic = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    config = {"eos_token_id": EOS, "tie_word_embeddings": True, "torch_dtype": "bfloat16", **ARCH_SHAPES[name]}
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(0)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    head = model.model.embed_tokens if hasattr(model, "model") else model.embed_tokens
    head.weight = head.weight.at[mx.array([EOS])].multiply(0.0)
    mx.eval(model.parameters())
    save_model(out, model)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    del model
    mx.clear_cache()
    log(f"built {name} in {time.perf_counter() - tic:.1f} s")
    return out


def body(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """A streamed greedy completion of token ids, as users send it (no logit_bias)."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip


def timed(server: Server, model: str, prompt: list[int], max_tokens: int = 17, writes: bool = True) -> dict[str, Any]:
    """One request once the server is idle (`writes`: and its SSD writes are done) and has been so for
    `IDLE_BEFORE` s, as a user's request after a pause: TTFT, cached tokens, the decode rate after it."""
    server.wait_idle()
    if writes:
        server.wait_ssd_writes()
    server.wait_warmed()
    time.sleep(IDLE_BEFORE)  # an idle engine empties MLX's buffer cache: every timed request starts so
    before = server.step_times()
    writes = pending_writes(server)
    rec = one(server.url, body(model, prompt, max_tokens))
    if not rec.get("times"):
        raise RuntimeError(f"{server.label}: no token came back: {rec.get('error') or rec.get('finish_reason')}")
    return {"ttft": rec["times"][0] - rec["sent"], "cached": rec["cached_tokens"], "prompt": rec["prompt_tokens"],
            "decode_tps": bg.stream_rate(rec), "split": bg.step_split(before, server.step_times()),
            "pending_writes": writes}  # fmt: skip


def pending_writes(server: Server) -> int:
    """Blocks stored but not yet on the SSD (waiting in the engine or in the writer's queue) as a
    request is sent: the background work its decode may share the host with."""
    stats = server.cache_stats()
    ssd = stats.get("ssd") or next(iter(stats.get("stores", {}).values()), {}).get("ssd", {})
    return int(stats.get("unwritten_blocks", 0) + (ssd or {}).get("queue_depth", 0))


IDLE_BEFORE = 1.0


def saved_rates(home: Path) -> list[Path]:
    return sorted((home / "cache" / "costs").glob("*.json"))


def part_restart(args: Any, models_root: Path, homes: Path, res: dict[str, Any], save: Any) -> None:
    lengths = [int(x) for x in args.lengths.split(",")]
    wl = Workload(args.shape, [EOS], seed=args.seed)
    common = ["--graph-warmup-tokens", str(max(lengths) + 64), *args.server_args.split()]
    home = homes / "restart"
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True, exist_ok=True)
    from pydantic import ByteSize, TypeAdapter

    wanted, free = TypeAdapter(ByteSize).validate_python(args.ssd_size), shutil.disk_usage(home).free
    if free < wanted:  # a full disk stops the SSD writes: nothing would be restored after the restart
        raise RuntimeError(f"{free / 1e9:.1f} GB free under {home}, the SSD tier needs {args.ssd_size}: "
                           "free the disk (other models in WORK_DIR/models) or lower --ssd-size")  # fmt: skip
    srv = Server("omlx", models_root, args.shape, home, ["--ssd-cache-max-size", args.ssd_size, *common])
    ref = Server("omlx --no-cache", models_root, args.shape, homes / "restart-nocache", ["--no-cache", *common])
    part = res.setdefault("restart", {"lengths": lengths, "wrong_ssd_rate": args.wrong_ssd_rate, "rounds": []})
    convs = {n: wl.prompt(n) for n in lengths}
    try:
        srv.start()
        srv.wait_ready()
        for n in lengths:
            timed(srv, args.shape, convs[n], 2)  # stored: the conversations so far
        srv.wait_idle()
        srv.wait_ssd_writes()
        srv.stop()  # its close saves the measurements beside the blocks
        left = {f: f.read_text() for f in saved_rates(home)}
        for r in range(args.restarts):
            for f, text in left.items():  # every restart starts from what the first process left
                state = json.loads(text)
                if args.wrong_ssd_rate:  # as measured on reads the page cache served
                    state["ssd_restores"] = [args.wrong_ssd_rate * 1e9 * 10, 10.0, 3.0]
                f.write_text(json.dumps(state))
            dropped = False if args.keep_page_cache else bg.drop_page_cache()
            for s in (srv, ref):  # both fresh processes: the same attention graphs built
                s.start()
            for s in (srv, ref):
                s.wait_ready()
            row: dict[str, Any] = {"page_cache_dropped": dropped, "lengths": {}}
            for n in lengths:
                after = timed(srv, args.shape, convs[n] + wl.prompt(16))
                cold = timed(ref, args.shape, wl.prompt(n + 16))
                row["lengths"][str(n)] = {"after": after, "cold": cold, "ratio": after["ttft"] / cold["ttft"]}
                log(f"restart {r}, {n}: after restart {after['ttft']:.3f}s ({after['cached']} cached) vs cold "
                    f"{cold['ttft']:.3f}s -> {after['ttft'] / cold['ttft']:.3f}x")  # fmt: skip
            part["rounds"].append(row)
            for s in (srv, ref):
                s.stop()
            save()
    finally:
        for s in (srv, ref):
            s.stop()
            keep_logs(s, args.out)
        shutil.rmtree(home, ignore_errors=True)  # tens of GB of blocks


def part_cold(args: Any, models_root: Path, homes: Path, res: dict[str, Any], save: Any) -> None:
    lengths = [int(x) for x in args.cold_lengths.split(",")]
    cold = res.setdefault("cold", {"lengths": lengths, "models": {}})
    for name in args.cold_models.split(","):
        folder = build_model(models_root, name, every_token_streams=True) if name in SHAPES else build_arch(models_root, name)
        wl = Workload(name, [EOS], seed=args.seed + 7)
        common = ["--graph-warmup-tokens", str(max(lengths) + 64), *args.server_args.split()]
        for side in ("cache", "nocache"):  # a cache left by an earlier run would answer its prompts
            shutil.rmtree(homes / f"{name}-{side}", ignore_errors=True)
        servers = {"cache": Server(f"{name} cache", models_root, folder.name, homes / f"{name}-cache", common),
                   "nocache": Server(f"{name} --no-cache", models_root, folder.name, homes / f"{name}-nocache",
                                     ["--no-cache", *common])}  # fmt: skip
        rows: list[dict[str, Any]] = []
        cold["models"][name] = {"rounds": rows}
        try:
            for s in servers.values():
                s.start()
            for s in servers.values():
                s.wait_ready()
            for r in range(args.rounds + 1):  # round 0: the warm-up, not counted
                order = list(servers.items()) if r % 2 == 0 else list(servers.items())[::-1]
                row: dict[str, Any] = {}
                for side, s in order:
                    for other in servers.values():  # nothing of the other server's runs meanwhile
                        other.wait_idle()
                        other.wait_warmed()
                    for n in lengths:  # SSD writes go on: the writer waits while a prompt prefills alone
                        row[f"{side}/{n}"] = timed(s, folder.name, wl.prompt(n), writes=False)
                if r:
                    rows.append(row)
                    log(f"cold {name} round {r}: " + ", ".join(
                        f"{n}: TTFT {row[f'cache/{n}']['ttft']:.3f} vs {row[f'nocache/{n}']['ttft']:.3f}s, decode "
                        f"{row[f'cache/{n}']['decode_tps']:.1f} vs {row[f'nocache/{n}']['decode_tps']:.1f} tok/s "
                        f"({row[f'cache/{n}']['pending_writes']} blocks still to write at its send)"
                        for n in lengths))  # fmt: skip
        finally:
            for s in servers.values():
                s.stop()
                keep_logs(s, args.out)
                shutil.rmtree(s.home, ignore_errors=True)  # its blocks: GBs the next part's disk needs
        summary = {}
        for n in lengths:
            med: dict[str, float] = {}
            for side in ("cache", "nocache"):
                for k in ("ttft", "decode_tps"):
                    med[f"{side}_{k}"] = statistics.median(x[f"{side}/{n}"][k] for x in rows)
            med["ttft_ratio"] = med["cache_ttft"] / med["nocache_ttft"]
            med["decode_ratio"] = med["cache_decode_tps"] / med["nocache_decode_tps"] if med["nocache_decode_tps"] else 0.0
            for side in ("cache", "nocache"):  # where the decode steps after the prompt spent their time
                med[f"{side}_split"] = bg.median_split([{"split": x[f"{side}/{n}"]["split"]} for x in rows])
            summary[str(n)] = med
        cold["models"][name]["medians"] = summary
        save()


def part_decode(args: Any, res: dict[str, Any]) -> None:
    out = args.out / "decode"
    cmd = [sys.executable, str(HERE / "bench_gpu.py"), "--shape", args.shape, "--parts", "a,b", "--work-dir",
           str(args.work_dir), "--out", str(out), "--repeats", str(args.decode_rounds), "--stream-repeats",
           str(args.decode_rounds), "--one-client-round", *args.decode_args.split()]  # fmt: skip
    log(f"decode: {' '.join(cmd)}")
    subprocess.run(cmd, check=True)
    res["decode"] = json.loads((out / f"results-{args.shape}.json").read_text())


DISK_FULL = "No space left on device"
DISKS_FULL: list[str] = []  # the servers whose SSD tier hit a full disk: their cache figures are void


def keep_logs(server: Server, out: Path) -> None:
    with open(out / "servers.log", "a") as logs:
        for f in sorted(server.home.glob("server-*.log")):
            text = f.read_text(errors="replace")
            if DISK_FULL in text:
                DISKS_FULL.append(server.label)
                log(f"INVALID: {server.label}'s SSD tier ran out of disk; its writes stopped, so it restores nothing")
            logs.write(f"===== {server.label}: {f.name}\n{text}\n")
            f.unlink()


def print_table(res: dict[str, Any]) -> None:
    print(f"\n== prefix-cache cost, {res.get('device', '')}, oMLX {res.get('commit', '')}, {res['date']} ==")
    if res.get("disk_full"):
        print(f"INVALID RUN: the SSD tier of {res['disk_full']} ran out of disk (servers.log): nothing it wrote was restored")
    if "restart" in res:
        rounds = res["restart"]["rounds"]
        dropped = {x["page_cache_dropped"] for x in rounds}
        wrong = res["restart"].get("wrong_ssd_rate")
        print(f"TTFT after a restart vs a restarted --no-cache server, {res['shape']}, {len(rounds)} restarts (page cache "
              f"dropped: {dropped}; saved SSD rate {f'set to {wrong} GB/s' if wrong else 'as measured'}):")  # fmt: skip
        for n in res["restart"]["lengths"]:
            xs = [x["lengths"][str(n)] for x in rounds if str(n) in x["lengths"]]
            if xs:
                ratios = ", ".join(f"{x['ratio']:.3f}" for x in xs)
                print(f"  {n:>7}: after {statistics.median(x['after']['ttft'] for x in xs):.3f}s (cached "
                      f"{[x['after']['cached'] for x in xs]}) | cold {statistics.median(x['cold']['ttft'] for x in xs):.3f}s "
                      f"| ratio median {statistics.median(x['ratio'] for x in xs):.3f} (rounds "
                      f"{ratios}; goal <= 1.1)")  # fmt: skip
    if "cold" in res:
        print("Cold prompts, cache vs --no-cache (medians of alternating rounds): TTFT | decode of the 16 tokens after")
        for name, m in res["cold"]["models"].items():
            for n, s in m.get("medians", {}).items():
                print(f"  {name:>12} {n:>7}: TTFT {s['cache_ttft']:.3f} / {s['nocache_ttft']:.3f}s = {s['ttft_ratio']:.3f}x "
                      f"(goal <= 1.1) | decode {s['cache_decode_tps']:.1f} / {s['nocache_decode_tps']:.1f} tok/s = "
                      f"{s['decode_ratio']:.3f}x (goal >= 0.9)")  # fmt: skip
                for side in ("cache", "nocache"):
                    if s.get(f"{side}_split"):
                        print(f"  {'':>12} {'':>7}  {side:>7} decode {bg.split_line(s[f'{side}_split'])}")
    if "decode" in res:
        d = res["decode"]
        if "a" in d:
            a = d["a"]
            print(f"Batch 1: server {a['omlx_median']:.1f} vs raw stream_generate {a['raw_median']:.1f} tok/s = "
                  f"{a['ratio']:.3f}x; {bg.split_line(a.get('split'))}")  # fmt: skip
        if "b" in d:
            b = d["b"]
            print(f"{b['streams']} streams: server {b['omlx_median']:.0f} vs raw BatchGenerator {b['raw_median']:.0f} "
                  f"tok/s = {b['ratio']:.3f}x (goal >= 0.9); {bg.split_line(b.get('split'))}; raw's graph build "
                  f"{b.get('raw_build_ms', float('nan')):.2f}")  # fmt: skip
            one_proc = b.get("one_client_process")
            if one_proc:
                print(f"  diagnostic, one client process of {b['streams']} threads: {one_proc['aggregate_tps']:.0f} tok/s "
                      f"({one_proc['aggregate_tps'] / b['raw_median']:.3f}x of raw's median), client CPU "
                      f"{one_proc['client_cpu_s']:.2f}s over {one_proc['wall_s']:.2f}s")  # fmt: skip
        if "s" in d:  # --decode-args "--parts a,b,s": issue #41's GPU row
            x = d["s"]
            print(f"{x['streams']} streams, {x['held']} held to a JSON schema: {x['omlx_median']:.0f} vs all free "
                  f"{x['raw_median']:.0f} tok/s = {x['ratio']:.3f}x (goal >= 0.9); held {bg.split_line(x.get('split_half'))}; "
                  f"free {bg.split_line(x.get('split_free'))}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="restart,cold,decode")
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--lengths", default="8000,32000,48000,64000", help="Conversation lengths of part restart.")
    ap.add_argument("--restarts", type=int, default=3)
    ap.add_argument("--keep-page-cache", action="store_true", help="Restart without dropping the page cache.")
    ap.add_argument("--wrong-ssd-rate", type=float, default=0.0,
                    help="GB/s written into the saved SSD rate before each restart (0: as measured).")  # fmt: skip
    ap.add_argument("--ssd-size", default="45GB", help="The restart part's SSD tier (it stores ~2x the lengths' KV).")
    ap.add_argument("--cold-models", default="llama-3.1-8b,gemma3-4b,lfm2-1.2b")
    ap.add_argument("--cold-lengths", default="8000,32000")
    ap.add_argument("--rounds", type=int, default=3, help="Counted rounds of part cold, each side.")
    ap.add_argument("--decode-rounds", type=int, default=5)
    ap.add_argument("--decode-args", default="", help="More flags for bench_gpu.py (part decode).")
    ap.add_argument("--server-args", default="", help="Extra flags for every oMLX server (e.g. --log-level debug).")
    ap.add_argument("--seed", type=int, default=40)
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/omlx-bench-gpu"))
    ap.add_argument("--out", type=Path, default=None, help="Default: $OUT where set, else WORK_DIR/out.")
    args = ap.parse_args()
    import os

    args.out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else args.work_dir / "out")
    args.out.mkdir(parents=True, exist_ok=True)
    bg.LOG_FILE = args.out / "cache-cost.log"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    import mlx.core as mx

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv[1:], "shape": args.shape,
                           "commit": commit or "?", "mlx": mx.__version__,
                           "device": mx.device_info().get("device_name", str(mx.default_device()))}  # fmt: skip
    parts = args.parts.split(",")
    models_root, homes = args.work_dir / "models", args.work_dir / "cache-cost-homes"

    def save() -> None:
        (args.out / "cache-cost.json").write_text(json.dumps(res, indent=2, default=str))

    try:
        if "restart" in parts or "decode" in parts:
            build_model(models_root, args.shape, every_token_streams=True)
        for name, part in (("restart", part_restart), ("cold", part_cold)):
            if name in parts:
                try:
                    part(args, models_root, homes, res, save)
                except Exception:
                    res[f"{name}_error"] = traceback.format_exc()
                    log(res[f"{name}_error"])
                save()
        if "decode" in parts:
            try:
                part_decode(args, res)
            except Exception:
                res["decode_error"] = traceback.format_exc()
                log(res["decode_error"])
    finally:
        res["disk_full"] = sorted(set(DISKS_FULL))
        save()
        print_table(res)


if __name__ == "__main__":
    main()
