"""The prefix cache for models whose layers are not all plain KV (sliding windows, recurrent and
hybrid caches), at the cache level with real tiny mlx-lm models: prefill in chunks ending on
block boundaries, snapshots there, store, restore, continue; hit == miss exactly (CPU float32)."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from omlx.cache.block.hashing import model_fingerprint
from omlx.cache.block.kinds import cache_kinds, flatten, model_kinds
from omlx.cache.interface import NoCache
from omlx.cache.plan import decide
from omlx.cache.prefix_cache import PrefixCache, make_prefix_cache
from omlx.cache.tiers.ssd.tier import SSDTier
from omlx.cache.tiers.tiers import Tiers
from tests.support.cache_parts import make_tiers, restore
from tests.support.tiny_kinds import ARCHS, build_tiny_arch
from tests.support.tiny_model import build_tiny_llama

B = 16  # tokens per block
# (architecture, sliding window): windows smaller and larger than a block
CASES = [
    ("gpt_oss", 8), ("gpt_oss", 40), ("gemma3_text", 8), ("gemma3_text", 40),
    ("qwen3_next", 0), ("qwen3_5", 0), ("lfm2", 0), ("mamba2", 0), ("falcon_h1", 0),
]  # fmt: skip
MODELS: dict[tuple[str, int], Any] = {}


@pytest.fixture(params=CASES, ids=lambda c: f"{c[0]}-w{c[1]}" if c[1] else c[0])
def model(request, tmp_path_factory) -> Any:
    if request.param not in MODELS:
        name, window = request.param
        folder = build_tiny_arch(tmp_path_factory.mktemp(name) / name, ARCHS[name](window))
        MODELS[request.param] = mlx_lm.load(str(folder))[0]
    return MODELS[request.param]


def prefix_cache(model: Any, store: Tiers) -> PrefixCache:
    kinds, why = model_kinds(model)
    assert kinds is not None and kinds.stateful, why
    fp = model_fingerprint("tiny", "weights", "float32", kinds.kv_format(), store.block_size)
    return PrefixCache(store, fp, len(kinds.leaves), "tiny", kinds=kinds)


def evaluate(cache: list[Any]) -> None:
    mx.eval([a for _, a in tree_flatten([c.state for c in cache]) if isinstance(a, mx.array)])


def prefill(model: Any, pc: PrefixCache, cache: list[Any], tokens: list[int], start: int) -> dict[int, Any]:
    """All but the last token from `start` on, in chunks ending on the cache's capture points;
    the snapshots taken there and at the prefill's end."""
    states = {}
    points = pc.blocks.capture_points(len(tokens), start)
    assert all(p % B == 0 and start < p < len(tokens) for p in points)
    at = start
    for end in [*points, len(tokens) - 1]:
        if end > at:
            model(mx.array([tokens[at:end]]), cache=cache)
            evaluate(cache)
            at = end
            states[end] = pc.blocks.snapshot(cache)
    return states


def greedy(model: Any, pc: PrefixCache, cache: list[Any], last: int, n: int, at: int, states: dict) -> list[int]:
    """`n` greedy tokens after `last` (the cache holds `at` tokens), snapshots where the
    decode crosses a block boundary going into `states`."""
    out = []
    for _ in range(n):
        logits = model(mx.array([[last]]), cache=cache)
        at += 1
        last = int(mx.argmax(logits[0, -1]).item())
        out.append(last)
        if at % B == 0:
            states[at] = pc.blocks.snapshot(cache)
    return out


def miss(model: Any, pc: PrefixCache, tokens: list[int], n: int = 10) -> tuple[list[int], list[Any], dict]:
    cache = make_prompt_cache(model)
    states = prefill(model, pc, cache, tokens, 0)
    out = greedy(model, pc, cache, tokens[-1], n, len(tokens) - 1, states)
    states[len(tokens) - 1 + n] = pc.blocks.snapshot(cache)  # where the sequence ends: its tail's state
    return out, cache, states


def hit(model: Any, pc: PrefixCache, tokens: list[int], n: int = 10) -> tuple[list[int], int]:
    restored, cached = restore(pc, tokens)
    assert restored is not None
    prefill(model, pc, restored, tokens, cached)
    return greedy(model, pc, restored, tokens[-1], n, len(tokens) - 1, {}), cached


# `store` is handed the tokens the cache has seen (the prompt but its last token after a prefill,
# prompt and answer but the answer's last after a decode): a model of recurrent layers alone
# (mamba2) has no offset to cut a longer list at

def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def test_restored_caches_are_the_model_s_own_classes(model) -> None:
    pc = prefix_cache(model, make_tiers(B, 1 << 30))
    tokens = prompt(1, 3 * B + 5)
    _, cache, states = miss(model, pc, tokens, n=0)
    pc.store(tokens[:-1], cache, final=False, boundary_states=states)
    restored, cached = restore(pc, tokens)
    assert cached == len(tokens) - 1  # three full blocks and the tail, stored at its end
    assert [type(c) for c in restored] == [type(c) for c in make_prompt_cache(model)]
    for c, kind in zip(flatten(restored), pc.blocks.kinds.leaves, strict=True):
        if isinstance(c, RotatingKVCache):
            assert c.max_size == kind.window and c.offset == cached and c.keys.shape[2] == min(kind.window, cached)
        elif isinstance(c, KVCache):
            assert c.offset == cached and c.keys.shape[2] == cached
        else:
            assert isinstance(c, ArraysCache) and all(a is not None for a in c.cache)


def test_hit_equals_miss_for_the_same_prompt_and_a_longer_one(model) -> None:
    pc = prefix_cache(model, make_tiers(B, 1 << 30))
    tokens = prompt(2, 4 * B + 7)
    first, cache, states = miss(model, pc, tokens)
    pc.store(tokens[:-1], cache, final=False, boundary_states=states)
    again, cached = hit(model, pc, tokens)
    assert again == first and cached == len(tokens) - 1
    longer = tokens + prompt(3, B + 3)  # goes on from the stored tail: its state at its end is used
    expected, _, _ = miss(model, pc, longer)
    got, cached = hit(model, pc, longer)
    assert got == expected and cached == len(tokens) - 1
    other = tokens[: 4 * B + 3] + prompt(9, B)  # leaves the tail inside it: full blocks only
    expected, _, _ = miss(model, pc, other)
    got, cached = hit(model, pc, other)
    assert got == expected and cached == 4 * B


def test_a_multi_turn_conversation_hits_every_turn(model) -> None:
    pc = prefix_cache(model, make_tiers(B, 1 << 30))
    history = prompt(4, 2 * B + 3)
    for turn in range(3):
        answer, cache, states = miss(model, pc, history, n=B + 2)  # crosses a block boundary
        if turn:
            got, cached = hit(model, pc, history, n=B + 2)
            assert got == answer and cached == len(history) - 1 - 6  # all but the new message
        pc.store((history + answer)[:-1], cache, final=True, boundary_states=states)
        history = history + answer + prompt(10 + turn, 6)


def test_restart_then_hit_equals_miss(model, tmp_path: Path) -> None:
    pc = prefix_cache(model, make_tiers(B, 1 << 30, ssd=tmp_path))
    ssd = pc.tiers.ssd
    tokens = prompt(5, 3 * B + 9)
    expected, cache, states = miss(model, pc, tokens)
    pc.store(tokens[:-1], cache, final=False, boundary_states=states)
    while pc.tick(idle=True):
        pass
    assert ssd.flush(10) and ssd.stats()["writes"] == 4  # three full blocks and the tail
    pc.close(timeout=1.0)
    ssd.close()
    fresh = prefix_cache(model, make_tiers(B, 1 << 30, ssd=tmp_path))
    got, cached = hit(model, fresh, tokens)
    assert got == expected and cached == len(tokens) - 1
    fresh.close(timeout=1.0)
    fresh.tiers.close()


def test_two_prompts_sharing_a_system_prompt_share_its_blocks(model) -> None:
    store = make_tiers(B, 1 << 30)
    pc = prefix_cache(model, store)
    system = prompt(6, 3 * B)
    a, b = system + prompt(7, B + 4), system + prompt(8, 2 * B + 5)
    _, cache, states = miss(model, pc, a)
    pc.store(a[:-1], cache, final=False, boundary_states=states)
    blocks = store.device.stats()["blocks"]
    expected, cache, states = miss(model, pc, b)
    got, cached = hit(model, pc, b)
    assert got == expected and cached == 3 * B  # the system prompt's blocks, from a's prefill
    pc.store(b[:-1], cache, final=False, boundary_states=states)
    assert store.device.stats()["blocks"] == blocks + 3  # b's own two blocks and tail; none of the system's


def test_a_snapshot_of_a_batch_row_is_that_sequence_s_own(model) -> None:
    pc = prefix_cache(model, make_tiers(B, 1 << 30))
    solo = []
    for seed in (11, 12):
        cache = make_prompt_cache(model)
        prefill(model, pc, cache, prompt(seed, 2 * B + 1), 0)
        solo.append(cache)
    batch = [type(a).merge([a, b]) for a, b in zip(*solo, strict=True)]
    for row in (0, 1):
        own, of_row = pc.blocks.snapshot(solo[row]), pc.blocks.snapshot(batch, row=row)
        assert sorted(own) == sorted(of_row) and own
        assert all(mx.array_equal(own[name], of_row[name]).item() for name in own)


def test_a_first_ssd_restore_probed_on_part_of_its_run_still_equals_the_miss(model, tmp_path: Path) -> None:
    tokens = prompt(13, 9 * B + 2)
    ssd, fresh, expected = stored_then_restarted(model, tmp_path, tokens)
    fresh.observe_prefill(64, 0, 60.0)  # recomputing is known (and slow): the unmeasured SSD is probed first
    assert decide.due_probe(fresh.costs.ssd_rate.snapshot(), fresh.costs.costs())
    got, cached = hit(model, fresh, tokens)
    assert got == expected and cached == len(tokens) - 1
    assert fresh.costs.state_bytes > 0  # the state told apart
    # timed (a model of recurrent layers alone reads no KV from its run, so nothing there to time:
    # its one state read here is the tail's, which no tier's rate is charged with, as for plain KV)
    assert fresh.costs.ssd_rate.value is not None or not any(k.kind == "kv" for k in fresh.blocks.kinds.leaves)
    fresh.close(timeout=1.0)
    ssd.close()


def test_kv_bytes_per_token_counts_the_kv_leaves_alone(model) -> None:
    from omlx.cache.block.kv_layout import kv_bytes_per_token

    kinds, _ = model_kinds(model)
    kv_leaves = sum(k.kind == "kv" for k in kinds.leaves)
    assert (kv_bytes_per_token(model) > 0) == (kv_leaves > 0)  # falcon_h1's are inside CacheLists
    assert kv_bytes_per_token(model) % (kv_leaves or 1) == 0  # the same bytes per token per leaf here


def pushed_out_to_ram(model, seed: int, length: int) -> tuple[Tiers, Any, list[int], list[int]]:
    """(store, prefix cache, prompt, the miss's tokens): the prompt's blocks stored, then all
    yielded by the hot tier to RAM."""
    store = make_tiers(B, 1 << 30, ram_bytes=1 << 30)
    pc = prefix_cache(model, store)
    tokens = prompt(seed, length)
    expected, cache, states = miss(model, pc, tokens)
    pc.store(tokens[:-1], cache, final=False, boundary_states=states)
    assert pc.yield_memory(1 << 30) > 0 and store.device.stats()["blocks"] == 0
    return store, pc, tokens, expected


def test_blocks_pushed_out_to_ram_restore_equal_to_the_miss(model) -> None:
    store, pc, tokens, expected = pushed_out_to_ram(model, 14, 3 * B + 5)
    assert store.ram.stats()["blocks"] == 4  # three full blocks and the tail, as host bytes
    got, cached = hit(model, pc, tokens)
    assert got == expected and cached == len(tokens) - 1


def batch_generate(model: Any, entries: list[tuple[list[int], list[Any] | None, list[int]]], n: int) -> list[list[int]]:
    """Greedy tokens through mlx-lm's `BatchGenerator`, each entry (tokens still to prefill,
    restored cache or None, the tokens the cache holds) as one sequence of one batch."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=n)
    uids = gen.insert(
        [rest for rest, _, _ in entries], caches=[c for _, c, _ in entries], all_tokens=[held for _, _, held in entries]
    )
    out: dict[int, list[int]] = {uid: [] for uid in uids}
    while any(len(v) < n for v in out.values()):
        for r in gen.next_generated():
            out[r.uid].append(r.token)
    gen.close()
    return [out[uid] for uid in uids]


def test_restored_caches_serve_batch_generator_mixed_with_a_miss(model) -> None:
    pc = prefix_cache(model, make_tiers(B, 1 << 30))
    a, b = prompt(15, 3 * B + 6), prompt(16, 2 * B + 9)
    alone = [batch_generate(model, [(p, None, [])], 8)[0] for p in (a, b)]
    _, cache, states = miss(model, pc, a, n=0)
    pc.store(a[:-1], cache, final=False, boundary_states=states)
    restored, cached = restore(pc, a)
    assert cached == len(a) - 1
    together = batch_generate(model, [(a[cached:], restored, a[:cached]), (b, None, [])], 8)
    assert together == alone


# A restore of n blocks from RAM or the SSD reads the KV of all n and the state of block n alone
# (docs/design/cache-kinds.md, "Recurrent state size"): prompts that leave the stored tail
# inside them, so that the last full block's state is the one used.

def state_names(host_names: list[str]) -> list[str]:
    return [n for n in host_names if ".window." in n or ".arrays." in n]


def stored_then_restarted(model: Any, tmp_path: Path, tokens: list[int]) -> tuple[SSDTier, PrefixCache, list[int]]:
    """`tokens`' blocks stored and written to the SSD; a fresh tier and cache over that directory,
    and the miss's greedy output."""
    pc = prefix_cache(model, make_tiers(B, 1 << 30, ssd=tmp_path))
    expected, cache, states = miss(model, pc, tokens)
    pc.store(tokens[:-1], cache, final=False, boundary_states=states)
    while pc.tick(idle=True):
        pass
    assert pc.tiers.ssd.flush(10)
    pc.close(timeout=1.0)
    pc.tiers.close()
    fresh = prefix_cache(model, make_tiers(B, 1 << 30, ssd=tmp_path))
    return fresh.tiers.ssd, fresh, expected


def test_an_ssd_restore_reads_the_state_of_its_last_block_alone(model, tmp_path: Path, monkeypatch) -> None:
    from omlx.cache.block.hashing import block_keys
    from tests.unit.test_cache_kinds_format import flip, header

    tokens = prompt(15, 4 * B + 9)
    ssd, pc, _ = stored_then_restarted(model, tmp_path, tokens)
    other = tokens[: 4 * B + 3] + prompt(16, B)  # leaves the stored tail inside it
    keys = block_keys(pc.fingerprint, other, B)[:4]
    for key in (keys[0], keys[2]):  # earlier blocks' states damaged on disk: never read, never checked
        for name in state_names(list(header(ssd.path_for(key)))):
            flip(ssd.path_for(key), name)
    reads: list[tuple[str, str]] = []
    real = SSDTier._load
    monkeypatch.setattr(SSDTier, "_load", lambda self, path, key, fp, part="all": reads.append((key, part)) or real(self, path, key, fp, part))
    expected, _, _ = miss(model, pc, other)
    got, cached = hit(model, pc, other)
    assert got == expected and cached == 4 * B
    assert {k for k, part in reads if part == "kv"} == set(keys) and [r for r in reads if r[1] != "kv"] == [(keys[3], "state")]
    assert [pc.tiers.device.peek(k).partial for k in keys] == [True] * 3 + [False]  # KV-only, block n whole
    assert ssd.stats()["discarded"] == 0
    if any(k.kind == "kv" for k in pc.blocks.kinds.leaves):  # a KV tensor damaged is found: the restore ends before it
        flip(ssd.path_for(keys[2]), next(n for n in header(ssd.path_for(keys[2])) if n.endswith(".keys") and ".window." not in n))
        pc.close(timeout=1.0)
        ssd.close()
        pc = prefix_cache(model, make_tiers(B, 1 << 30, ssd=tmp_path))  # restarted: nothing hot
        ssd = pc.tiers.ssd
        reads.clear()
        got, cached = hit(model, pc, other)
        assert got == expected and cached == 2 * B and ssd.stats()["discarded"] == 1
        assert [r for r in reads if r[1] != "kv"] == [(keys[1], "state")]
    pc.close(timeout=1.0)
    ssd.close()


def test_a_ram_restore_copies_the_state_of_its_last_block_alone(model, monkeypatch) -> None:
    from omlx.cache.block import block as block_module
    from omlx.cache.block.hashing import block_keys

    store, pc, tokens, _ = pushed_out_to_ram(model, 17, 4 * B + 9)
    assert store.ram.stats()["blocks"] == 5
    other = tokens[: 4 * B + 3] + prompt(18, B)
    expected, _, _ = miss(model, pc, other)
    made: list[list[str]] = []  # the tensors made into MLX arrays, per block read
    real = block_module.from_host
    monkeypatch.setattr(block_module, "from_host", lambda host, whole=None: made.append(list(host)) or real(host, whole))
    got, cached = hit(model, pc, other)
    assert got == expected and cached == 4 * B
    assert len(made) == 5 and [bool(state_names(names)) for names in made] == [False] * 4 + [True]
    assert store.ram.stats()["blocks"] == 5  # RAM keeps every block whole: copied from, not moved
    assert [store.device.peek(k).partial for k in block_keys(pc.fingerprint, other, B)[:4]] == [True] * 3 + [False]
    made.clear()
    again, cached = hit(model, pc, other)  # the next turn: all hot (KV-only blocks, block n whole), no read
    assert again == expected and cached == 4 * B and made == []


# The run a restore read KV-only stays hot as KV-only copies (`Residency.KV_ONLY`), block n whole:
# later turns are hot hits; a KV-only copy is never handed on to RAM or the SSD (cache-kinds.md).

def hit_then_store(model: Any, pc: PrefixCache, tokens: list[int]) -> tuple[list[int], int]:
    """`hit`, then the prompt's blocks stored as the engine stores them after its prefill."""
    restored, cached = restore(pc, tokens)
    assert restored is not None
    states = prefill(model, pc, restored, tokens, cached)
    pc.store(tokens[:-1], restored, final=False, boundary_states=states)
    return greedy(model, pc, restored, tokens[-1], 10, len(tokens) - 1, {}), cached


def test_after_an_ssd_restore_the_next_turns_are_hot_hits(model, tmp_path: Path, monkeypatch) -> None:
    from omlx.cache.block.hashing import block_keys
    from omlx.cache.tiers.residency import Residency

    tokens = prompt(21, 4 * B + 9)
    ssd, pc, _ = stored_then_restarted(model, tmp_path, tokens)
    other = tokens[: 4 * B + 3] + prompt(22, B)  # leaves the stored tail inside it
    keys = block_keys(pc.fingerprint, other, B)[:4]
    reads: list[tuple[str, str]] = []
    real = SSDTier._load
    monkeypatch.setattr(SSDTier, "_load", lambda self, path, key, fp, part="all": reads.append((key, part)) or real(self, path, key, fp, part))
    expected, _, _ = miss(model, pc, other)
    got, cached = hit_then_store(model, pc, other)
    assert got == expected and cached == 4 * B and len(reads) == 5
    on_ssd = Residency.SSD
    assert [pc.tiers.residency(k, pc.fingerprint) for k in keys] == [Residency.HOT | Residency.KV_ONLY | on_ssd] * 3 + [Residency.HOT | on_ssd]
    reads.clear()
    again, cached = hit(model, pc, other)  # the same prompt again: every block hot, nothing read
    assert again == expected and cached == len(other) - 1 and reads == []
    longer = other + prompt(23, B + 5)  # the next turn goes on from the stored prompt
    expected, _, _ = miss(model, pc, longer)
    got, cached = hit(model, pc, longer)
    assert got == expected and cached == len(other) - 1 and reads == []
    while pc.tick(idle=True):
        pass
    assert ssd.flush(10) and ssd.stats()["blocks"] == 5 + 2  # the new block and tail written, whole
    pc.close(timeout=1.0)
    ssd.close()


def test_kv_only_copies_let_go_by_the_hot_tier_reach_neither_ram_nor_the_ssd(model, tmp_path: Path, monkeypatch) -> None:
    from omlx.cache.block.hashing import block_keys
    from omlx.cache.tiers.residency import Residency

    tokens = prompt(24, 4 * B + 9)
    ssd, pc, _ = stored_then_restarted(model, tmp_path, tokens)
    pc.close(timeout=1.0)
    store = make_tiers(B, 1 << 30, ram_bytes=1 << 30, demote_bound=1 << 30, ssd=tmp_path)
    ssd = store.ssd
    pc = prefix_cache(model, store)
    other = tokens[: 4 * B + 3] + prompt(25, B)
    keys = block_keys(pc.fingerprint, other, B)[:4]
    puts: list[bool] = []
    real = SSDTier.put
    monkeypatch.setattr(SSDTier, "put", lambda self, block: puts.append(block.partial) or real(self, block))
    expected, _, _ = miss(model, pc, other)
    got, cached = hit(model, pc, other)
    assert got == expected and cached == 4 * B
    assert store.device.shed(1 << 30) > 0  # every hot block let go (not yield_memory: it copies at once)
    assert [store.directory.is_demoting(k) for k in keys] == [False] * 3 + [True]  # block n waits for its copy to RAM
    while pc.write_back.step(idle=True):
        pass
    assert [store.residency(k, pc.fingerprint) for k in keys] == [Residency.SSD] * 3 + [Residency.RAM | Residency.SSD]
    assert True not in puts and store.ram.stats()["blocks"] == 1 and ssd.flush(10) and ssd.stats()["blocks"] == 5
    pc.close(timeout=1.0)
    ssd.close()


def test_without_the_last_block_s_state_the_restore_ends_a_block_earlier_then_a_store_upgrades_it(model, tmp_path: Path) -> None:
    from omlx.cache.block.hashing import block_keys
    from tests.unit.test_cache_kinds_format import flip, header

    tokens = prompt(26, 4 * B + 9)
    ssd, pc, _ = stored_then_restarted(model, tmp_path, tokens)
    keys = block_keys(pc.fingerprint, tokens, B)[:4]
    hit(model, pc, tokens[: 4 * B + 3] + prompt(27, B))  # blocks 1-3 now hot KV-only, block 4 whole
    for name in state_names(list(header(ssd.path_for(keys[2])))):
        flip(ssd.path_for(keys[2]), name)  # block 3's state: in no tier now
    short = tokens[: 3 * B + 3] + prompt(28, B)
    expected, _, _ = miss(model, pc, short)
    got, cached = hit_then_store(model, pc, short)
    assert got == expected and cached == 2 * B and ssd.stats()["discarded"] == 1  # block 2's state read
    assert not pc.tiers.device.peek(keys[2]).partial  # its store made block 3 whole: the KV-only copy upgraded
    again, cached = hit(model, pc, short)
    assert again == expected and cached == len(short) - 1
    pc.close(timeout=1.0)
    ssd.close()


def test_only_models_with_layer_states_read_a_restore_by_part() -> None:
    # a CacheList of KV caches alone (DeepSeek-V3.2's kind) holds no state: its restores read
    # whole blocks as a plain-KV model's do, and RAM runs may move
    from mlx_lm.models.cache import CacheList

    from omlx.cache.block.kinds import cache_kinds

    store = make_tiers(16, 1 << 20)
    kv_pairs, _ = cache_kinds([CacheList(KVCache(), KVCache()) for _ in range(2)])
    recurrent, _ = cache_kinds([KVCache(), ArraysCache(2)])
    assert kv_pairs is not None and not kv_pairs.plain_kv and not kv_pairs.stateful
    assert not PrefixCache(store, "fp-a", 2, "m", kinds=kv_pairs).loader.kv_only
    assert PrefixCache(store, "fp-b", 2, "m", kinds=recurrent).loader.kv_only


# ----- the factory and the tiny architectures themselves (moved from test_cache_kinds_format.py: they load models)

def loaded(folder: Path, model) -> SimpleNamespace:
    return SimpleNamespace(model=model, info=SimpleNamespace(id=folder.name, path=folder), compute_dtype="float32")


def test_the_factory_caches_stateful_models_only_for_an_engine_that_captures_states(tmp_path: Path) -> None:
    import mlx_lm

    store = make_tiers(16, 1 << 30)
    folder = build_tiny_arch(tmp_path / "gpt", ARCHS["gpt_oss"](8))
    model = mlx_lm.load(str(folder))[0]
    assert isinstance(make_prefix_cache(store, loaded(folder, model)), NoCache)
    cache = make_prefix_cache(store, loaded(folder, model), captures_states=True)
    assert isinstance(cache, PrefixCache) and cache.blocks.kinds is not None
    assert cache.blocks.capture_points(70, 0) == [16, 32, 48, 64] and cache.blocks.capture_points(70, 40) == [48, 64]
    llama = build_tiny_llama(tmp_path / "llama", layers=2, hidden=64, heads=2, kv_heads=1)
    plain = make_prefix_cache(store, loaded(llama, mlx_lm.load(str(llama))[0]))
    assert isinstance(plain, PrefixCache) and plain.blocks.kinds is None  # unchanged for plain KV
    assert plain.blocks.capture_points(70, 0) == [] and plain.blocks.snapshot([]) is None
    assert NoCache().blocks.capture_points(70, 0) == [] and NoCache().blocks.snapshot([]) is None


def test_a_stateful_model_s_blocks_are_a_prefill_chunk_long_by_default(tmp_path: Path) -> None:
    # capturing a state at every 256-token block cut a 2,048-token GPU prefill chunk into eight and
    # stored eight windows or recurrent states (docs/design/cache-kinds.md, "Block size")
    import mlx_lm

    from omlx.engine.config import EngineConfig

    config = EngineConfig.resolve(prefill_step_size=64, solo_prefill_step_size=128)
    assert config.stateful_block_size("auto") == 128 and config.stateful_block_size("48") == 48
    with pytest.raises(ValueError):
        config.stateful_block_size("8")
    store = make_tiers(16, 1 << 30)
    folder = build_tiny_arch(tmp_path / "lfm2", ARCHS["lfm2"](0))
    stateful = make_prefix_cache(store, loaded(folder, mlx_lm.load(str(folder))[0]), captures_states=True, stateful_block_size=128)
    assert stateful.blocks.block_size == 128 and stateful.blocks.capture_points(300, 0) == [128, 256]
    same = make_prefix_cache(store, loaded(folder, mlx_lm.load(str(folder))[0]), captures_states=True, stateful_block_size=16)
    assert same.fingerprint != stateful.fingerprint  # blocks of another size never serve it
    llama = build_tiny_llama(tmp_path / "llama", layers=2, hidden=64, heads=2, kv_heads=1)
    plain = make_prefix_cache(store, loaded(llama, mlx_lm.load(str(llama))[0]), captures_states=True, stateful_block_size=128)
    assert plain.blocks.block_size == 16  # plain KV keeps the store's blocks


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_each_tiny_architecture_loads_with_mlx_lm_and_generates(name: str, tmp_path: Path) -> None:
    import mlx_lm

    folder = build_tiny_arch(tmp_path / name, ARCHS[name]())
    assert sum(f.stat().st_size for f in folder.iterdir()) < 4 << 20  # a few MB at most
    model, tokenizer = mlx_lm.load(str(folder))
    kinds, _ = cache_kinds(model.make_cache())
    assert kinds is not None and kinds.stateful  # a real mix of kinds, not all KV
    ids = [t for r in mlx_lm.stream_generate(model, tokenizer, "The quick brown fox", max_tokens=8) for t in [r.token]]
    assert len(ids) == 8 and len(set(ids)) > 1  # greedy output that varies


# ----- negative control: a wrong restored state must change the output -------------------------
def next_logits(model: Any, cache: list[Any], tokens: list[int]) -> mx.array:
    """The logits after feeding `tokens` to `cache` (float32, CPU: compared exactly where they must agree)."""
    return model(mx.array([tokens]), cache=cache)[0, -1]


def test_a_restore_given_the_previous_block_s_state_answers_differently(model, monkeypatch) -> None:
    # hit == miss means something only if a wrong state shows: restore block n-1's state in place of
    # block n's (the KV of all n blocks as it should be) and the next logits must differ from the miss's
    from omlx.cache.block import layer_states

    pc = prefix_cache(model, make_tiers(B, 1 << 30))
    tokens = prompt(31, 4 * B + 1)  # four whole blocks: the restore ends on block 4's state
    _, cache, states = miss(model, pc, tokens, n=0)
    pc.store(tokens[:-1], cache, final=False, boundary_states=states)
    fresh = make_prompt_cache(model)
    want = next_logits(model, fresh, tokens)  # from scratch
    right, cached = restore(pc, tokens)
    assert cached == 4 * B and mx.allclose(next_logits(model, right, tokens[cached:]), want, atol=1e-4).item()
    real = layer_states.restore

    def one_block_early(kinds: Any, parts: list[tuple[Any, int]]) -> list[Any]:
        (last, used), (before, _) = parts[-1], parts[-2]
        states = {n: t for n, t in before.tensors.items() if ".window." in n or ".arrays." in n}
        swapped = type(last)(last.key, last.parent, last.fingerprint, last.token_count, last.layer_types, {**last.tensors, **states})
        return real(kinds, [*parts[:-1], (swapped, used)])

    monkeypatch.setattr(layer_states, "restore", one_block_early)
    wrong, cached = restore(pc, tokens)
    assert cached == 4 * B
    assert not mx.allclose(next_logits(model, wrong, tokens[cached:]), want, atol=1e-4).item()
