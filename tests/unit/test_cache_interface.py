"""The prefix cache behind one interface: what an engine may ask of it (checked on every access the
engine makes to the cache object, whatever the variable holding it is called), the cache that caches
nothing, and the tick through which the cache schedules its own background work."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from omlx.cache.interface import BlockSpec, NoCache, PrefixCacheInterface
from omlx.cache.plan.restore_plan import RestorePlan
from omlx.cache.prefix_cache import PrefixCache
from tests.support.cache_parts import make_tiers

CACHE_DIR = Path(__file__).resolve().parents[2] / "omlx" / "cache"
ENGINE_DIR = CACHE_DIR.parent / "engine"
INTERFACE = "PrefixCacheInterface"
B = 16


def members(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


def stated() -> set[str]:
    return set(PrefixCacheInterface.__annotations__) | members(PrefixCacheInterface)


def names_the_interface(annotation: ast.expr | None) -> bool:
    """Whether an annotation is `PrefixCacheInterface` (also quoted, or in a union)."""
    return annotation is not None and INTERFACE in ast.unparse(annotation)


class CacheAccesses(ast.NodeVisitor):
    """Every attribute the engine reads of its prefix cache: the cache object is followed from what
    is annotated with the interface (parameters, class attributes) through `self.x = ...` and local
    assignments, whatever the names; `holders` are the `self` attributes found to hold it."""

    def __init__(self) -> None:
        self.holders: set[str] = set()
        self.asked: dict[str, set[str]] = {}  # attribute -> where it was asked ("file:line")
        self.where = ""

    def collect_holders(self, tree: ast.Module) -> None:
        """`self` attributes that hold the cache: annotated so, or assigned from a parameter annotated so."""
        for node in ast.walk(tree):
            if isinstance(node, ast.AnnAssign) and names_the_interface(node.annotation):
                target = node.target
                if isinstance(target, ast.Name):
                    self.holders.add(target.id)  # a class attribute (`cache: PrefixCacheInterface`)
                elif isinstance(target, ast.Attribute):
                    self.holders.add(target.attr)
            if isinstance(node, ast.FunctionDef):
                params = {a.arg for a in node.args.args + node.args.kwonlyargs if names_the_interface(a.annotation)}
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Assign):
                        for target in sub.targets:
                            for name, value in pairs(target, sub.value):
                                if isinstance(name, ast.Attribute) and isinstance(value, ast.Name) and value.id in params:
                                    self.holders.add(name.attr)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        local = {a.arg for a in node.args.args + node.args.kwonlyargs if names_the_interface(a.annotation)}
        for _ in range(3):  # aliases of aliases
            for sub in ast.walk(node):
                if isinstance(sub, ast.Assign):
                    for target in sub.targets:
                        for name, value in pairs(target, sub.value):
                            if isinstance(name, ast.Name) and self.is_cache(value, local):
                                local.add(name.id)
                if isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Name) and names_the_interface(sub.annotation):
                    local.add(sub.target.id)
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and self.is_cache(sub.value, local):
                self.asked.setdefault(sub.attr, set()).add(f"{self.where}:{sub.lineno}")

    def is_cache(self, node: ast.expr, local: set[str]) -> bool:
        if isinstance(node, ast.Name):
            return node.id in local
        return isinstance(node, ast.Attribute) and node.attr in self.holders and isinstance(node.value, ast.Name)


def pairs(target: ast.expr, value: ast.expr) -> list[tuple[ast.expr, ast.expr]]:
    """(target, value) of a plain or tuple assignment (`a, b = x, y`)."""
    if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
        return list(zip(target.elts, value.elts, strict=True))
    return [(target, value)]


def engine_accesses() -> CacheAccesses:
    visitor = CacheAccesses()
    trees = {path: ast.parse(path.read_text()) for path in sorted(ENGINE_DIR.glob("*.py"))}
    for tree in trees.values():
        visitor.collect_holders(tree)
    for path, tree in trees.items():
        visitor.where = path.name
        visitor.visit(tree)
    return visitor


def test_every_access_the_engine_makes_to_its_cache_is_in_the_interface() -> None:
    found = engine_accesses()
    assert {"cache", "prefix_cache"} <= found.holders  # the runner's and the engine's, whatever else
    asked = set(found.asked)
    assert {"match", "load", "advance", "cache_for", "store", "tick"} <= asked, asked
    outside = {name: sorted(found.asked[name]) for name in asked - stated()}
    assert not outside, outside


def test_the_guard_sees_an_access_through_any_name() -> None:
    code = '''
class R:
    def __init__(self, whatever: PrefixCacheInterface) -> None:
        self.thing = whatever
    def f(self) -> None:
        other = self.thing
        again = other
        again.lookup([1])
        self.thing.grid
'''
    visitor = CacheAccesses()
    tree = ast.parse(code)
    visitor.collect_holders(tree)
    visitor.visit(tree)
    assert {"lookup", "grid"} <= set(visitor.asked) and "thing" in visitor.holders


def test_the_interface_has_about_ten_members_and_none_only_tests_use() -> None:
    interface = stated()
    assert len(interface) <= 12, sorted(interface)
    gone = {"lookup", "prefetch", "take", "write_back", "probe_idle", "record", "wants_prompt_blocks",
            "prefill_seconds", "capture_points", "snapshot", "grid", "block_size"}  # fmt: skip
    assert not interface & gone
    used = set(engine_accesses().asked)
    assert interface <= used, interface - used  # every member is one the engine uses


def test_both_caches_keep_the_contract_with_the_same_signatures() -> None:
    assert isinstance(NoCache(), PrefixCacheInterface)
    for cls in (NoCache, PrefixCache):
        for name in members(PrefixCacheInterface) - set(PrefixCacheInterface.__annotations__):
            expected = inspect.signature(getattr(PrefixCacheInterface, name))
            assert list(inspect.signature(getattr(cls, name)).parameters) == list(expected.parameters), (cls, name)
    assert NoCache.blocks == BlockSpec() and not NoCache.blocks.captures_states


def test_the_cache_that_caches_nothing() -> None:
    cache = NoCache()
    plan = cache.match([1, 2, 3])
    assert plan == RestorePlan(3, 0, stores_after_prefill=False) and not plan.worth_storing(1000, 0)
    loading = cache.load(plan)
    assert not loading.pending and cache.advance(loading, move=True) and cache.cache_for(loading) == (None, 0)
    assert cache.store([1, 2, 3], [], final=True) == 0 and plan.recompute_seconds(10, 0) is None
    assert cache.tick(idle=True) is False
    assert cache.hot_bytes() == 0 and cache.yield_memory(1 << 20) == 0
    assert cache.blocks.capture_points(100, 0) == [] and cache.blocks.snapshot([]) is None


def test_no_cache_module_imports_the_engine() -> None:
    for path in CACHE_DIR.rglob("*.py"):
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
    cache = PrefixCache(make_tiers(B, ssd=tmp_path), "f" * 64, 2, "m")
    ssd = cache.tiers.ssd
    tokens = list(range(10, 10 + 8 * B + 1))
    cache.store(tokens, kv(len(tokens)), final=True)
    for _ in range(100):
        if not cache.tick(idle=True):
            break
    assert ssd.flush(10) and ssd.stats()["writes"] == 9  # 8 full blocks and the tail
    assert cache.costs.ssd_rate.value is None
    cache.tick(idle=True)  # the idle timing starts its reads on the reader threads ...
    for future in cache.idle_probe.in_flight or ():
        future.result(10)
    cache.tick(idle=True)  # ... and the next idle tick finishes it
    assert cache.costs.ssd_rate.value is not None
    cache.close(timeout=1.0)
    ssd.close()


def test_tick_saves_measurements_a_throttled_save_left_behind(tmp_path: Path) -> None:
    cache = PrefixCache(make_tiers(B, ssd=tmp_path), "f" * 64, 2, "m")
    cache.observe_prefill(1000, 0, 0.5)  # saved
    cache.observe_prefill(1000, 0, 0.4)  # within the throttle: not yet
    assert cache.cost_file is not None and cache.cost_file.unsaved
    cache.tick(idle=False)
    assert cache.cost_file.unsaved  # busy: later
    cache.tick(idle=True)
    assert not cache.cost_file.unsaved
    cache.close(timeout=1.0)
    cache.tiers.close()


def test_tick_leaves_the_idle_timing_while_another_engine_is_busy(tmp_path: Path) -> None:
    cache = PrefixCache(make_tiers(B, ssd=tmp_path), "f" * 64, 2, "m")
    probes: list[int] = []
    cache.idle_probe.step = lambda: probes.append(1)  # type: ignore[method-assign]
    cache.tick(idle=True, quiet=False)
    cache.tick(idle=False)
    assert probes == []
    cache.tick(idle=True)
    assert probes == [1]
    cache.close(timeout=1.0)
    cache.tiers.close()


def test_the_plan_is_pure_the_loader_acts_and_nothing_links_the_calls(tmp_path: Path) -> None:
    # the same plan carried out twice restores the same; a plan made for one prompt never changes
    # what another prompt's plan finds (no state kept between `match`, `load` and `cache_for`)
    cache = PrefixCache(make_tiers(B, ssd=tmp_path), "f" * 64, 2, "m")
    tokens = list(range(10, 10 + 4 * B + 1))
    cache.store(tokens, kv(len(tokens)), final=True)
    plan = cache.match(tokens)
    assert plan == cache.match(tokens) and plan.tokens == 4 * B  # no side effect: asked twice, same answer
    other = cache.match(list(range(500, 500 + 4 * B + 1)))
    first = cache.cache_for(cache.load(plan))
    second = cache.cache_for(cache.load(plan))
    assert first[1] == second[1] == 4 * B and cache.cache_for(cache.load(other)) == (None, 0)
    assert cache.tiers.stats()["requests"] == 3  # each carried-out plan counted once
    cache.close(timeout=1.0)
    cache.tiers.close()


def test_an_image_digest_keys_the_block_holding_the_images_first_token_and_all_after(tmp_path: Path) -> None:
    """Two requests of the same tokens whose images differ (their digests, the extra keys) share the
    blocks before the block holding an image's first token, and of that block (through the
    token-level tail index) only the tokens before the image; nothing from there on."""
    cache = PrefixCache(make_tiers(B, ssd=None), "f" * 64, 2, "m")
    tokens = list(range(10, 10 + 4 * B + 1))
    at = 2 * B + 3  # the image starts inside block 2
    cache.store(tokens, kv(len(tokens)), final=True, image_keys={at: b"circle" * 5})
    assert cache.match(tokens, image_keys={at: b"circle" * 5}).tokens == 4 * B
    assert cache.match(tokens, image_keys={at: b"square" * 5}).tokens == at
    assert cache.match(tokens, image_keys={at + 1: b"circle" * 5}).tokens == at  # where it starts counts too
    assert cache.match(tokens).tokens == at
    # a prompt ending inside the image's block: its tail (keyed by tokens and the digest) is found again
    short = tokens[: at + 6]
    cache.store(short, kv(len(short)), final=True, image_keys={at: b"circle" * 5})
    assert cache.match(short + [1], image_keys={at: b"circle" * 5}).tokens == len(short)
    assert cache.match(short + [1], image_keys={at: b"square" * 5}).tokens == at
    cache.close(timeout=1.0)
    cache.tiers.close()
