"""Raw mlx-lm, no server: the ceiling our engine is measured against.

Run as a child process by bench_serving.py (with the same BLAS preload as the servers),
never imported by the driver. Reads a JSON job on stdin, prints one JSON result line.

Jobs:
  {"mode": "stream_generate", "model": PATH, "messages": [...], "max_tokens": N,
   "no_eos_bias": {"2": -100}, "warmup_tokens": 32}
      batch-1 decode through `mlx_lm.stream_generate`, greedy, fixed length.
  {"mode": "batch_generator", "model": PATH, "conversations": [[...], ...], "max_tokens": N,
   "no_eos_bias": {...}, "warmup_tokens": 16}
      all conversations together through `mlx_lm.generate.BatchGenerator`.
"""

from __future__ import annotations

import json
import sys
import time


def _prompt(tokenizer, messages):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)


def stream_generate_job(job, model, tokenizer):
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    bias = {int(k): v for k, v in job["no_eos_bias"].items()}
    prompt = _prompt(tokenizer, job["messages"])

    def once(max_tokens):
        t0 = time.perf_counter()
        stamps = []
        n = 0
        for _ in stream_generate(
            model,
            tokenizer,
            prompt,
            max_tokens=max_tokens,
            sampler=make_sampler(0.0),
            logits_processors=make_logits_processors(logit_bias=bias),
        ):
            stamps.append(time.perf_counter())
            n += 1
        return t0, stamps, n

    once(job.get("warmup_tokens", 32))
    t0, stamps, n = once(job["max_tokens"])
    span = stamps[-1] - stamps[0]
    return {
        "prompt_tokens": len(prompt),
        "completion_tokens": n,
        "ttft": stamps[0] - t0,
        "decode_tps": (n - 1) / span if span > 0 else 0.0,
    }


def batch_generator_job(job, model, tokenizer):
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_logits_processors

    bias = {int(k): v for k, v in job["no_eos_bias"].items()}
    prompts = [_prompt(tokenizer, m) for m in job["conversations"]]

    def once(max_tokens):
        gen = BatchGenerator(
            model,
            stop_tokens=[[t] for t in tokenizer.eos_token_ids],
            completion_batch_size=len(prompts),
            prefill_batch_size=min(8, len(prompts)),
        )
        t0 = time.perf_counter()
        gen.insert(
            prompts,
            max_tokens=[max_tokens] * len(prompts),
            logits_processors=[make_logits_processors(logit_bias=bias) for _ in prompts],
        )
        first: dict[int, float] = {}
        total = 0
        done = 0
        while done < len(prompts):
            _, responses = gen.next()
            now = time.perf_counter()
            for r in responses:
                first.setdefault(r.uid, now)
                total += 1
                if r.finish_reason is not None:
                    done += 1
        wall = time.perf_counter() - t0
        gen.close()
        return t0, first, total, wall

    once(job.get("warmup_tokens", 16))
    t0, first, total, wall = once(job["max_tokens"])
    return {
        "completion_tokens": total,
        "wall_s": wall,
        "aggregate_tps": total / wall,
        "mean_ttft": sum(t - t0 for t in first.values()) / len(first),
    }


def main() -> None:
    job = json.loads(sys.stdin.read())
    import mlx.core as mx
    from mlx_lm import load

    model, tokenizer = load(job["model"])
    model.set_dtype(mx.float32)  # the prepared copy is float32 already; make sure
    mx.eval(model.parameters())
    fn = {"stream_generate": stream_generate_job, "batch_generator": batch_generator_job}[
        job["mode"]
    ]
    print(json.dumps(fn(job, model, tokenizer)), flush=True)


if __name__ == "__main__":
    main()
