"""What prompt-lookup speculation buys, in one run: oMLX with speculation vs oMLX without it, two
servers on the same weights (Qwen2.5-Coder-0.5B-Instruct in float32 by default).

  (a) edit: a ~2,000-token source file and "return the file with function X renamed to Y";
      batch-1 decode tok/s with vs without — goal >= 2.0x, and the same tokens on both sides;
  (b) free-form chat (nothing to copy): batch-1 decode tok/s with vs without — goal >= 0.95x;
  (c) 8 concurrent edit streams (eight source files, a function renamed in each; --streams N for
      more): aggregate decode tok/s with vs without — goal >= 1.0x, and the same tokens on both sides.

Each workload's decode steps are split (graph build, launch, device wait, host: ms per loop, from
the servers' `step_times`), the speculating server's verify steps beside plain ones. On a GPU
(issue #45's goals there, which the table then applies: batch-1 edit >= 2.5x, the streams
>= 1.3x) run it with `--as-is` on the model as served and `--server-args "--batch-speculation
on"`, e.g. with SmolLM2's MLX folder.

With --peer llama.cpp, also (d): llama.cpp's llama-server on the GGUF oMLX imports the model
from, without speculation and with each --llama-spec set of its n-gram speculation flags (default:
ngram-simple, the same lookup key of 4 tokens and the same 8-token drafts as ours), on the same two
workloads in the same rounds: its speedup beside ours.

Greedy, the requests users send (no logit_bias); every server keeps a hot prefix cache, so the
prompt is prefilled once per server and rounds measure decode. The sides alternate within each
round; best and median of --repeats rounds are reported.

    .venv/bin/python benchmarks/bench_speculation.py            # ~30 min on 2 CPUs
    .venv/bin/python benchmarks/bench_speculation.py --quick    # smoke run
    .venv/bin/python benchmarks/bench_speculation.py --peer llama.cpp  # + (d); llama-server built once: common.py
    python benchmarks/bench_speculation.py --model-path DIR --as-is --streams 32 --only ac \
        --server-args "--batch-speculation on"                       # on the H200
"""

from __future__ import annotations

import argparse
import re
import shlex
import statistics
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import (  # noqa: E402
    CACHE_DIR,
    QuietPolicy,
    Row,
    Server,
    header_info,
    log,
    machine_summary,
    mean,
    prepare_model,
    print_table,
    run,
    serving,
    stream_many,
    warn_if_busy,
    write_json,
)

from omlx.platform_info import cpu_device  # noqa: E402

SOURCE = Path(__file__).resolve().parent.parent / "omlx" / "engine" / "solo.py"
OLD, NEW = "_chunk_len", "next_chunk_length"  # defined and called in the file's first ~2,000 tokens
LLAMA_SPEC = "--spec-type ngram-simple --spec-ngram-simple-size-n 4 --spec-ngram-simple-size-m 8"
CHAT = "Tell me a short original story about a lighthouse keeper who finds a strange map. Use vivid details."


def cut_source(model, path: Path, tokens: int) -> str:
    """The file cut at a line boundary near `tokens` tokens."""
    lines, kept = path.read_text().splitlines(keepends=True), []
    for line in lines:
        if model.count_tokens("".join(kept + [line])) > tokens:
            break
        kept.append(line)
    return "".join(kept)


def edit_prompt(model, tokens: int) -> list[dict[str, str]]:
    """The source file cut near `tokens` tokens, and the rename asked for."""
    code = cut_source(model, SOURCE, tokens)
    assert OLD in code
    ask = f"Return this whole file with the function `{OLD}` renamed to `{NEW}` (its definition and every call). Reply with the code only."
    return [{"role": "user", "content": f"```python\n{code}```\n\n{ask}"}]


STREAM_SOURCES = ["solo.py", "grammar.py", "vision_lm.py", "graph_warmup.py", "output.py", "sampling.py",
                  "bridge.py", "store_queue.py"]  # fmt: skip


def stream_prompts(model, tokens: int, streams: int) -> list[list[dict[str, str]]]:
    """(c): one edit per stream, a file of omlx/engine cut near `tokens` tokens with a function
    (defined in the cut) renamed: stream i edits file i mod 8, renaming its (i div 8)-th function."""
    out = []
    for i in range(streams):
        code = cut_source(model, SOURCE.parent / STREAM_SOURCES[i % len(STREAM_SOURCES)], tokens)
        names = [m.group(1) for m in re.finditer(r"^\s*def (\w+)\(", code, re.M) if not m.group(1).startswith("__")]
        old = names[(i // len(STREAM_SOURCES)) % len(names)]
        ask = f"Return this whole file with the function `{old}` renamed to `{old}_v2` (its definition and every call). Reply with the code only."
        out.append([{"role": "user", "content": f"```python\n{code}```\n\n{ask}"}])
    return out


def step_times(server: Server) -> dict:
    """The server's decode-step counters for the model (`/v1/models/status`)."""
    data = httpx.get(server.base_url + "/v1/models/status", timeout=30).json()["data"]
    return next(m for m in data if m["id"] == server.request_model)["step_times"] or {}


SPLIT = ("graph_build", "launch", "device_wait", "host")


def step_split(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """Milliseconds per decode loop of each part between two `step_times`, for the loops that
    verified drafts and for the others (plain steps), with each kind's loops and rows."""
    d = {k: after[k] - before[k] for k in after if isinstance(after[k], (int, float)) and k in before}
    out = {}
    for kind, loops, rows, part in (("verify", d["verify_loops"], d["verify_rows"], lambda p: d[f"verify_{p}_s"]),
                                    ("plain", d["loops"] - d["verify_loops"], d["rows"] - d["verify_rows"],
                                     lambda p: d[f"{p}_s"] - d[f"verify_{p}_s"])):  # fmt: skip
        if loops > 0:
            out[kind] = {"loops": loops, "rows_per_loop": rows / loops, **{p: 1e3 * part(p) / loops for p in SPLIT}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", help="MLX model folder (default: Qwen2.5-Coder-0.5B-Instruct, tests/support/qwen_coder.py)")
    ap.add_argument("--file-tokens", type=int, default=2000, help="tokens of source file in the edit prompt (default 2000)")
    ap.add_argument("--edit-tokens", type=int, default=256, help="edit output measured, tokens (default 256)")
    ap.add_argument("--chat-tokens", type=int, default=128, help="chat output measured, tokens (default 128)")
    ap.add_argument("--draft-max", type=int, default=8, help="--draft-max of the speculating server (default 8)")
    ap.add_argument("--streams", type=int, default=8, help="(c): concurrent edit streams (default 8)")
    ap.add_argument("--as-is", action="store_true", help="serve the model's weights as they are (no float32 copy: a GPU)")
    ap.add_argument("--server-args", default="", help="more `omlx serve` flags for both oMLX servers, e.g. "
                    "'--batch-speculation on' on a GPU")  # fmt: skip
    ap.add_argument("--stream-file-tokens", type=int, default=2000, help="(c): tokens of source file per stream (default 2000)")
    ap.add_argument("--stream-tokens", type=int, default=128, help="(c): output measured per stream, tokens (default 128)")
    ap.add_argument("--only", default="abc", help="the workloads to run, e.g. 'c' or 'ab' (default abc)")
    ap.add_argument("--repeats", type=int, default=2, help="rounds; best and median reported (default 2)")
    ap.add_argument("--quick", action="store_true", help="smoke run: shorter outputs, one round")
    ap.add_argument("--quiet-budget", type=float, default=300,
                    help="seconds to spend waiting for other processes to go idle (default 300)")  # fmt: skip
    ap.add_argument("--json", help="also write the results to this JSON file")
    ap.add_argument("--peer", choices=["llama.cpp"], help="also (d): llama-server with and without its speculation")
    ap.add_argument("--llama-spec", action="append",
                    help=f"llama-server speculation flags, repeatable: one server each (default: {LLAMA_SPEC!r})")
    ap.add_argument("--gguf", help="the GGUF llama-server loads (default: Qwen2.5-Coder's, which oMLX imports)")
    args = ap.parse_args()
    if args.quick:
        args.edit_tokens, args.chat_tokens, args.stream_tokens, args.repeats = 64, 32, 24, 1
        args.quiet_budget = min(args.quiet_budget, 30)
    if args.model_path is None:
        from tests.support.qwen_coder import fetch_qwen_coder_gguf, qwen_coder_dir

        args.model_path = str(qwen_coder_dir())
        if args.peer and not args.gguf:
            args.gguf = str(fetch_qwen_coder_gguf(CACHE_DIR / "gguf" / "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"))
    if args.peer and not args.gguf:
        raise SystemExit("--peer with --model-path needs --gguf: the GGUF of the same model")
    model = prepare_model(args.model_path, as_is=args.as_is)
    info = header_info(sys.argv, model)
    edit = edit_prompt(model, args.file_tokens)
    chat = [{"role": "user", "content": CHAT}]
    streams = stream_prompts(model, args.stream_file_tokens, args.streams)
    works = [w for key, w in (("a", "edit"), ("b", "chat"), ("c", "streams")) if key in args.only]
    print(f"# bench_speculation — {info['date']}\n\nmachine: {machine_summary()}\n"
          f"model: {model.path} ({'as it is' if args.as_is else 'float32'})")
    print(f"workload: (a) edit, {model.count_tokens(edit[0]['content'])}-token prompt, {args.edit_tokens} tokens out; "
          f"(b) chat, {args.chat_tokens} tokens out; batch 1, greedy; (c) {len(streams)} streams of "
          f"~{args.stream_file_tokens}-token files, {args.stream_tokens} tokens out each; draft max {args.draft_max}; "
          f"{args.repeats} rounds; workloads: {', '.join(works)}")  # fmt: skip
    warn_if_busy()
    common = ["--hot-cache-only", "--max-concurrent-requests", str(max(8, args.streams)), *shlex.split(args.server_args)]
    sides = {
        "spec": Server("omlx", model, [*common, "--speculation", "--draft-max", str(args.draft_max)], "oMLX speculating"),
        "plain": Server("omlx", model, [*common, "--no-speculation"], "oMLX"),
    }
    llama_specs = args.llama_spec or [LLAMA_SPEC]
    if args.peer:
        lcp = ["--ctx-size", str(args.file_tokens * 2 + 1024), "--parallel", "1"]
        sides["llama"] = Server("llama_cpp", model, lcp, "llama-server", gguf=Path(args.gguf))
        for i, flags in enumerate(llama_specs, 1):
            sides[f"llama_spec{i}"] = Server("llama_cpp", model, [*lcp, *shlex.split(flags)], f"llama-server {flags}",
                                             gguf=Path(args.gguf))  # fmt: skip
        print(f"peer: {sides['llama'].command()[0]} on {args.gguf}, {' '.join(lcp)}; speculating with: "
              + "; ".join(llama_specs))
    quiet = QuietPolicy(args.quiet_budget)
    noise: list[float] = []
    figures: dict[str, list[float]] = {f"{w}_{s}": [] for w in works for s in sides}
    texts: dict[str, set[str]] = {f"{w}_{s}": set() for w in works for s in sides}
    shares: dict[str, list[tuple[float, float]]] = {s: [] for s in sides}  # (c): rows per step, tokens per row
    splits: dict[str, list[dict]] = {}  # per work and oMLX side: each round's step split

    def one(side: str, work: str) -> float:
        before = step_times(sides[side]) if side in ("spec", "plain") else None
        if work == "streams":
            tps = together(side)
        else:
            messages, n = (edit, args.edit_tokens) if work == "edit" else (chat, args.chat_tokens)
            (r,), _ = run(stream_many(sides[side], [messages], n))
            texts[f"{work}_{side}"].add(r.text)
            tps = r.decode_tps
        if before is not None:
            splits.setdefault(f"{work}_{side}", []).append(step_split(before, step_times(sides[side])))
        return tps

    def together(side: str) -> float:
        """(c): aggregate decode tok/s, all streams' tokens over their first token to their last."""
        before = step_times(sides[side])
        rs, _ = run(stream_many(sides[side], streams, args.stream_tokens))
        after = step_times(sides[side])
        loops, rows = after["loops"] - before["loops"], after["rows"] - before["rows"]
        shares[side].append((rows / max(1, loops), (after["tokens"] - before["tokens"]) / max(1, rows)))
        texts[f"streams_{side}"].add("\x00".join(r.text for r in rs))
        span = max(r.t_last for r in rs) - min(r.t_first for r in rs)
        return sum(r.completion_tokens for r in rs) / span if span > 0 else 0.0

    with serving(*sides.values()):
        for name, server in sides.items():
            log(f"starting {server.label}")
            server.start()
            log(f"  prefilling the prompts once (BLAS: {server.blas()})")
            for work in works if name in ("spec", "plain") else ("edit", "chat"):
                one(name, work)
        for rnd in range(1, args.repeats + 1):
            for work in works:
                order = [s for s in sides if work != "streams" or s in ("spec", "plain")]  # (c): oMLX only
                for side in order if rnd % 2 else order[::-1]:
                    log(f"round {rnd}: {work}, {sides[side].label}")
                    tps, others = quiet.measure(lambda s=side, w=work: one(s, w), lambda s=side: [sides[s].pid])
                    noise.append(others)
                    figures[f"{work}_{side}"].append(tps)
                    log(f"  decode {tps:.2f} tok/s (others used {others:.2f} cores)")
        logs = {name: server.log_path.read_text(errors="replace") for name, server in sides.items()}

    best = {k: max(v) for k, v in figures.items() if v}
    median = {k: statistics.median(v) for k, v in figures.items() if v}
    rows = []
    names = {"edit": "(a) edit batch-1 decode", "chat": "(b) chat batch-1 decode",
             "streams": f"(c) {len(streams)} edit streams, aggregate decode"}  # fmt: skip
    gpu = not cpu_device()  # issue #45 sets the H200's goals higher: a verify costs ~one step there
    for work, goal in (("edit", 2.5 if gpu else 2.0), ("chat", 0.95), ("streams", 1.3 if gpu else 1.0)):
        for how, agg in (("best", best), ("median", median)) if work in works else ():
            rows.append(Row(f"{names[work]}, {how}", agg[f"{work}_spec"], agg[f"{work}_plain"], "tok/s", True, goal,
                            "no speculation"))  # fmt: skip
    print_table("decode with vs without speculation", rows)
    same = {work: texts[f"{work}_spec"] == texts[f"{work}_plain"] and len(texts[f"{work}_spec"]) == 1 for work in works}
    print(f"\nsame text on both sides, every round: {', '.join(f'{w} {v}' for w, v in same.items())}")
    for side, got in shares.items():
        if got:
            print(f"(c) {sides[side].label}: rows per decode step {', '.join(f'{r:.2f}' for r, _ in got)}; "
                  f"tokens per row and step {', '.join(f'{t:.2f}' for _, t in got)}")  # fmt: skip
    print_splits(splits, works)
    drafted = [line.split("drafted=")[1] for line in logs["spec"].splitlines() if "drafted=" in line]
    print(f"speculating server's requests (drafted/accepted): {', '.join(d.replace(' accepted=', '/') for d in drafted)}")
    if args.peer:
        rows += peer_rows(best, median, sides, texts, logs)
    print(f"\nnoise: other processes used {mean(noise):.2f} cores on average (at most {max(noise):.2f}) "
          f"during the {len(noise)} measurements")  # fmt: skip
    write_json(args.json, {**info, "figures": figures, "same_text": same, "rows": [r.as_dict() for r in rows],
                           "texts": {k: sorted(v) for k, v in texts.items()}, "step_splits": splits})  # fmt: skip


def print_splits(splits: dict[str, list[dict]], works: list[str]) -> None:
    """Each workload's decode step split (ms per loop, medians over the measured rounds): the
    speculating server's verify steps and plain steps beside the other server's plain steps."""
    print("\n| workload | steps | loops | rows per loop | graph build | launch | device wait | host | total (ms) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for work in works:
        for side, kind in (("spec", "verify"), ("spec", "plain"), ("plain", "plain")):
            rounds = [r[kind] for r in splits.get(f"{work}_{side}", [])[1:] if kind in r]  # [0]: the prefill call
            if not rounds:
                continue
            med = {k: statistics.median(r[k] for r in rounds) for k in ("loops", "rows_per_loop", *SPLIT)}
            label = f"{'speculating' if side == 'spec' else 'no speculation'}: {kind}"
            print(f"| {work} | {label} | {med['loops']:.0f} | {med['rows_per_loop']:.1f} | "
                  + " | ".join(f"{med[p]:.2f}" for p in SPLIT) + f" | {sum(med[p] for p in SPLIT):.2f} |")


def peer_rows(best: dict, median: dict, sides: dict, texts: dict, logs: dict) -> list[Row]:
    """(d): print each llama-server speculation's speedup beside ours, and its figures; the rows."""
    rows = []
    for key in (k for k in sides if k.startswith("llama_spec")):
        name = sides[key].label.removeprefix("llama-server ")
        for work in ("edit", "chat"):
            for how, agg in (("best", best), ("median", median)):
                rows.append(Row(f"(d) {work} speedup, {how}", agg[f"{work}_spec"] / agg[f"{work}_plain"],
                                agg[f"{work}_{key}"] / agg[f"{work}_llama"], "x", True, None, "llama-server"))  # fmt: skip
            rows.append(Row(f"(d) {work} with speculation, best", best[f"{work}_spec"], best[f"{work}_{key}"], "tok/s",
                            True, None, "llama-server"))  # fmt: skip
        print_table(f"(d) speedup of speculation: oMLX vs llama-server {name}", rows[-6:])
        same = {w: texts[f"{w}_{key}"] == texts[f"{w}_llama"] and len(texts[f"{w}_llama"]) == 1 for w in ("edit", "chat")}
        acc = [line.split("draft acceptance = ")[1].strip() for line in logs[key].splitlines() if "draft acceptance = " in line]
        distinct = ", ".join(f"{w} {len(texts[f'{w}_llama'])}/{len(texts[f'{w}_{key}'])}" for w in ("edit", "chat"))
        print(f"\nllama-server {name}: same text as without, every round: edit {same['edit']}, chat {same['chat']} "
              f"(distinct texts without/with: {distinct}); its requests' draft acceptance (one line per request that "
              f"drafted, warm-up included): {'; '.join(acc) or 'none logged'}")  # fmt: skip
    for work in ("edit", "chat"):
        rows.append(Row(f"(d) {work} without speculation, best", best[f"{work}_plain"], best[f"{work}_llama"], "tok/s",
                        True, None, "llama-server"))  # fmt: skip
    print_table("(d) batch-1 decode without speculation: oMLX (float32) vs llama-server (the GGUF)", rows[-2:])
    return rows


if __name__ == "__main__":
    main()
