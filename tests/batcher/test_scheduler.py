"""The decision for a claimed credit (``batcher.scheduler``), pure, on a clock the test moves: an idle
worker gets the batch at once or is held in reserve at light load; a busy worker's batch is spaced
only when this batcher alone serves the model, and never once it is sealed."""

from __future__ import annotations

from batcher.policy import BatchFormer, FlushPolicy, Pending
from batcher.scheduler import SEND, Action, Claimed, Decision, Scheduler

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
