"""A stateful model's solo sequence ends its prefill chunks on the prefix cache's capture points
and snapshots its layer states there, at the prefill's end and where decode crosses a block
boundary; plain-KV models and `NoCache` capture nothing (docs/design/cache-kinds.md)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from omlx.cache.block.hashing import model_fingerprint
from omlx.cache.block.kinds import model_kinds
from omlx.cache.interface import NoCache
from omlx.cache.prefix_cache import PrefixCache
from omlx.engine.layer_captures import Captures
from omlx.engine.solo import SoloSequence
from tests.support.cache_parts import make_tiers
from tests.support.tiny_kinds import ARCHS, build_tiny_arch

B = 16


def prefix_cache(model) -> PrefixCache:
    kinds, _ = model_kinds(model)
    fp = model_fingerprint("tiny", "w", "float32", kinds.kv_format(), B)
    return PrefixCache(make_tiers(B, 1 << 30), fp, len(kinds.leaves), "tiny", kinds=kinds)


@pytest.fixture(scope="module", params=["gpt_oss", "mamba2"])
def model(request, tmp_path_factory: pytest.TempPathFactory):
    folder = build_tiny_arch(tmp_path_factory.mktemp(request.param) / request.param, ARCHS[request.param]())
    return mlx_lm.load(str(folder))[0]


def arrays(state) -> list[mx.array]:
    return [a for _, a in tree_flatten(state) if isinstance(a, mx.array)]


def test_chunks_end_on_capture_points_and_states_are_taken_there_and_at_block_ends(model) -> None:
    pc = prefix_cache(model)
    assert pc.blocks.captures_states and not NoCache().blocks.captures_states
    prompt = [(7 * i) % 500 + 3 for i in range(3 * B + 5)]
    captures = Captures(pc.blocks, len(prompt), 0)
    assert captures.points == [B, 2 * B, 3 * B]
    seq = SoloSequence(
        model, prompt, cache=None, cached=[], sampler=None, logits_processors=[], prefill_step_size=40, captures=captures
    )
    ends = []
    while not seq.prefill():
        ends.append(len(seq.fed))
    assert ends == [B, 2 * B, 40, 3 * B]  # on the step's multiples, and never past a capture point
    for _ in range(2 * B):
        seq.next(launch=True)
    decoded = len(seq.fed)
    assert set(captures.states) == {B, 2 * B, 3 * B, len(prompt) - 1, *range(4 * B, decoded + 1, B)}
    # the state at a point is the one a cache fed just those tokens holds (up to the rounding
    # of a recurrent scan cut into other chunks)
    alone = make_prompt_cache(model)
    model(mx.array([prompt[: 2 * B]]), cache=alone)
    for got, want in zip(arrays(captures.states[2 * B]), arrays(pc.blocks.snapshot(alone)), strict=True):
        assert mx.allclose(got, want, atol=1e-5).item()


def test_a_plain_kv_model_captures_nothing(tiny_model_dir: Path) -> None:
    model = mlx_lm.load(str(tiny_model_dir / "tiny-llama"))[0]
    kinds, _ = model_kinds(model)
    store = make_tiers(B, 1 << 30)
    pc = PrefixCache(store, model_fingerprint("t", "w", "float32", kinds.kv_format(), B), len(kinds.leaves), "t", kinds=kinds)
    assert not pc.blocks.captures_states and Captures(pc.blocks, 5 * B, 0).points == []
