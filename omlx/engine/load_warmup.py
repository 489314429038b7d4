"""A few tokens generated once at load, through the paths requests take.

MLX builds some kernels on first use (the CUDA backend compiles them at run time), and the
first batch whose prompts differ in length pays for it; paying that here keeps it out of the
first users' TTFT (docs/design/graph-warmup.md, "At load").
"""

from __future__ import annotations

from typing import Any

from mlx_lm.generate import BatchGenerator

from omlx.engine.request import SamplingParams
from omlx.engine.sampling import build_logits_processors, build_sampler
from omlx.engine.solo import SoloSequence, feed_chunks_together


def warm_up(model: Any, tokenizer: Any, bg: BatchGenerator, eos_ids: list[int], *, own_prefill: bool, solo: bool) -> None:
    """Newcomers joining `bg` two at once then one (one sampled with processors), prefilled
    as the engine would; then a solo sequence's chunked prefill and pipelined decode."""
    ids = tokenizer.encode("Warm up: the quick brown fox jumps over the lazy dog. " * 3)
    ids = ([t for t in ids if t not in eos_ids] * 4)[:24]
    sampled = SamplingParams(temperature=0.7, top_p=0.9, logit_bias={ids[0]: -1.0})
    newcomers = [
        (ids[:9], None, []),
        (ids[:15], build_sampler(sampled), build_logits_processors(sampled)),
        (ids[:5], None, []),
    ]
    for group in (newcomers[:2], newcomers[2:]):
        _join(model, bg, group, own_prefill)
        bg.next()
    finished = 0
    for _ in range(256):  # bounded: 3 sequences of <= 3 tokens
        _, generated = bg.next()
        finished += sum(1 for r in generated if r.finish_reason is not None)
        if finished == 3:
            break
    if solo:  # chunked prefill, then pipelined decode, on a plain cache
        seq = SoloSequence(
            model, ids[:11], cache=None, cached=[], sampler=None,
            logits_processors=build_logits_processors(sampled), prefill_step_size=4,
        )  # fmt: skip
        while not seq.prefill():
            pass
        for launch in (True, True, False):
            seq.next(launch=launch)


def _join(model: Any, bg: BatchGenerator, group: list[tuple[list[int], Any, list[Any]]], own_prefill: bool) -> None:
    """Insert `group` into `bg`: prefilled here in chunks (`own_prefill`, the first chunks in
    one batch) or by the BatchGenerator, whose prompts of different lengths take its padded path."""
    seqs = [
        SoloSequence(
            model, prompt, cache=None, cached=[], sampler=sampler, logits_processors=processors, prefill_step_size=4
        )
        for prompt, sampler, processors in group
    ]
    if own_prefill:
        while not all(feed_chunks_together(seqs)):
            pass
    for seq, (prompt, sampler, processors) in zip(seqs, group, strict=True):
        todo, cache, fed = prompt, None, None
        if own_prefill:
            seq.wait()
            todo, cache, fed = seq.handoff()
        bg.insert(
            [todo], max_tokens=[3], caches=[cache] if cache else None, all_tokens=[fed] if fed else None,
            samplers=[sampler] if sampler is not None else None, logits_processors=[processors],
        )  # fmt: skip
