"""The decision for a claimed credit (``batcher.scheduler``), pure, on a clock the test moves: an idle
worker gets the batch at once or is held in reserve at light load; a busy worker's batch is spaced
only when this batcher alone serves the model, and never once it is sealed. And the dispatch loop
around it (``DispatchLoop``): a credit is claimed only for a ready batch, and each claimed credit is
sent once or given back."""

from __future__ import annotations

from batcher.policy import BatchFormer, FlushPolicy, Pending
from batcher.scheduler import CLAIM, IDLE, SEND, Action, Claimed, Decision, DispatchLoop, Hold, Scheduler, Send, Space

L = 0.1
MODEL = "sim"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def scheduler(*, margin_s: float | None = 0.005, reserve_ms: float = 0.0) -> tuple[Scheduler[int], Clock]:
    clock = Clock()
    policy = FlushPolicy.work_conserving(max_batch=100, reserve_ms=reserve_ms)
    return Scheduler(BatchFormer[int](policy, clock), clock, margin_s), clock


def add(s: Scheduler[int], clock: Clock, n: int = 1) -> None:
    for i in range(n):
        s.former.add(MODEL, Pending(i, 0, i, clock.now, clock.now + 60.0))


def test_an_idle_worker_gets_the_batch_at_once() -> None:
    s, clock = scheduler()
    add(s, clock)
    assert s.decide(MODEL, Claimed("w1", clock.now - 1.0, L), clock.now, alone=True) == SEND


def test_a_busy_worker_starting_with_another_is_spaced_half_a_call_later_less_the_margin() -> None:
    s, clock = scheduler(margin_s=0.005)
    add(s, clock)
    s.sent(MODEL, Claimed("w1", clock.now, L))  # w1 starts now
    decision = s.decide(MODEL, Claimed("w2", clock.now + 0.01, L), clock.now, alone=True)
    assert decision.action is Action.SPACE
    assert abs(decision.until_s - (clock.now + L / 2 - 0.005)) < 1e-9, decision


def test_spacing_is_off_without_a_margin_or_beside_another_batcher() -> None:
    for margin_s, alone in ((None, True), (0.005, False)):
        s, clock = scheduler(margin_s=margin_s)
        add(s, clock)
        s.sent(MODEL, Claimed("w1", clock.now, L))
        assert s.decide(MODEL, Claimed("w2", clock.now + 0.01, L), clock.now, alone=alone) == SEND


def test_a_sealed_batch_is_never_spaced() -> None:
    s, clock = scheduler()
    add(s, clock, 100)  # a full batch seals
    assert s.former.sealed(MODEL)
    s.sent(MODEL, Claimed("w1", clock.now, L))
    assert s.decide(MODEL, Claimed("w2", clock.now + 0.01, L), clock.now, alone=True) == SEND


def test_an_idle_worker_is_held_in_reserve_when_only_stale_requests_wait_at_light_load() -> None:
    s, clock = scheduler(reserve_ms=20.0)
    add(s, clock)
    claiming_from = clock.now
    clock.now += 0.05  # the worker comes 50 ms after the request and the claim: it is stale
    decision = s.decide(MODEL, Claimed("w1", clock.now, L), claiming_from, alone=True)
    assert decision == Decision(Action.HOLD, clock.now + 0.02)
    fresh, fresh_clock = scheduler(reserve_ms=20.0)
    add(fresh, fresh_clock)
    claimed = Claimed("w1", fresh_clock.now, L)
    assert fresh.decide(MODEL, claimed, fresh_clock.now, alone=True) == SEND, "a request that found it idle goes"


def test_the_loop_claims_only_for_a_ready_batch_and_sends_to_an_idle_worker_at_once() -> None:
    s, clock = scheduler()
    loop = DispatchLoop[str](s, MODEL)
    assert loop.poke() == IDLE, "nothing held: nothing to claim"
    add(s, clock)
    assert loop.poke() == CLAIM
    assert loop.poke() == CLAIM, "a claim under way goes on"
    assert loop.claimed("c1", Claimed("w1", clock.now - 1.0, L), alone=True) == Send("c1")
    s.former.take(MODEL)
    loop.sent()
    assert loop.poke() == IDLE


def test_a_claim_that_ends_without_a_credit_starts_again_and_one_with_nothing_left_to_send_ends() -> None:
    s, clock = scheduler()
    loop = DispatchLoop[str](s, MODEL)
    add(s, clock)
    assert loop.poke() == CLAIM
    loop.unclaimed()
    assert loop.poke() == CLAIM
    assert loop.claiming
    s.former.take(MODEL)
    assert loop.poke() == IDLE, "a claim whose batch went meanwhile (expired) ends"
    assert not loop.claiming


def test_a_held_worker_goes_back_when_a_second_one_frees_first_and_is_sent_on_an_arrival_or_in_time() -> None:
    def held() -> tuple[DispatchLoop[str], Scheduler[int], Clock]:
        s, clock = scheduler(reserve_ms=20.0)
        loop = DispatchLoop[str](s, MODEL)
        add(s, clock)
        assert loop.poke() == CLAIM
        clock.now += 0.05  # the worker comes 50 ms after the request: it is stale, the load light
        assert loop.claimed("c1", Claimed("w1", clock.now, L), alone=True) == Hold(clock.now + 0.02)
        assert loop.holding and loop.claiming, "a hold claims a second credit meanwhile"
        return loop, s, clock

    loop, _, clock = held()
    assert loop.second("c2", Claimed("w2", clock.now, L)) == Send("c2", back="c1")
    assert not loop.claiming
    loop, _, clock = held()
    assert loop.second("c1'", Claimed("w1", clock.now, L)) == Send("c1'"), (
        "w1 renewed its credit during the hold: the held one is stale, and goes nowhere"
    )
    loop, _, _ = held()
    assert loop.poke() == Send("c1"), "a fresh arrival takes the held worker"
    loop, _, _ = held()
    assert loop.woke() == Send("c1"), "the hold ran out"


def test_a_spaced_batch_waits_until_it_seals_or_its_time_comes() -> None:
    s, clock = scheduler(margin_s=0.005)
    loop = DispatchLoop[str](s, MODEL)
    add(s, clock)
    s.sent(MODEL, Claimed("w1", clock.now, L))  # w1 starts now
    assert loop.poke() == CLAIM
    spaced = loop.claimed("c2", Claimed("w2", clock.now + 0.01, L), alone=True)
    assert isinstance(spaced, Space)
    assert not loop.claiming, "spacing claims nothing more"
    add(s, clock, 1)
    assert loop.poke() is spaced, "an arrival that seals nothing leaves the wait as it was"
    add(s, clock, 100)  # the batch fills up and seals
    assert loop.poke() == Send("c2")
    other = DispatchLoop[str](s, "other")
    s.former.add("other", Pending(0, 0, 0, clock.now, clock.now + 60.0))
    assert other.poke() == CLAIM
    s.sent("other", Claimed("w1", clock.now, L))
    assert isinstance(other.claimed("c3", Claimed("w3", clock.now + 0.01, L), alone=True), Space)
    assert other.woke() == Send("c3")


def test_a_stopping_loop_releases_the_credit_it_holds_unsent_and_no_other() -> None:
    s, clock = scheduler(margin_s=0.005, reserve_ms=20.0)
    loop = DispatchLoop[str](s, MODEL)
    assert loop.release() is None, "an idle loop holds no credit"
    add(s, clock)
    assert loop.poke() == CLAIM
    assert loop.release() is None, "a claim in flight holds none yet"
    clock.now += 0.05
    assert isinstance(loop.claimed("c1", Claimed("w1", clock.now, L), alone=True), Hold)
    assert loop.release() == "c1", "a held worker's credit goes back"
    assert not loop.claiming and loop.poke() == CLAIM, "and the loop starts again from idle"
    s.sent(MODEL, Claimed("w2", clock.now, L))
    assert isinstance(loop.claimed("c3", Claimed("w3", clock.now + 0.01, L), alone=True), Space)
    assert loop.release() == "c3", "a spaced batch's credit goes back"
    assert loop.poke() == CLAIM
    assert loop.claimed("c4", Claimed("w4", clock.now, L), alone=False) == Send("c4")
    assert loop.release() == "c4", "a credit on its way to its send, not yet taken, goes back"
    assert loop.poke() == CLAIM
    assert loop.claimed("c5", Claimed("w5", clock.now, L), alone=False) == Send("c5")
    loop.sent()
    assert loop.release() is None, "a credit its send took is the send's"
