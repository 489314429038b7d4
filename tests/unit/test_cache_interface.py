"""The prefix cache behind one interface: what an engine may ask of it, the cache that caches
nothing, and the tick through which the cache schedules its own background work."""

from __future__ import annotations

import ast
import inspect
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from omlx.cache.hot_tier import HotTier
from omlx.cache.interface import NoCache, PrefixCacheInterface
from omlx.cache.prefix_cache import PrefixCache
from omlx.cache.ssd_tier import SSDTier
from omlx.cache.store import CacheStore

CACHE_DIR = Path(__file__).resolve().parents[2] / "omlx" / "cache"
B = 16


def members(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


ENGINE_DIR = CACHE_DIR.parent / "engine"


def test_the_interface_states_everything_the_engine_asks() -> None:
    # every attribute the engine reads of its cache (`prefix_cache.x`, the runner's `self.cache.x`)
    asked = set()
    for path in ENGINE_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute | ast.Name):
                owner = node.value.attr if isinstance(node.value, ast.Attribute) else node.value.id
                if owner in ("prefix_cache", "cache") and not (isinstance(node.value, ast.Name) and owner == "cache"):
                    asked.add(node.attr)
    stated = set(PrefixCacheInterface.__annotations__) | members(PrefixCacheInterface)
    assert {"lookup", "store", "tick"} <= asked, asked
    assert asked <= stated, asked - stated


def test_both_caches_keep_the_contract_with_the_same_signatures() -> None:
    assert isinstance(NoCache(), PrefixCacheInterface)
    for cls in (NoCache, PrefixCache):
        for name in members(PrefixCacheInterface):
            expected = inspect.signature(getattr(PrefixCacheInterface, name))
            assert list(inspect.signature(getattr(cls, name)).parameters) == list(expected.parameters), (cls, name)
        assert hasattr(cls, "grid") and cls.grid == 0


def test_the_cache_that_caches_nothing() -> None:
    cache = NoCache()
    assert cache.lookup([1, 2, 3]) == (None, 0)
    assert cache.prefetch([1, 2, 3], lambda: None) is None
    assert cache.store([1, 2, 3], [], final=True) == 0
    assert not cache.wants_prompt_blocks(1000, 0) and cache.prefill_seconds(10, 0) is None
    assert cache.tick(idle=True) is False and cache.write_back(True) is False
    assert cache.hot_bytes() == 0 and cache.yield_memory(1 << 20) == 0


def test_no_cache_module_imports_the_engine() -> None:
    for path in CACHE_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [n for n in names if n.startswith("omlx.engine")], path.name


def kv(tokens: int) -> list[KVCache]:
    caches = []
    for layer in range(2):
        c = KVCache()
        k = mx.random.normal((1, 2, tokens, 8), key=mx.random.key(layer))
        c.state = (k, k + 1, tokens)
        caches.append(c)
    return caches


def test_tick_writes_back_then_times_the_ssd_while_idle(tmp_path: Path) -> None:
    ssd = SSDTier(tmp_path, 1 << 30)
    assert ssd.wait_ready(10)
    cache = PrefixCache(CacheStore(HotTier(1 << 30), ssd, B), "f" * 64, 2, "m")
    tokens = list(range(10, 10 + 8 * B + 1))
    cache.store(tokens, kv(len(tokens)), final=True)
    for _ in range(100):
        if not cache.tick(idle=True):
            break
    assert ssd.flush(10) and ssd.stats()["writes"] == 9  # 8 full blocks and the tail
    assert cache.ssd_rate.value is None
    for _ in range(500):  # the idle timing of the SSD, on the reader threads
        cache.tick(idle=True)
        if cache.ssd_rate.value is not None:
            break
        time.sleep(0.01)
    assert cache.ssd_rate.value is not None
    cache.close(timeout=1.0)
    ssd.close()


def test_tick_saves_measurements_a_throttled_save_left_behind(tmp_path: Path) -> None:
    ssd = SSDTier(tmp_path, 1 << 30)
    assert ssd.wait_ready(10)
    cache = PrefixCache(CacheStore(HotTier(1 << 30), ssd, B), "f" * 64, 2, "m")
    cache.observe_prefill(1000, 0, 0.5)  # saved
    cache.observe_prefill(1000, 0, 0.4)  # within the throttle: not yet
    assert cache.cost_file is not None and cache.cost_file.unsaved
    cache.tick(idle=False)
    assert cache.cost_file.unsaved  # busy: later
    cache.tick(idle=True)
    assert not cache.cost_file.unsaved
    cache.close(timeout=1.0)
    ssd.close()


def test_tick_leaves_the_idle_timing_while_another_engine_is_busy(tmp_path: Path) -> None:
    ssd = SSDTier(tmp_path, 1 << 30)
    assert ssd.wait_ready(10)
    cache = PrefixCache(CacheStore(HotTier(1 << 30), ssd, B), "f" * 64, 2, "m")
    probes: list[int] = []
    cache.probe_idle = lambda: probes.append(1)  # type: ignore[method-assign]
    cache.tick(idle=True, quiet=False)
    cache.tick(idle=False)
    assert probes == []
    cache.tick(idle=True)
    assert probes == [1]
    cache.close(timeout=1.0)
    ssd.close()
