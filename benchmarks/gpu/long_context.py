#!/usr/bin/env python
"""Long prompts through real `omlx serve` processes: TTFT and cache-vs-recompute outputs.

For each prompt length (random token ids, seeded per length), on a random-weight model of
bench_gpu.py's shapes (context window `--window`, default the shape's), rows of streamed
`/v1/completions` requests (greedy, `--check-tokens` tokens, EOS suppressed, `logprobs: 5`):

  cold      the prompt on the cache server (a miss)
  hit       the prompt + `--short-suffix` (16) new tokens: a hit of nearly all of it
  suffix2k  the prompt + `--long-suffix` (2,000) new tokens
  pair      two requests sent together: the prompt + 16 new tokens, and another session's
            prompt of half the length (stored by an untimed request first) + 16 new tokens
  check     every request of the rows above again on a `--no-cache` server (the "no-cache"
            column): float32 must give identical token ids, bf16 reports whether the first
            token is the same and the largest difference of its top-5 logprobs
  peer      cold and hit on `mlx_lm.server` (its own prompt cache; the model's bf16)

The servers run one after the other (cache, then --no-cache, then the peer), each started
fresh; after every row `/health` must answer 200, and a server that died is logged (its log
tail printed) and replaced by a fresh one for the next length. The model's tokenizer has a
word per model id ("t123"), so the per-token texts in the logprobs name the token ids.
Figures: `--out`/long-context-<dtype>.json (saved after every row, and on SIGTERM), the
servers' logs next to it. See benchmarks/gpu/README.md for the usage lines.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import bench_gpu as bg
import httpx
import sse_client
from bench_gpu import SHAPES, PeerServer, Server, Workload, build_model, log, one

ROWS = ("cold", "hit", "suffix2k", "pair")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0-2, as the BPE has them
EOS = [2]


def word_tokenizer(vocab_size: int):
    """A tokenizer writer for `build_model`: token id i is the word "t<i>" (ids 0-2 the
    specials), so every id the model can produce decodes to a text of its own and a text
    prompt of those words encodes back to the same ids (the peer gets text)."""

    def write(out: Path) -> None:
        from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

        vocab = {s: i for i, s in enumerate(SPECIALS)} | {f"t{i}": i for i in range(3, vocab_size)}
        tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIALS[0]))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
        tok.save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": SPECIALS[2],
            "pad_token": SPECIALS[0], "model_max_length": 2048}))  # fmt: skip

    return write


def token_id(text: str) -> int | None:
    return int(text[1:]) if text[:1] == "t" and text[1:].isdigit() else None


class Requests:
    """The prompts of one length: seeded by the length, so every call builds the same ones."""

    def __init__(self, args: Any, n: int):
        wl = Workload(args.model_name, EOS, seed=args.seed * 1_000_003 + n)
        k, k2 = args.short_suffix, args.long_suffix
        self.n, self.P = n, wl.prompt(n)
        sa, sb, sc, s2k = wl.prompt(k), wl.prompt(k), wl.prompt(k), wl.prompt(k2)
        # the pair's other session: a prompt of its own, half as long
        self.Q = Workload(args.model_name, EOS, seed=args.seed * 1_000_003 + 10**9 + n).prompt(n // 2)
        self.rows = {"cold": [self.P], "hit": [self.P + sa], "suffix2k": [self.P + s2k],
                     "pair": [self.P + sb, self.Q + sc]}  # fmt: skip
        # what each row needs stored on the cache server first
        self.needs = {"cold": [], "hit": [self.P], "suffix2k": [self.P], "pair": [self.P, self.Q]}
        self.wl, self.check_tokens = wl, args.check_tokens

    def body(self, prompt: list[int], peer: bool = False) -> dict[str, Any]:
        b = self.wl.body(prompt, self.check_tokens)
        if peer:  # mlx_lm.server takes text prompts: the words encode back to the same ids
            b.update(model="default_model", prompt=" ".join(f"t{t}" for t in prompt))
        else:
            b["logprobs"] = 5
        return b


def summary(rec: dict[str, Any]) -> dict[str, Any]:
    """What a streamed answer's record keeps: TTFT, cached tokens, token ids, top-5 logprobs."""
    if not rec.get("times"):
        return {"error": f"no token came back ({rec.get('finish_reason')})"}
    return {
        "ttft": round(rec["times"][0] - rec["sent"], 4),
        "cached_tokens": rec["cached_tokens"],
        "prompt_tokens": rec["prompt_tokens"],
        "completion_tokens": rec["completion_tokens"],
        "decode_tps": round(bg.decode_rate(rec["times"]), 2) if len(rec["times"]) > 2 else None,
        "ids": [token_id(t) for t in rec.get("logprob_tokens", [])],
        "top5": [{str(token_id(t)): lp for t, lp in (top or {}).items()} for top in rec.get("top_logprobs", [])],
    }


def copies_out(s: Server) -> dict[str, Any] | None:
    """The cache's device -> host copies so far (`device_to_host` of /api/cache/stats)."""
    stats = s.cache_stats()
    return stats.get("device_to_host") or next(iter(stats.get("stores", {}).values()), {}).get("device_to_host")


def copies_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """GB and seconds of each kind of copy between two `copies_out`."""
    if not before or not after:
        return None
    return {k: {"gb": round((after[k]["bytes"] - before[k]["bytes"]) / 1e9, 3),
                "s": round(after[k]["seconds"] - before[k]["seconds"], 3)} for k in after if k in before}  # fmt: skip


def healthy(s: Server) -> bool:
    try:
        return s.proc is not None and s.proc.poll() is None and httpx.get(f"{s.url}/health", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def run_side(args: Any, side: str, s: Server, lengths: list[int], rows: list[str], res: dict[str, Any],
             save: Any) -> None:  # fmt: skip
    """Every row of every length on `s` (side "cache", "nocache" or "peer"); a server that
    dies is recorded and the next length gets a fresh one."""
    up, stored = False, set()  # `stored`: prompts this server life has seen (cache side)
    for n in lengths:
        req, out = Requests(args, n), res["rows"].setdefault(str(n), {})
        if not up:
            try:
                tic = time.perf_counter()
                s.start()
                s.wait_ready()
                one(s.url, req.body(req.wl.prompt(128), peer=side == "peer"))  # first-use kernels
                if side != "peer":
                    s.wait_warmed()
                res["servers"].append({"side": side, "start": s.starts, "up_s": round(time.perf_counter() - tic, 1)})
                log(f"{s.label} up in {time.perf_counter() - tic:.1f}s")
                up, stored = True, set()
            except Exception:
                res["errors"].append({"side": side, "length": n, "start": traceback.format_exc()[-3000:]})
                log(f"{s.label} did not start:\n{traceback.format_exc()[-3000:]}")
                s.stop()
                continue
        for row in rows:
            entries = [out.setdefault(f"{row}_{x}" if row == "pair" else row, {}) for x in "ab"[: len(req.rows[row])]]
            try:
                if side == "cache":
                    for p in req.needs[row]:
                        if tuple(p) not in stored:  # stored by an untimed request
                            one(s.url, req.body(p))
                            stored.add(tuple(p))
                if side != "peer":
                    s.wait_idle()
                    s.wait_warmed()
                bodies = [req.body(p, peer=side == "peer") for p in req.rows[row]]
                before = s.step_times() if side != "peer" else None
                copied = copies_out(s) if side == "cache" else None
                if len(bodies) == 1:
                    recs = [one(s.url, bodies[0])]
                else:  # sent together
                    recs = sse_client.stream_group(s.url, bodies, time.perf_counter() + 0.2, bg.REQUEST_TIMEOUT)
                split = bg.step_split(before, s.step_times()) if side != "peer" else None
                copied = copies_delta(copied, copies_out(s)) if side == "cache" else None
                for e, p, r in zip(entries, req.rows[row], recs, strict=True):
                    e[side] = {"error": r["error"]} if "error" in r else {**summary(r), "split": split, "copies": copied}
                    e["prompt_tokens"] = len(p)
                    if side == "cache":
                        stored.add(tuple(p))
                log(f"{n} {row} {side}: " + "; ".join(
                    f"TTFT {e[side]['ttft']:.3f}s cached {e[side]['cached_tokens']}/{e['prompt_tokens']} "
                    f"decode {e[side]['decode_tps'] or 0:.1f} tok/s"
                    if "ttft" in e[side] else e[side]["error"] for e in entries)
                    + (f"; {bg.split_line(split)}" if split else "")
                    + (f"; copies out {copied}" if copied else ""))  # fmt: skip
            except Exception:
                for e in entries:
                    e[side] = {"error": traceback.format_exc()[-2000:]}
                log(f"{n} {row} {side} failed:\n{traceback.format_exc()[-2000:]}")
            if not healthy(s):
                code = s.proc.poll() if s.proc else None
                for e in entries:
                    e.setdefault(side, {})["server_died"] = code if code is not None else "unhealthy"
                res["errors"].append({"side": side, "length": n, "row": row, "died": code, "log_tail": s.log_tail()})
                log(f"{s.label} died after {n} {row} (exit {code}); its log's tail:\n{s.log_tail()}")
                s.stop()
                up = False
            save()
            if not up:
                break
    s.stop()


def compare(e: dict[str, Any], exact: bool) -> None:
    """Cache vs --no-cache outputs of one request: `e["check"]`."""
    c, n = e.get("cache", {}), e.get("nocache", {})
    if "ids" not in c or "ids" not in n:
        e.pop("check", None)
        return
    same = [a == b for a, b in zip(c["ids"], n["ids"], strict=False)]
    prefix = same.index(False) if False in same else len(same)
    diffs = [abs(c["top5"][i][t] - n["top5"][i][t]) for i in range(min(prefix + 1, len(c["top5"]), len(n["top5"])))
             for t in c["top5"][i].keys() & n["top5"][i].keys()]  # fmt: skip
    first = c["top5"][0].keys() & n["top5"][0].keys() if c["top5"] and n["top5"] else set()
    e["check"] = {
        "identical": c["ids"] == n["ids"] and bool(c["ids"]),
        "first_identical": c["ids"][:1] == n["ids"][:1],
        "first_top5_same": bool(c["top5"]) and c["top5"][0].keys() == n["top5"][0].keys(),
        "first_logprob_diff": max((abs(c["top5"][0][t] - n["top5"][0][t]) for t in first), default=None),
        "max_logprob_diff_while_identical": max(diffs, default=None),
    }
    if prefix < len(same):  # where they part: a near tie of the --no-cache side's top two?
        lps = sorted(n["top5"][prefix].values(), reverse=True) if prefix < len(n["top5"]) else []
        e["check"].update(first_diff_step=prefix, nocache_top2_margin_there=lps[0] - lps[1] if len(lps) > 1 else None)
    e["check"]["ok"] = e["check"]["identical"] if exact else True


def print_table(res: dict[str, Any]) -> None:
    a = res["args"]
    print(f"\n== long context: {res['model']} {res['dtype']}; TTFT s (cache server, --no-cache, mlx_lm.server); "
          "tokens: the 8 generated ids, cache vs --no-cache; 1st: the first one; |dlogp|: its top-5 logprobs' largest "
          "difference ==")  # fmt: skip
    print(f"{'length':>7} {'row':<9} {'cached/prompt':>15} {'cache':>8} {'no-cache':>8} {'peer':>8} {'tokens':>7} "
          f"{'1st':>5} {'|dlogp|':>8}  status")  # fmt: skip

    def ttft(x: dict[str, Any] | None) -> str:
        return "-" if x is None else f"{x['ttft']:.3f}" if "ttft" in x else "ERR"

    def same(check: dict[str, Any], key: str) -> str:
        return "-" if key not in check else "same" if check[key] else "DIFF"

    for n, rows in res["rows"].items():
        for row, e in rows.items():
            c, ch = e.get("cache", {}), e.get("check", {})
            cached = f"{c['cached_tokens']}/{e['prompt_tokens']}" if "ttft" in c else "-"
            d = ch.get("first_logprob_diff")
            bad = [f"{side} error" for side in ("cache", "nocache", "peer") if "error" in e.get(side, {})]
            bad += [f"{side} server died" for side in ("cache", "nocache", "peer") if "server_died" in e.get(side, {})]
            if ch and not ch["ok"]:
                bad.insert(0, "FAIL: tokens differ")
            suffix = a["long_suffix"] if row == "suffix2k" else a["short_suffix"]
            if row != "cold" and "ttft" in c and c["cached_tokens"] < e["prompt_tokens"] - suffix - 512:
                bad.append("low hit")
            print(f"{n:>7} {row:<9} {cached:>15} {ttft(c or None):>8} {ttft(e.get('nocache')):>8} "
                  f"{ttft(e.get('peer')):>8} {same(ch, 'identical'):>7} {same(ch, 'first_identical'):>5} "
                  f"{'-' if d is None else f'{d:.4f}':>8}  {'; '.join(bad) or 'ok'}")  # fmt: skip
    for err in res["errors"]:
        print(f"!! {err.get('side')} at {err.get('length')} {err.get('row', '(start)')}: died {err.get('died', '-')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--window", type=int, default=None, help="max_position_embeddings (default: the shape's).")
    ap.add_argument("--compute-dtype", "--dtype", default="bf16", choices=("bf16", "bfloat16", "float32"))
    ap.add_argument("--lengths", default="8000,32000,48000,64000,120000")
    ap.add_argument("--parts", default="cold,hit,suffix2k,pair,check", help="Of cold,hit,suffix2k,pair,check,peer.")
    ap.add_argument("--peer", action="store_true", help="Add the peer part (mlx_lm.server).")
    ap.add_argument("--peer-lengths", default=None, help="Lengths of the peer part (default: --lengths).")
    ap.add_argument("--short-suffix", type=int, default=16)
    ap.add_argument("--long-suffix", type=int, default=2000)
    ap.add_argument("--check-tokens", "--tokens", type=int, default=8, help="max_tokens of every request.")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--cache-args", default="",
                    help="Flags of the cache server only (default: oMLX's defaults, a hot tier of 10%% of device memory, "
                    "which a 120k-token 8B bf16 prompt outgrows into the RAM tier; e.g. '--hot-cache-max-size 40%%').")  # fmt: skip
    ap.add_argument("--server-args", default="", help="Extra flags of both oMLX servers.")
    ap.add_argument("--against", type=Path, default=None,
                    help="A long-context-*.json of an earlier call with the same options: its results are kept and the "
                    "cache server's are taken from it instead of running that server (so a call can run only check "
                    "rows: --parts hit,check --against FILE).")  # fmt: skip
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/omlx-bench-gpu"))
    ap.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    args = ap.parse_args()
    args.compute_dtype = "bf16" if args.compute_dtype == "bfloat16" else args.compute_dtype
    parts = set(args.parts.split(",")) | ({"peer"} if args.peer else set())
    lengths = [int(x) for x in args.lengths.split(",") if x]
    window = args.window = args.window or SHAPES[args.shape]["max_position_embeddings"]
    args.model_name = f"{args.shape}-ctx{window}-words"
    dtype = "bfloat16" if args.compute_dtype == "bf16" else "float32"
    out_dir = args.out or args.work_dir / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    bg.LOG_FILE = out_dir / f"long-context-{args.compute_dtype}.log"
    bg.REQUEST_TIMEOUT = args.request_timeout
    bg.STUCK_AFTER = int(args.request_timeout) + 120
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # through the `finally`: figures and logs saved

    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv[1:], "args": {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "model": args.model_name,
        "dtype": args.compute_dtype, "rows": {}, "servers": [], "errors": []}  # fmt: skip
    if args.against:
        earlier = json.loads(args.against.read_text())
        same = ("shape", "window", "compute_dtype", "seed", "short_suffix", "long_suffix", "check_tokens")
        if any(earlier["args"].get(k) != res["args"][k] for k in same):
            sys.exit(f"{args.against} was made with other options: {[(k, earlier['args'].get(k)) for k in same]}")
        res["rows"], res["errors"] = earlier["rows"], [{**x, "call": "earlier"} for x in earlier["errors"]]
    json_path = out_dir / f"long-context-{args.compute_dtype}.json"

    def save() -> None:
        for rows in res["rows"].values():
            for e in rows.values():
                compare(e, exact=dtype == "float32")
        json_path.write_text(json.dumps(res, indent=1, default=str))

    models_root = args.work_dir / "models"
    tic = time.perf_counter()
    build_model(models_root, args.shape, name=args.model_name, window=window,
                tokenizer=word_tokenizer(SHAPES[args.shape]["vocab_size"]))  # fmt: skip
    res["build_s"] = round(time.perf_counter() - tic, 1)
    homes = args.work_dir / "long-context"
    shutil.rmtree(homes, ignore_errors=True)  # a cache of an earlier call would turn misses into hits
    common = ["--max-concurrent-requests", "32", "--compute-dtype", dtype, *args.server_args.split()]
    servers = [
        ("cache", Server("omlx", models_root, args.model_name, homes / "cache", common + args.cache_args.split())),
        ("nocache", Server("omlx --no-cache", models_root, args.model_name, homes / "nocache", [*common, "--no-cache"])),
        ("peer", PeerServer("mlx_lm.server", models_root, args.model_name, homes / "peer", [])),
    ]
    rows = [r for r in ROWS if r in parts]
    log(f"{args.model_name} {dtype}: lengths {lengths}, rows {rows}, parts {sorted(parts)}")
    peer_lengths = [int(x) for x in args.peer_lengths.split(",")] if args.peer_lengths else lengths
    plan = {"cache": (lengths, [] if args.against else rows), "nocache": (lengths, (rows or list(ROWS)) if "check" in parts else []),
            "peer": (peer_lengths, ["cold", "hit"] if "peer" in parts else [])}  # fmt: skip
    try:
        for side, s in servers:  # one server on the device at a time (three 8B ones ran it out of memory)
            if plan[side][1]:
                run_side(args, side, s, *plan[side], res, save)
    finally:
        for _, s in servers:
            s.stop()
        save()
        with open(out_dir / f"long-context-{args.compute_dtype}-servers.log", "w") as f:
            for _, s in servers:
                for p in sorted(s.home.glob("server-*.log")):
                    f.write(f"===== {s.label}: {p.name}\n{p.read_text(errors='replace')}\n")
        print_table(res)
        log(f"wrote {json_path}")


if __name__ == "__main__":
    main()
