"""The engine's scheduler with fake runner outputs and no model: admission order, memory
admission and pauses, backpressure, cancel in every status, in-flight prefix sharing, the
solo/batch hand-off, store requests and failure recovery."""

from __future__ import annotations

import subprocess
import sys

import pytest

from omlx.cache.loader.loading import Loading
from omlx.cache.plan.restore_plan import RestorePlan
from omlx.engine import request_state
from omlx.engine.kv_budget import RESERVE_MARGIN_TOKENS, KvBudget
from omlx.engine.output import Output
from omlx.engine.request import GenerationEvent, GenerationRequest, TokenLogprob
from omlx.engine.request_state import RequestState, Status, StepOut, TokenOut
from omlx.engine.scheduler import Admission, Admitted, Places, Scheduler, shared_blocks
from omlx.engine.stop_strings import StopStringMatcher
from omlx.errors import OverloadedError, ServiceUnavailableError


class Detok:
    """A detokenizer whose token i reads as "<i>"."""

    def __init__(self) -> None:
        self._text = ""
        self.finalized = False

    def add_token(self, token: int) -> None:
        self._text += f"<{token}>"

    @property
    def last_segment(self) -> str:
        segment, self._text = self._text, ""
        return segment

    def finalize(self) -> None:
        self.finalized = True


class FakeMemory:
    """`room` bytes for the sequences; the hot tier can give `hot` more."""

    def __init__(self, room: int, hot: int = 0) -> None:
        self._room, self.hot, self.asked = room, hot, []

    def room(self, held_bytes: int) -> int:
        return self._room

    def yield_memory(self, nbytes: int) -> int:
        self.asked.append(nbytes)
        freed = min(nbytes, self.hot)
        self.hot -= freed
        self._room += freed
        return freed


class Solo:
    def __init__(self, prefilling: bool) -> None:
        self.prefilling = prefilling


def make(max_concurrent: int = 4) -> tuple[Scheduler, list[tuple[RequestState, GenerationEvent]]]:
    sent: list[tuple[RequestState, GenerationEvent]] = []
    output = Output("m", sent.extend, lambda logprobs, token, top: TokenLogprob(token, -1.0))
    output.eos_ids = [0]
    return Scheduler(max_concurrent, output), sent


def state(rid: str, prompt: list[int] | None = None, max_tokens: int = 8, stop: list[str] | None = None) -> RequestState:
    s = RequestState(GenerationRequest(rid, prompt if prompt is not None else [1, 2, 3], max_tokens, stop=stop or []))
    return s


def start(sched: Scheduler, s: RequestState, kind: Admission = Admission.BATCH, cached: int = 0) -> None:
    """What the runner does to an admitted request, then the scheduler's record of it."""
    s.prompt_len, s.cached_tokens = len(s.request.prompt_tokens), cached
    s.detokenizer, s.stops = Detok(), StopStringMatcher(s.request.stop)
    if kind in (Admission.SOLO, Admission.PREFILL):
        s.solo = Solo(prefilling=True)
    sched.admitted(s, Admitted(kind))


def admit_all(sched: Scheduler, kind: Admission = Admission.BATCH) -> list[str]:
    got = []
    for s in sched.admissions():
        got.append(s.id)
        start(sched, s, kind)
    return got


def running_ids(sched: Scheduler) -> list[str]:
    return [s.id for s in sched.running.values()]


def decode(sched: Scheduler, s: RequestState, token: int = 5) -> None:
    sched.update([TokenOut(s, token)])


# ----- admission ------------------------------------------------------------------------
def test_requests_are_admitted_first_come_first_up_to_max_concurrent() -> None:
    sched, _ = make(max_concurrent=2)
    for rid in "abc":
        sched.submit(state(rid))
    assert [s.status for s in sched.waiting] == [Status.WAITING] * 3
    assert admit_all(sched) == ["a", "b"]
    assert running_ids(sched) == ["a", "b"] and [s.id for s in sched.waiting] == ["c"]
    assert all(s.status is Status.PREFILLING for s in sched.running.values())
    sched.finish(next(iter(sched.running.values())), "length")
    assert admit_all(sched) == ["c"]


def test_requests_that_share_an_id_run_side_by_side() -> None:
    sched, sent = make()
    a, b = state("same"), state("same")
    sched.submit(a)
    sched.submit(b)
    assert admit_all(sched) == ["same", "same"] and list(sched.running.values()) == [a, b]
    sched.finish(a, "length")
    assert list(sched.running.values()) == [b] and sched.by_id["same"] is b


def test_a_read_ahead_takes_a_place_and_comes_back_first_in_line() -> None:
    sched, _ = make(max_concurrent=2)
    a, b, c = state("a"), state("b"), state("c")
    for s in (a, b, c):
        sched.submit(s)
    chosen = sched.admissions()
    assert next(chosen) is a
    loading = Loading(RestorePlan(10, 16))
    sched.admitted(a, Admitted(Admission.RESTORE, loading))
    assert next(chosen) is b
    start(sched, b)
    assert list(chosen) == []  # a restoring and b running fill both places
    assert a.status is Status.RESTORING and sched.restoring == {a: loading}
    sched.restored([(a, loading)])
    assert list(sched.waiting) == [a, c] and a.loading is loading and a.status is Status.WAITING


def test_the_scheduler_holds_each_restoring_request_s_plan_and_names_the_one_that_moves() -> None:
    sched, _ = make(max_concurrent=3)
    reads, moves = Loading(RestorePlan(10, 16)), Loading(RestorePlan(40, 16), to_move=["k"])
    for s, loading in ((state("a"), reads), (state("b"), moves)):
        sched.submit(s)
        assert next(sched.admissions()) is s
        sched.admitted(s, Admitted(Admission.RESTORE, loading))
    assert [lo.plan.prompt_tokens for lo in sched.restoring.values()] == [10, 40]
    assert sched.moving_from_ram() and sched.mover() is moves  # only a RAM run's moves need the engine thread
    moves.to_move.clear()
    assert not sched.moving_from_ram() and sched.mover() is None


def test_requests_with_nothing_to_generate_or_failing_admission_are_answered_at_once() -> None:
    sched, sent = make()
    a, b = state("a"), state("b")
    sched.submit(a)
    sched.submit(b)
    chosen = sched.admissions()
    sched.admitted(next(chosen), Admitted(Admission.ANSWERED, event=GenerationEvent(finish_reason="length")))
    sched.admitted(next(chosen), Admitted(Admission.FAILED, event=GenerationEvent(finish_reason="error", error="x")))
    assert [(s.id, e.finish_reason) for s, e in sent] == [("a", "length"), ("b", "error")]
    assert not sched.by_id and not sched.running and a.status is b.status is Status.FINISHED


# ----- memory admission -----------------------------------------------------------------
def memory_sched(room: int, hot: int = 0) -> tuple[Scheduler, FakeMemory]:
    sched, _ = make()
    sched.budget = KvBudget(bytes_per_token=1, device_bytes=10**12)
    sched.memory = FakeMemory(room, hot)
    return sched, sched.memory


def test_a_request_whose_reservation_does_not_fit_waits_first_in_line() -> None:
    sched, memory = memory_sched(room=1000)
    big = RESERVE_MARGIN_TOKENS  # reserves 100 + the margin
    a, b, c = state("a", list(range(100)), max_tokens=big), state("b", list(range(400)), max_tokens=big), state("c")
    sched.submit(a)
    assert admit_all(sched) == ["a"]  # one alone always goes
    assert a.reserved == 100 + RESERVE_MARGIN_TOKENS
    sched.submit(b)
    sched.submit(c)
    assert admit_all(sched) == []  # b does not fit, and nobody passes it
    assert [s.id for s in sched.waiting] == ["b", "c"]
    assert memory.asked == [a.reserved + 400 + RESERVE_MARGIN_TOKENS - 1000]
    sched.finish(a, "length")
    assert admit_all(sched) == ["b", "c"]  # alone again: b goes; c's small reservation fits


def test_an_image_prompt_reserves_its_vision_tower_s_activations_too() -> None:
    import numpy as np

    from omlx.engine.vision_input import VisionInput

    sched, memory = memory_sched(room=1000)
    sched.submit(state("a", list(range(100)), max_tokens=100))  # reserves 200
    image = state("image", list(range(100)), max_tokens=100)  # reserves 200 of KV, and its encoder's peak
    image.request.vision = VisionInput(np.zeros((16, 4)), np.array([[1, 4, 4]]), [(10, 4)], activation_bytes=700)
    sched.submit(image)
    assert admit_all(sched) == ["a"]
    assert memory.asked == [200 + 200 + 700 - 1000]


def test_the_hot_tier_yields_before_a_request_waits() -> None:
    for hot, admitted in ((10**6, ["a", "b"]), (50, ["a"])):
        sched, memory = memory_sched(room=600, hot=hot)
        sched.submit(state("a", list(range(100)), max_tokens=100))  # reserves 200
        sched.submit(state("b", list(range(400)), max_tokens=100))  # reserves 500: 100 short
        assert admit_all(sched) == admitted
        assert memory.asked == [100]


def test_decoding_sequences_that_outgrow_memory_pause_the_newest_which_resumes_first() -> None:
    sched, memory = memory_sched(room=10**6)
    a, b, c = state("a", list(range(100))), state("b", list(range(100))), state("c", list(range(100)))
    for s in (a, b, c):
        sched.submit(s)
    admit_all(sched)
    for i, s in enumerate((a, b, c)):
        s.start = float(i)
        decode(sched, s)
    assert sched.outgrown() is None
    memory._room = 250  # they hold 303 bytes
    victim, short = sched.outgrown()
    assert victim is c and short == 303 - 250
    sched.prompt_stores.append(c)
    sched.paused(c)
    assert c.status is Status.PAUSED and list(sched.waiting) == [c] and c.seq not in sched.running
    assert c not in sched.prompt_stores and sched.paused_for_memory == 1
    assert sched.fits(c)  # a paused sequence goes on whatever it needs
    assert next(sched.admissions()) is c
    sched.admitted(c, Admitted(Admission.RESUMED))
    assert c.status is Status.DECODING and sched.running[c.seq] is c


def test_a_lone_decoding_sequence_or_a_solo_one_is_never_paused() -> None:
    sched, memory = memory_sched(room=10)
    a, b = state("a", list(range(100))), state("b", list(range(100)))
    sched.submit(a)
    start(sched, sched.admissions().__next__(), Admission.SOLO)
    decode(sched, a)
    assert sched.outgrown() is None  # one sequence
    sched.submit(b)
    sched.waiting.popleft()
    start(sched, b)
    assert sched.outgrown() is None  # b has no token yet, a runs alone outside the batch


# ----- backpressure -----------------------------------------------------------------------
def requests(*ids: str) -> list[GenerationRequest]:
    return [GenerationRequest(rid, [1], 1) for rid in ids]


def test_places_are_claimed_for_all_or_none_and_given_back() -> None:
    places = Places("m", max_concurrent=1, max_waiting=1)
    places.reserve(requests("a", "b"))
    with pytest.raises(OverloadedError) as refused:
        places.reserve(requests("c"))
    assert refused.value.retry_after == 2 and places.outstanding == 2
    places.give_back(requests("b")[0])
    places.give_back(requests("b")[0])  # once only
    assert places.outstanding == 1
    places.take(requests("a")[0])  # reserved: nothing more is claimed
    assert places.outstanding == 1 and not places.reserved
    places.take(requests("d")[0])  # not reserved: claimed now
    assert places.outstanding == 2
    with pytest.raises(OverloadedError):
        places.take(requests("e")[0])
    places.finished()
    places.finished()
    assert places.outstanding == 0


def test_places_are_refused_while_stopping_or_when_the_check_fails() -> None:
    places = Places("m", 4, 4)
    places.stopping = "shutting down"
    with pytest.raises(ServiceUnavailableError):
        places.reserve(requests("a"))
    with pytest.raises(ServiceUnavailableError):
        places.take(requests("a")[0])

    def lost() -> None:
        raise RuntimeError("lost")

    with pytest.raises(RuntimeError):
        Places("m", 4, 4, check=lost).reserve(requests("a"))


# ----- cancel ----------------------------------------------------------------------------
@pytest.mark.parametrize("status", ["waiting", "restoring", "paused"])
def test_a_request_cancelled_in_line_leaves_it(status: str) -> None:
    sched, sent = make()
    s, other = state("s"), state("other")
    sched.submit(s)
    sched.submit(other)
    if status != "waiting":
        chosen = sched.admissions()
        assert next(chosen) is s
        if status == "restoring":
            sched.admitted(s, Admitted(Admission.RESTORE, Loading(RestorePlan(10, 16))))
        else:
            start(sched, s)
            decode(sched, s)
            sched.paused(s)
            sent.clear()
        chosen.close()
    assert sched.cancel("s") is None
    assert s.status is Status.FINISHED and s not in sched.waiting and s not in sched.restoring
    assert "s" not in sched.by_id and [x.id for x in sched.waiting] == ["other"] and not sent


@pytest.mark.parametrize("kind", [Admission.BATCH, Admission.SOLO, Admission.PREFILL])
@pytest.mark.parametrize("decoding", [False, True])
def test_a_running_request_cancelled_is_returned_to_stop_then_forgotten(kind: Admission, decoding: bool) -> None:
    sched, _ = make()
    s = state("s")
    sched.submit(s)
    start(sched, next(sched.admissions()), kind)
    if decoding:
        decode(sched, s)
    sched.prompt_stores.append(s)
    assert s.status is (Status.DECODING if decoding else Status.PREFILLING)
    assert sched.cancel("s") is s  # the caller stores what it computed and stops it
    sched.forget(s)
    assert s.status is Status.FINISHED and not sched.running and not sched.by_id
    assert sched.solo is None and not sched.prefilling and not sched.prompt_stores


def test_cancelling_an_unknown_or_finished_request_does_nothing() -> None:
    sched, _ = make()
    s = state("s")
    sched.submit(s)
    start(sched, next(sched.admissions()))
    sched.finish(s, "length")
    assert sched.cancel("s") is None and sched.cancel("nobody") is None


# ----- in-flight prefix sharing ------------------------------------------------------------
def test_a_request_whose_prompt_is_mostly_being_prefilled_waits_for_those_blocks() -> None:
    sched, _ = make()
    sched.block_size = 4
    prompt = list(range(16))
    first, retry, other = state("first", prompt), state("retry", prompt + [99]), state("other", [7] * 16)
    sched.submit(first)
    admit_all(sched)
    sched.submit(retry)
    sched.submit(other)
    assert admit_all(sched) == ["other"]  # retry waits, in its place in line
    assert [s.id for s in sched.waiting] == ["retry"]
    decode(sched, first)  # first's prompt is computed, and its blocks not due to be stored
    assert admit_all(sched) == ["retry"]


def test_a_prompt_store_still_due_or_a_short_share_decide_the_wait() -> None:
    sched, _ = make()
    sched.block_size = 4
    first = state("first", list(range(16)))
    sched.submit(first)
    admit_all(sched)
    decode(sched, first)
    sched.prompt_stores.append(first)  # its blocks are stored next step: wait for them
    assert sched.shares_a_prefill(state("x", list(range(16))))
    assert not sched.shares_a_prefill(state("y", list(range(8)) + [50] * 12))  # under half shared
    assert not sched.shares_a_prefill(state("z", list(range(7))))  # under two blocks
    first.cached_tokens = 16  # nothing of it computed here
    assert not sched.shares_a_prefill(state("x", list(range(16))))
    assert shared_blocks([1, 2, 3, 4, 5], [1, 2, 3, 4, 6], 2) == 4


# ----- solo and batch ----------------------------------------------------------------------
def test_a_lone_request_runs_solo_and_a_second_one_hands_it_off_with_its_id() -> None:
    sched, _ = make()
    a, b = state("a"), state("b")
    sched.submit(a)
    chosen = sched.admissions()
    assert next(chosen) is a and sched.idle  # nothing else runs or waits: the runner runs it alone
    start(sched, a, Admission.SOLO)
    assert list(chosen) == []
    assert sched.solo is a and sched.prefilling_alone() and not sched.hand_off_due()
    sched.submit(b)
    assert sched.hand_off_due() and not sched.idle
    assert sched.leave_solo() is a and sched.solo is None and not sched.prefilling_alone()
    sched.prefill_first(a)  # mid-prefill: it goes on first among the newcomers
    start(sched, next(sched.admissions()), Admission.PREFILL)
    assert sched.prefilling == [a, b] and sched.handoffs == 1 and not sched.hand_off_due()
    # its state, id and place are the same before and after
    assert sched.running[a.seq] is a and sched.by_id["a"] is a and a.status is Status.PREFILLING


def test_a_decoding_solo_sequence_joins_the_batch_with_its_prompt_store_still_due() -> None:
    sched, _ = make()
    a = state("a")
    sched.submit(a)
    start(sched, next(sched.admissions()), Admission.SOLO)
    decode(sched, a)
    a.store_prompt = True  # its first token has not left the event loop yet
    sched.submit(state("b"))
    assert sched.leave_solo() is a
    a.solo = None  # the runner moved it into the batch
    sched.joined_batch(a)
    assert sched.prompt_stores == [a] and not a.store_prompt and sched.handoffs == 1
    assert a.status is Status.DECODING and sched.running[a.seq] is a
    assert sched.schedule(prefill_batch=8).due == [a]  # stored after the batch's next step


def test_hand_off_needs_room_for_two() -> None:
    sched, _ = make(max_concurrent=1)
    sched.submit(state("a"))
    start(sched, next(sched.admissions()), Admission.SOLO)
    sched.submit(state("b"))
    assert not sched.hand_off_due() and admit_all(sched) == []


# ----- the runner's outputs and stores -----------------------------------------------------
def test_tokens_become_one_event_per_request_and_finishes_ask_for_stores() -> None:
    sched, sent = make()
    a, b = state("a"), state("b")
    for s in (a, b):
        sched.submit(s)
    admit_all(sched)
    result = sched.update([TokenOut(a, 5), TokenOut(b, 6)])
    assert [(s.id, e.text, e.token_ids) for s, e in sent] == [("a", "<5>", [5]), ("b", "<6>", [6])]
    assert a.status is b.status is Status.DECODING and not result.stores and not result.dropped
    sent.clear()
    states = {3: "state"}  # a stateful model's boundary states go with its store
    out = TokenOut(a, 0, finish_reason="stop", prompt_cache="kv", all_tokens=(1, 2, 3, 5), boundary_states=states)
    result = sched.update([out])
    assert result.stores == [([1, 2, 3, 5], "kv", states, None)]
    (s, event), = sent
    assert s is a and event.finish_reason == "stop" and event.text == "" and event.completion_tokens == 2
    assert a.status is Status.FINISHED and running_ids(sched) == ["b"] and a.generated == [5]


def test_a_stop_string_ends_the_request_and_asks_to_drop_its_sequence() -> None:
    sched, sent = make()
    s = state("s", stop=["<7>"])
    sched.submit(s)
    admit_all(sched)
    assert sched.update([TokenOut(s, 5)]).dropped == []
    result = sched.update([TokenOut(s, 7)])
    assert result.dropped == [s] and not result.stores and s.status is Status.FINISHED
    assert sent[-1][1].finish_reason == "stop" and sent[-1][1].stop_string == "<7>"
    assert "".join(e.text for _, e in sent) == "<5>"


def test_tokens_of_one_step_after_a_stop_string_are_never_emitted() -> None:
    """A speculative step returns several tokens of one request; a stop string ends it at one."""
    sched, sent = make()
    s = state("s", stop=["<7>"])
    sched.submit(s)
    admit_all(sched)
    result = sched.update([TokenOut(s, 5), TokenOut(s, 7), TokenOut(s, 8), TokenOut(s, 9, finish_reason="length")])
    assert result.dropped == [s] and not result.stores
    assert s.completion_tokens == 2 and s.generated == [5, 7]
    assert [e.finish_reason for _, e in sent] == ["stop"] and sent[-1][1].text == "<5>"


def test_logprobs_are_read_only_when_asked_for() -> None:
    sched, sent = make()
    s = state("s")
    s.request.logprobs = 2
    sched.submit(s)
    admit_all(sched)
    sched.update([TokenOut(s, 5, logprobs="array")])
    assert sent[0][1].logprobs == [TokenLogprob(5, -1.0)]


# ----- the step: plan and update ----------------------------------------------------------
def test_the_solo_sequence_steps_alone_and_a_batch_step_takes_its_newcomers_and_due_stores() -> None:
    sched, _ = make()
    a = state("a")
    sched.submit(a)
    start(sched, next(sched.admissions()), Admission.SOLO)
    plan = sched.schedule(prefill_batch=2)
    assert plan.solo is a and not plan.prefill and not plan.due
    sched.solo = None  # handed off
    newcomers = [state(rid) for rid in "bcd"]
    for s in newcomers:
        sched.submit(s)
    for s in sched.admissions():
        start(sched, s, Admission.PREFILL)
    sched.prompt_stores.append(a)
    plan = sched.schedule(prefill_batch=2)
    assert plan.solo is None and plan.prefill == newcomers[:2] and plan.due == [a] and not plan.single
    assert sched.prompt_stores == []  # taken for after this step


def test_a_steps_outputs_join_newcomers_request_prompt_stores_and_store_those_due(monkeypatch) -> None:
    monkeypatch.setattr(request_state, "FIRST_TOKEN_GRACE_S", 1e9)  # a token not passed on stays not out
    sched, _ = make()
    a, b, c, d = state("a"), state("b"), state("c"), state("d")
    for s in (a, b, c, d):
        sched.submit(s)
    for s in sched.admissions():
        start(sched, s, Admission.PREFILL if s is d else Admission.BATCH)
    for s in (a, b, c):
        decode(sched, s)
    a.first_out = True  # its first token has left the event loop
    sched.prompt_stores = [a, b, c]
    plan = sched.schedule(prefill_batch=8)
    assert plan.prefill == [d] and plan.due == [a, b, c]
    out = StepOut(
        tokens=[TokenOut(c, 0, finish_reason="stop"), TokenOut(d, 9)], joined=[d], ended=[d]
    )  # c finished: stored whole, not as a prompt
    result = sched.update_step(plan, out)
    assert result.prompt_stores == [a]  # b's first token is not out yet: it waits
    assert sched.prompt_stores == [d, b] and sched.prefilling == []
    assert c.status is Status.FINISHED and d.status is Status.DECODING


# ----- failure recovery -------------------------------------------------------------------
def test_failing_everything_not_finished_answers_each_once() -> None:
    sched, sent = make(max_concurrent=2)
    a, b, c, d = state("a"), state("b"), state("c"), state("d")
    for s in (a, b, c, d):
        sched.submit(s)
    chosen = sched.admissions()
    start(sched, next(chosen), Admission.SOLO)
    sched.admitted(next(chosen), Admitted(Admission.RESTORE, Loading(RestorePlan(10, 16))))
    chosen.close()
    assert sched.unfinished() == [a, c, d, b]
    for s in list(sched.running.values()):
        sched.finish(s, "error", error="boom")
    queued = sched.take_queued()
    assert queued == [c, d, b] and all(s.status is Status.FINISHED for s in (a, b, c, d))
    assert not sched.by_id and not sched.unfinished() and sched.solo is None
    assert [(s.id, e.finish_reason, e.error) for s, e in sent] == [("a", "error", "boom")]


def test_after_a_failed_step_the_queues_start_clean() -> None:
    sched, _ = make()
    a, b = state("a"), state("b")
    sched.submit(a)
    sched.submit(b)
    start(sched, next(sched.admissions()), Admission.SOLO)
    sched.prompt_stores.append(a)
    sched.prefilling.append(a)
    for s in list(sched.running.values()):
        sched.finish(s, "error", error="engine failure")
    sched.after_fault()
    assert sched.solo is None and not sched.prefilling and not sched.prompt_stores
    assert admit_all(sched) == ["b"]  # the ones in line go on


def test_the_scheduler_modules_import_no_mlx() -> None:
    code = (
        "import sys; import omlx.engine.scheduler, omlx.engine.request_state, omlx.engine.config, "
        "omlx.engine.store_queue, omlx.engine.output; print(any(m == 'mlx' or m.startswith('mlx.') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
