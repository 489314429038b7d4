"""The SSD tier's reader pools: reads ahead shared by key, and no deadlock when a read is done
before its completion callback is added (the callback then runs at once, lock held)."""

from __future__ import annotations

import threading
from concurrent.futures import Future

from omlx.cache.tiers.ssd.reads import ReadPools, TimedRead


class DoneAtOnce:
    """An executor whose futures are done before `submit` returns."""

    def submit(self, fn, *args):
        future: Future = Future()
        future.set_result(fn(*args))
        return future

    def shutdown(self, wait: bool = True) -> None:
        return None


def test_a_read_done_before_its_callback_is_added_does_not_deadlock() -> None:
    pools = ReadPools(2)
    pools._pools["ahead"] = DoneAtOnce()
    out: list = []
    t = threading.Thread(
        target=lambda: out.append(pools.ahead(["a", "b"], lambda k: TimedRead(None, 0.0, 0.0), shared=True)), daemon=True
    )
    t.start()
    t.join(5)
    assert not t.is_alive() and len(out[0]) == 2 and all(f.done() for f in out[0])
    assert pools._ahead == {}  # each forgotten once done


def test_a_key_read_ahead_twice_is_read_once() -> None:
    pools = ReadPools(1)
    release = threading.Event()
    reads: list[str] = []

    def read(key: str) -> TimedRead:
        reads.append(key)
        release.wait(5)
        return TimedRead(None, 0.0, 0.0)

    first = pools.ahead(["a"], read, shared=True)
    second = pools.ahead(["a"], read, shared=True)
    assert first[0] is second[0]
    unshared = pools.ahead(["a"], read, shared=False)
    release.set()
    assert first[0].result(5) and unshared[0].result(5)
    assert reads == ["a", "a"]
    pools.close()
    assert [f.result() for f in pools.ahead(["x"], read, shared=True)] == [TimedRead(None, 0.0, 0.0)]


def test_reads_a_caller_waits_on_keep_their_order() -> None:
    pools = ReadPools(4)
    assert pools.map(lambda k: k.upper(), ["a", "b", "c"]) == ["A", "B", "C"]
    pools.close()
