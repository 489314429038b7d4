"""Samplers as the engine builds them for requests."""

from __future__ import annotations

from omlx.engine.request import SamplingParams
from omlx.engine.sampling import build_sampler


def test_unseeded_requests_with_one_parameter_set_share_a_sampler() -> None:
    # BatchGenerator samples a batch in one call only when every sequence has the same
    # sampler object; otherwise one call per sequence (a top-p sort over the vocabulary each)
    warm = SamplingParams(temperature=0.7, top_p=0.9)
    assert build_sampler(warm) is build_sampler(SamplingParams(temperature=0.7, top_p=0.9))
    assert build_sampler(warm) is not build_sampler(SamplingParams(temperature=0.7, top_p=0.8))
    assert build_sampler(SamplingParams(temperature=0.0)) is None  # greedy: the batch's own argmax
    seeded = SamplingParams(temperature=0.7, top_p=0.9, seed=1)
    assert build_sampler(seeded) is not build_sampler(seeded)  # each carries its own PRNG key
