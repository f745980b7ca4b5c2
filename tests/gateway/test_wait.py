"""Admission's one estimate (``gateway.admission.wait``) and the refusals it drives, on hand-made
counters and credits: no clock, no I/O."""

from __future__ import annotations

import math
import random
import time

import pytest

from gateway.admission.gate import ANONYMOUS, Admission, Caller
from gateway.admission.wait import MARGIN, DrainMeter, ModelQueue, ServiceTime, Stated, TierMix, WorkerRates
from gateway.errors import Overloaded, PredictedLate
from gateway.settings import GatewaySettings
from gateway.unseen import Ticket
from schemas.records import Credit, Priority
from tests.support.queue_depth import Counters, admit_sent
from transport.memory.credits import MemoryCreditPool
from transport.ports import Backlog


def busy(meter: DrainMeter, seconds: float, depth: int, rate: float, start: Backlog) -> Backlog:
    """Feeds samples every 0.1 s of a queue that holds ``depth`` and drains ``rate`` requests/s, one batch a sample."""
    backlog = start
    for _ in range(round(seconds / 0.1)):
        backlog = Backlog(depth, backlog.left + round(rate * 0.1), backlog.batches + 1, backlog.at_s + 0.1)
        meter.observe(backlog)
    return backlog


def hold(meter: DrainMeter, backlog: Backlog, until_s: float) -> None:
    """Samples the same counters every 0.1 s up to ``until_s``, as the gateway's sampler does."""
    at = backlog.at_s
    while at < until_s - 1e-9:
        at = min(until_s, at + 0.1)
        meter.observe(Backlog(backlog.depth, backlog.left, backlog.batches, at))


def test_an_empty_queue_predicts_no_wait() -> None:
    meter = DrainMeter()
    estimate = meter.observe(Backlog(0, 0, 0, 0.0))
    assert estimate.wait_s == 0 and estimate.rate_per_s is None


def test_the_wait_is_depth_over_the_rate_measured_while_the_queue_stayed_busy() -> None:
    meter = DrainMeter()
    last = busy(meter, 4.5, 100, 200.0, Backlog(100, 0, 0, 0.0))
    estimate = meter.observe(Backlog(400, last.left + 20, last.batches + 1, last.at_s + 0.1))
    # 2 s windows of 20 batches each; one batch of a window is not counted (it may have been taken
    # just inside the window's start).
    assert estimate.rate_per_s == pytest.approx(200.0 * 19 / 20)
    assert estimate.wait_s == pytest.approx(400 / (200.0 * 19 / 20))


def test_a_quiet_spell_does_not_teach_a_low_rate() -> None:
    """Drained while the queue emptied, the rate says how fast requests came, not how fast workers go."""
    meter = DrainMeter()
    last = busy(meter, 1.5, 100, 1000.0, Backlog(100, 0, 0, 0.0))
    at = last.at_s
    for n in range(100):  # 10 s of a trickle that never queues
        at += 0.1
        meter.observe(Backlog(0, last.left + n, last.batches + n, at))
    burst = meter.observe(Backlog(500, last.left + 100, last.batches + 100, at + 0.1))
    # The busy spell's measure (its first window of 5 or 6 batches, 1 not counted), not the trickle's 10/s.
    assert burst.rate_per_s is not None and 800.0 <= burst.rate_per_s <= 1000.0, burst
    assert burst.wait_s == pytest.approx(500 / burst.rate_per_s)


def test_a_model_that_lost_capacity_is_seen_within_seconds() -> None:
    meter = DrainMeter(half_life_s=2.0)
    last = busy(meter, 1.0, 100, 1000.0, Backlog(100, 0, 0, 0.0))
    last = busy(meter, 10.0, 100, 100.0, last)
    assert meter.observe(last).rate_per_s == pytest.approx(100.0, rel=0.1)


def test_a_rate_measured_while_a_batcher_could_not_commit_is_raised_by_what_the_queue_then_drains() -> None:
    """The group's coordinator moves: for a while the batchers' commits stall, so the counters show a
    full queue that hardly drains, and a low rate is measured. Once commits resume the queue keeps up
    with 200 requests/s and stays short, so no busy window measures again; the low rate must not stand,
    or a queue of a few dozen, a fifth of a second's arrivals, is predicted to wait most of a minute and
    every request then is refused."""
    meter = DrainMeter()
    meter.full_batch = 100  # the workers take batches of up to 100
    meter.observe(Backlog(150, 0, 0, 0.0))
    left, batches, at = 0, 0, 0.0
    for n in range(15):  # 1.5 s of a full queue from which one request's commit lands every 0.5 s
        at += 0.1
        if n % 5 == 0:
            left, batches = left + 1, batches + 1
        stalled = meter.observe(Backlog(150, left, batches, at))
    assert stalled.rate_per_s is not None and stalled.rate_per_s < 5, "the stall measured a low rate"
    for _ in range(30):  # 3 s of 200 requests/s drained in batches of 5, never more than 20 waiting
        at += 0.1
        left, batches = left + 20, batches + 4
        meter.observe(Backlog(20, left, batches, at))
    estimate = meter.observe(Backlog(39, left + 20, batches + 4, at + 0.1))
    assert estimate.rate_per_s == pytest.approx(200.0, rel=0.1)
    assert estimate.wait_s < 0.5


def test_a_committed_offset_read_as_minus_one_does_not_raise_the_rate() -> None:
    """The queue keeps up with 40 requests/s. A partition's committed offset read -1 for one read counts
    its partition from the log's start (``transport.kafka.lag``): ``left`` drops by the partition's
    commit point, and the next read's return to it drained nothing. Counted as drained, it raised the
    rate a thousandfold, and admission predicted no wait for any burst."""
    meter = DrainMeter()
    meter.full_batch = 10
    last = busy(meter, 1.5, 50, 100.0, Backlog(50, 1_000_000, 0, 0.0))
    measured = meter.observe(last).rate_per_s
    assert measured is not None
    left, batches, at = last.left + 50, last.batches + 1, last.at_s
    for n in range(100):  # 10 s of 40 requests/s, in batches of 4 that never queue
        at += 0.1
        left, batches = left + 4, batches + 1
        if n == 50:  # partition 0's commit point, 500,000, read as -1: counted from offset 0
            meter.observe(Backlog(500_000, left - 500_000, batches, at))
        else:
            meter.observe(Backlog(0, left, batches, at))
    rate = meter.observe(Backlog(0, left, batches, at + 0.1)).rate_per_s
    assert rate == measured, f"the rate {measured:.0f}/s was raised to {rate:.0f}/s"


async def test_a_lone_clients_steady_flow_to_a_worker_of_long_calls_is_not_cut_down_by_its_fair_share() -> None:
    """One worker of one-second calls takes all that waits each time it frees, up to 2,000, and is never
    idle long enough for its credit to be read, so how many fill its batch is not known. Its queue then
    holds up to a call's arrivals between two batches: spans in which requests only gather are no
    measure of the worker's pace. Measured as one, the drain fell below the client's own 200 requests/s,
    its fair share refused the excess, what it sent then drained slower still, and a fifth of its
    requests were refused while the worker ran at a tenth of what it takes."""
    counters = Counters()
    admission = Admission(settings(), counters, None, clock=counters.clock)
    client = Caller(client="ip:192.0.2.1")
    waiting, left, batches, taken, refused = 0, 0, 0, 0, 0
    for step in range(1, 1201):  # 60 s in steps of 50 ms
        if step % 20 == 0:  # the worker's call ends: it takes every request that waits
            taken, batches = waiting, batches + 1
        elif step % 20 == 2:  # the batcher commits once the batch is on the bus
            left, waiting = left + taken, waiting - taken
        if step % 3 == 0:  # the counters are read every 150 ms
            counters.backlogs["a"] = Backlog(waiting, left, batches, step * 0.05)
        for _ in range(10):
            try:
                await admit_sent(admission, "a", 30_000, caller=client)
            except Overloaded:
                refused += step > 1000
            else:
                waiting += 1
    assert refused == 0, f"{refused} of the last 10 s's 2,000 requests refused"


def test_requests_waiting_while_no_batch_leaves_is_a_stall() -> None:
    meter = DrainMeter(stall_s=5.0)
    meter.observe(Backlog(0, 0, 7, 0.0))
    meter.observe(Backlog(10, 0, 7, 0.1))  # requests arrive; no batch goes
    assert not meter.stalled
    hold(meter, Backlog(10, 4, 7, 0.1), 5.1)  # expiries leave the queue: still no batch
    estimate = meter.observe(Backlog(10, 4, 7, 5.2))
    assert estimate.stalled_s == pytest.approx(5.2) and estimate.wait_s == math.inf
    assert meter.stalled
    assert meter.observe(Backlog(0, 10, 7, 5.3)).wait_s == math.inf, "an emptied queue is still stalled"
    assert meter.observe(Backlog(0, 10, 7, 10.3)).wait_s == 0, "one probe every stall_s"
    assert meter.observe(Backlog(0, 10, 7, 10.4)).wait_s == math.inf, "and only one"
    assert meter.observe(Backlog(1, 10, 8, 10.5)).stalled_s == 0, "a batch taken ends the stall"
    assert not meter.stalled


def test_a_queue_nobody_takes_from_yet_teaches_no_rate() -> None:
    """A request waits while the batchers still join their group: no batch left, so no drain rate
    (0 would predict no wait at all); what the workers state stands until one is measured."""
    meter = DrainMeter()
    meter.observe(Backlog(0, 0, 0, 0.0))
    hold(meter, Backlog(1, 0, 0, 0.0), 3.0)
    assert meter.observe(Backlog(1, 0, 0, 3.1)).rate_per_s is None
    assert meter.observe(Backlog(100, 0, 0, 3.2), 50.0).wait_s == pytest.approx(2.0)


def test_a_model_idle_for_long_is_not_stalled_by_its_next_request() -> None:
    meter = DrainMeter(stall_s=5.0)
    meter.observe(Backlog(0, 0, 7, 0.0))
    assert meter.observe(Backlog(3, 0, 7, 3600.0)).wait_s == 0
    assert meter.observe(Backlog(0, 3, 8, 3600.2)).wait_s == 0
    assert not meter.stalled


def settings(**overrides: object) -> GatewaySettings:
    return GatewaySettings(models=("a", "b"), default_model="a", **overrides)  # type: ignore[arg-type]


async def burst(admission: Admission, deadline_says: str, count: int = 200) -> list[str]:
    """``count`` requests of model "a" with a 1 s deadline, one after another: each one's outcome,
    "deadline" for a refusal whose message holds ``deadline_says``."""
    outcomes = []
    for _ in range(count):
        try:
            await admit_sent(admission, "a", 1_000)
            outcomes.append("admitted")
        except Overloaded as refused:
            outcomes.append("deadline" if deadline_says in refused.message else refused.message)
    return outcomes


async def test_a_request_whose_deadline_the_queue_cannot_meet_is_refused_at_once() -> None:
    counters = Counters()
    admission = Admission(settings(), counters, None, clock=counters.clock)
    counters.backlogs["a"] = Backlog(100, 0, 0, 0.0)
    for n in range(1, 11):  # a queue of 100 that drains 100/s: a 1 s wait
        counters.backlogs["a"] = Backlog(100, 10 * n, n, 0.1 * n)
        await admit_sent(admission, "a", 30_000)
    with pytest.raises(Overloaded) as refused:
        await admit_sent(admission, "a", 1_000)
    assert "timeout_ms=1000 cannot be met" in refused.value.message
    assert refused.value.retry_after_s == 1
    late = refused.value
    assert isinstance(late, PredictedLate) and (late.model, late.timeout_ms) == ("a", 1_000), late
    assert late.answer_s * MARGIN > 1.0, f"its figures, for routes that take no timeout_ms: {late.answer_s}"
    await admit_sent(admission, "a", 2_000)
    admission.answered("a", 0.1)
    counters.backlogs["a"] = Backlog(0, 100, 10, 1.1)
    await admit_sent(admission, "a", 1), "an empty queue refuses nothing: a deadline too short for a call expires"
    counters.backlogs["a"] = Backlog(5, 100, 10, 1.2)
    await admit_sent(admission, "a", 1), "nor does less than one answer's time of work ahead"
    counters.backlogs["a"] = Backlog(15, 100, 10, 1.3)
    with pytest.raises(Overloaded):
        await admit_sent(admission, "a", 1)
    counters.backlogs["b"] = Backlog(0, 0, 0, 1.0)
    await admit_sent(admission, "b", 1), "another model's queue is its own"


async def test_a_burst_between_two_reads_of_the_counters_counts_what_it_already_admitted() -> None:
    """Over Kafka the counters are read every 150 ms: requests that arrive together are checked
    against one figure, so each counts those admitted before it since that read."""
    counters = Counters()
    admission = Admission(settings(), counters, None, clock=counters.clock)
    for n in range(1, 11):  # a queue that drains 100 requests/s
        counters.backlogs["a"] = Backlog(100, 10 * n, n, 0.1 * n)
        await admit_sent(admission, "a", 30_000)
    counters.backlogs["a"] = Backlog(0, 100, 10, 1.1)  # empty when read; a burst of 200 comes
    outcomes = await burst(admission, "timeout_ms=1000 cannot be met")
    admitted = outcomes.count("admitted")
    assert 60 <= admitted <= 100, admitted  # about 1 s of work at the measured rate, less the margin
    assert outcomes == ["admitted"] * admitted + ["deadline"] * (200 - admitted)
    counters.backlogs["a"] = Backlog(40, 160, 16, 1.2)  # read again: it holds the burst, partly drained
    await admit_sent(admission, "a", 1_000), "what the new read holds is not counted twice"


async def test_requests_slow_to_reach_the_bus_do_not_stall_the_model_their_workers_never_saw() -> None:
    """Produces take seconds to land (a slow bus): the counters show no request waiting and no batch,
    while this gateway's admissions are on their way. They count in each request's predicted wait, not
    in the counters' samples: the workers have nothing to take, so the model is not stalled and its
    requests are not refused as if its workers were hung."""
    counters = Counters()
    admission = Admission(settings(), counters, None, clock=counters.clock)
    on_the_way: list[Ticket] = []
    for n in range(80):  # 8 s of one request every 0.1 s, none of them landed yet
        counters.backlogs["a"] = Backlog(0, 0, 7, 0.1 * n)
        ticket = await admission.admit(ANONYMOUS, "a", 30_000)
        assert ticket is not None
        on_the_way.append(ticket)
    assert admission.models() == {"a": "serving", "b": "serving"}
    for ticket in on_the_way:
        ticket.close()


async def test_a_burst_still_on_its_way_to_the_bus_counts_across_a_read_that_misses_it() -> None:
    """Under a burst, produces wait behind each other for longer than a refresh: a read begun before
    a request landed does not hold it, so it still counts; one never sent counts until its submit ends."""
    counters = Counters()
    admission = Admission(settings(), counters, None, clock=counters.clock)
    for n in range(1, 11):  # a queue that drains 100 requests/s
        counters.backlogs["a"] = Backlog(100, 10 * n, n, 0.1 * n)
        await admit_sent(admission, "a", 30_000)
    counters.backlogs["a"] = Backlog(0, 100, 10, 1.1)  # empty when read; a burst comes, none of it sent yet
    tickets: list[Ticket] = []
    refusal = ""
    while not refusal and len(tickets) < 200:
        try:
            ticket = await admission.admit(ANONYMOUS, "a", 1_000)
        except Overloaded as refused:
            refusal = refused.message
        else:
            assert ticket is not None
            tickets.append(ticket)
    assert "timeout_ms=1000 cannot be met" in refusal
    assert 60 <= len(tickets) <= 100, len(tickets)
    counters.backlogs["a"] = Backlog(0, 100, 10, 1.2)  # read again before any of the burst landed
    with pytest.raises(Overloaded):
        await admission.admit(ANONYMOUS, "a", 1_000)
    for ticket in tickets[:40]:
        ticket.sent()
        ticket.close()
    counters.backlogs["a"] = Backlog(40, 100, 10, 1.3)  # holds the 40 sent; the others are still on their way
    with pytest.raises(Overloaded):
        await admission.admit(ANONYMOUS, "a", 1_000)
    for ticket in tickets[40:]:
        ticket.close()  # their submits ended unsent (a cached answer, a failed publish): they queue nothing
    await admit_sent(admission, "a", 1_000), "the 40 the read holds are not counted twice"


async def test_before_a_rate_is_measured_the_workers_stated_rates_predict_the_wait() -> None:
    """A fresh gateway's first burst: no rate measured yet, so the credits the model's idle workers
    offered (inputs per call over their recent call time) bound what is admitted."""
    counters = Counters()
    pool = MemoryCreditPool()
    now = int(time.time() * 1000)
    for worker in ("w1", "w2"):  # 5 inputs a call in 100 ms each: 100 requests/s together
        await pool.offer(Credit(worker, "a", 0, 1, now, now + 60_000, max_batch=5, busy_ms=100))
    admission = Admission(settings(), counters, None, pool, clock=counters.clock)
    await admission.read_worker_rates()
    counters.backlogs["a"] = Backlog(0, 0, 0, 0.0)
    outcomes = await burst(admission, "at the 100 requests/s it drains")
    admitted = outcomes.count("admitted")
    assert 60 <= admitted <= 100, admitted  # about 1 s of work at the stated rate, less the margin
    assert outcomes == ["admitted"] * admitted + ["deadline"] * (200 - admitted)
    assert await pool.idle("a") == 2, "the credits were read, not claimed"
    fresh = Admission(settings(), counters, None, pool, clock=counters.clock)
    await fresh.read_worker_rates()
    counters.backlogs["a"] = Backlog(1, 0, 0, 5.0)
    await admit_sent(fresh, "a", 2), "less than a call ahead: a 2 ms deadline expires, as on an empty queue"


async def test_a_stalled_model_is_refused_and_named_while_the_others_serve() -> None:
    counters = Counters()
    admission = Admission(settings(stall_s=2.0), counters, None, clock=counters.clock)
    counters.backlogs = {"a": Backlog(0, 0, 0, 0.0), "b": Backlog(0, 0, 0, 0.0)}
    assert admission.models() == {"a": "serving", "b": "serving"}
    for n in range(1, 26):  # sampled every 0.1 s, as the gateway's sampler does
        counters.backlogs = {"a": Backlog(5, 0, 0, n / 10), "b": Backlog(0, 0, 0, n / 10)}
        states = admission.models()
    assert states == {"a": "stalled", "b": "serving"}
    with pytest.raises(Overloaded, match="taken none for 2 s"):
        await admit_sent(admission, "a", 30_000)
    await admit_sent(admission, "b", 30_000)


def test_an_idle_worker_ends_a_stall_at_once_only_when_no_request_waits() -> None:
    meter = DrainMeter(stall_s=5.0)
    meter.observe(Backlog(0, 10, 7, 0.0))
    hold(meter, Backlog(3, 10, 7, 0.0), 5.2)
    assert meter.stalled
    assert not meter.worker_idle(), "requests still wait: an idle worker they do not reach is no progress"
    assert meter.stalled
    meter.observe(Backlog(0, 13, 7, 5.3))
    assert meter.worker_idle(), "the queue emptied and a worker waits: nothing is stalled"
    assert not meter.stalled and meter.observe(Backlog(0, 13, 7, 5.4)).wait_s == 0
    hold(meter, Backlog(2, 13, 7, 5.4), 6.6)
    assert not meter.stalled, "a new stall needs stall_s without a batch again, counted from the end of the last"


async def test_a_stalled_model_whose_queue_empties_serves_again_as_soon_as_a_worker_waits(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """After the workers (or the counters) come back, the next sample ends the stall: no refusal
    waits for a probe, and each change of state is logged with why."""
    counters = Counters()
    pool = MemoryCreditPool()
    admission = Admission(settings(stall_s=2.0), counters, None, pool, clock=counters.clock)
    for n in range(0, 26):
        counters.backlogs = {"a": Backlog(5, 0, 0, n / 10), "b": Backlog(0, 0, 0, n / 10)}
        admission.models()
    assert admission.models()["a"] == "stalled"
    assert "model 'a' is stalled: 5 requests wait and no batch has reached its workers" in caplog.text
    counters.backlogs = {"a": Backlog(0, 5, 0, 2.7), "b": Backlog(0, 0, 0, 2.7)}
    await admission.read_worker_rates()
    assert admission.models()["a"] == "stalled", "no worker waits yet"
    now = int(time.time() * 1000)
    await pool.offer(Credit("w1", "a", 0, 1, now, now + 60_000, max_batch=5, busy_ms=100))
    await admission.read_worker_rates()
    assert admission.models() == {"a": "serving", "b": "serving"}
    assert "model 'a' is serving: an idle worker waits for work and no request waits" in caplog.text
    await admit_sent(admission, "a", 30_000)


async def test_a_stalled_models_probe_goes_to_a_request_not_to_the_samplers_look() -> None:
    """The sampler looks at each model every 0.2 s; its look must not spend the probe an empty,
    stalled queue lets through every ``stall_s`` (no credit shows here: only the probe ends the stall)."""
    counters = Counters()
    admission = Admission(settings(stall_s=2.0), counters, None, clock=counters.clock)
    for n in range(0, 26):
        counters.backlogs = {"a": Backlog(5, 0, 0, n / 10)}
        admission.models()
    assert admission.models()["a"] == "stalled"
    probes = []
    for n in range(27, 81, 2):  # the queue emptied (its requests expired); a request after each look
        counters.backlogs = {"a": Backlog(0, 5, 0, n / 10)}
        admission.models()
        counters.backlogs = {"a": Backlog(0, 5, 0, n / 10 + 0.05)}
        try:
            await admit_sent(admission, "a", 30_000)
            probes.append(n / 10)
        except Overloaded:
            pass
    assert len(probes) >= 2, f"one probe every 2 s of 5.4 s, admitted at {probes}"


async def test_the_queue_depth_limit_is_per_model() -> None:
    counters = Counters()
    admission = Admission(settings(max_queue_depth=10), counters, None, clock=counters.clock)
    counters.backlogs = {"a": Backlog(10, 0, 0, 0.0), "b": Backlog(0, 0, 0, 0.0)}
    with pytest.raises(Overloaded, match="model 'a' has 10 requests waiting"):
        await admit_sent(admission, "a", 30_000)
    await admit_sent(admission, "b", 30_000)


def test_service_time_is_the_fastest_recent_answer_and_forgets_an_old_one() -> None:
    now = [0.0]
    service = ServiceTime(window_s=10, clock=lambda: now[0])
    assert service.seconds == 0
    service.observe(0.1)
    service.observe(0.3)
    assert service.seconds == 0.1
    now[0] = 11
    service.observe(0.5)
    assert service.seconds == 0.1, "the last window still counts"
    now[0] = 22
    service.observe(0.4)
    assert service.seconds == 0.4


def test_an_outage_of_the_counters_does_not_count_as_a_stall() -> None:
    """Kafka down for 10 s: no fresh counters, then a queue that built up. The workers' batches resume
    after the bus does; that is not a stall."""
    meter = DrainMeter(stall_s=5.0)
    meter.observe(Backlog(2, 0, 7, 0.0))
    assert meter.observe(Backlog(50, 0, 7, 10.0)).wait_s != math.inf
    hold(meter, Backlog(60, 0, 7, 10.0), 14.9)
    assert not meter.stalled
    assert meter.observe(Backlog(60, 0, 7, 15.1)).wait_s == math.inf, "no batch 5 s after the counters came back"


@pytest.mark.parametrize("seed", range(5))
def test_a_rate_drained_in_whole_batches_is_not_overestimated(seed: int) -> None:
    """Batches of 5 about every 0.1 s (50/s), sampled every 0.03-0.09 s: a short window counts one
    batch more or less by chance, and keeping the highest count would predict waits too short, so
    requests admitted at the edge of their deadline would expire in the queue."""
    rnd = random.Random(seed)
    meter = DrainMeter()
    at, left, batches, next_batch = 0.0, 0, 0, 0.1
    for _ in range(400):  # about 24 s of a busy queue
        at += rnd.uniform(0.03, 0.09)
        while next_batch <= at:
            batches, left = batches + 1, left + 5
            next_batch += rnd.uniform(0.09, 0.11)
        estimate = meter.observe(Backlog(150, left, batches, at))
        assert estimate.rate_per_s is None or estimate.rate_per_s <= 50.0 * 1.02, f"{estimate} after {at:.1f} s"
    assert estimate.rate_per_s == pytest.approx(50.0, rel=0.1)


# the workers' word, before a drain is measured -------------------------------------------------


def credit(worker: str, *, issued_ms: int = 0, ttl_ms: int = 5_000, max_batch: int = 5, busy_ms: int = 100) -> Credit:
    return Credit(worker, "a", 0, 1, issued_ms, issued_ms + ttl_ms, max_batch=max_batch, busy_ms=busy_ms)


def test_the_model_drains_at_most_the_sum_of_its_workers_full_batches_per_call() -> None:
    rates = WorkerRates()
    rates.seen([credit("w1"), credit("w2", max_batch=10, busy_ms=200)])
    assert rates.stated(1_000) == Stated(pytest.approx(50 + 50), 0.2, 5), "a queue of 5 fills either's batch"
    assert WorkerRates().stated(1_000) is None, "a model whose credits were never read has no rate"


def test_a_workers_latest_credit_counts_once_and_is_kept_until_it_expires() -> None:
    """A credit shows only while unclaimed: the one read before stands until its expiry."""
    rates = WorkerRates()
    rates.seen([credit("w1", busy_ms=100), credit("w2")])
    rates.seen([credit("w1", issued_ms=1_000, busy_ms=200)])  # w2's credit is claimed meanwhile
    assert rates.stated(2_000) == Stated(pytest.approx(25 + 50), 0.2, 5)
    assert rates.stated(5_000) == Stated(pytest.approx(25), 0.2, 5), "w2 is gone: its credit expired"
    assert rates.stated(6_000) is None


def test_a_worker_that_has_not_run_a_call_leaves_the_rate_unknown() -> None:
    """A partial sum would refuse what the model can answer, so none is given."""
    rates = WorkerRates()
    rates.seen([credit("w1"), credit("fresh", busy_ms=0)])
    assert rates.stated(1_000) is None
    assert rates.stated(1_000, answer_s=0.2) == Stated(pytest.approx(50 + 25), 0.2, 5), (
        "once an answer came, it stands for the call time a fresh worker has not stated"
    )
    unlimited = WorkerRates()
    unlimited.seen([credit("unlimited", max_batch=0)])
    assert unlimited.stated(1_000) is None


# the tier mix -----------------------------------------------------------------------------------


def test_the_mix_counts_what_is_ahead_of_each_tier_and_forgets() -> None:
    mix = TierMix(window=10)
    assert mix.ahead(Priority.HIGH) == 1.0, "unknown: all of the queue"
    for _ in range(3):
        mix.admitted(Priority.HIGH)
    for _ in range(7):
        mix.admitted(Priority.LOW)
    assert mix.ahead(Priority.HIGH) == pytest.approx(0.3)
    assert mix.ahead(Priority.NORMAL) == pytest.approx(0.3)
    assert mix.ahead(Priority.LOW) == 1.0
    for _ in range(40):
        mix.admitted(Priority.LOW)
    assert mix.ahead(Priority.HIGH) < 0.15, "older admissions count less"


# the prediction ---------------------------------------------------------------------------------


def test_an_answer_is_predicted_after_the_work_ahead_and_two_calls() -> None:
    """The queue drains in whole batches: past the work ahead, a request waits for the call that may
    be running when its turn comes, then for its own."""
    queue = ModelQueue(stall_s=5.0, wall_ms=lambda: 1_000)
    queue.read_credits([credit("w1", max_batch=100, busy_ms=100), credit("w2", max_batch=100, busy_ms=100)], 1_000)
    predicted = queue.predict(Backlog(500, 0, 0, 0.0), Priority.NORMAL)
    assert predicted.rate_per_s == pytest.approx(2_000)
    assert predicted.answer_s == pytest.approx(500 / 2_000 + 2 * 0.1)
    assert not predicted.refuses(0.5), "0.45 s, stretched by the margin, still within 500 ms"
    assert queue.predict(Backlog(600, 0, 0, 0.1), Priority.NORMAL).refuses(0.5)
    assert not queue.predict(Backlog(150, 0, 0, 0.2), Priority.NORMAL).refuses(0.001), (
        "what fits the next batch is admitted whatever its deadline: a deadline too short expires"
    )
    queue.answered(0.05)
    assert queue.predict(Backlog(500, 0, 0, 0.3), Priority.NORMAL).call_s == 0.05, "the fastest answer, first"


def test_a_request_behind_a_whole_round_of_batches_does_not_fit_the_next_one() -> None:
    """Two workers of 100 inputs take 200 in their next batches: the 200th request fits them, the
    201st (200 ahead of it) waits for a call to end, and is held to its deadline."""
    queue = ModelQueue(stall_s=5.0, wall_ms=lambda: 1_000)
    queue.read_credits([credit("w1", max_batch=100, busy_ms=100), credit("w2", max_batch=100, busy_ms=100)], 1_000)
    assert not queue.predict(Backlog(199, 0, 0, 0.0), Priority.NORMAL).refuses(0.001), "the 200th fits"
    behind = queue.predict(Backlog(200, 0, 0, 0.1), Priority.NORMAL)
    assert behind.refuses(0.001), f"the 201st waits {behind.ahead_s} s for a call of {behind.call_s} s to end"


def test_a_cold_models_first_answer_gives_its_fresh_workers_a_rate() -> None:
    """Before any call, the workers' credits state their batch and no call time: the first answer's
    latency stands for it, so the first burst is held against a rate within one call."""
    queue = ModelQueue(stall_s=5.0, wall_ms=lambda: 1_050)
    queue.read_credits([credit("w1", max_batch=100, busy_ms=0), credit("w2", max_batch=100, busy_ms=0)], 1_000)
    assert queue.predict(Backlog(800, 0, 0, 0.0), Priority.NORMAL).rate_per_s is None
    assert not queue.predict(Backlog(800, 0, 0, 0.0), Priority.NORMAL).refuses(0.5), "nothing known, nothing refused"
    queue.answered(0.1)
    predicted = queue.predict(Backlog(800, 0, 0, 0.1), Priority.NORMAL)
    assert predicted.rate_per_s == pytest.approx(2_000)
    assert predicted.refuses(0.5)


def test_one_request_at_a_time_teaches_no_rate_below_what_the_workers_state() -> None:
    """A client that sends its next request when the last is answered keeps at most one waiting; read
    through counters that lag (a batcher commits after its batch is on the bus), the queue looks
    non-empty from read to read while one request a call leaves. That drain is the client's pace, not
    the workers': it must not stand for the model's rate, or the next burst, which one worker's batches
    would answer in time, is refused (one worker of 5 a batch and 100 ms calls: 50 requests/s)."""
    queue = ModelQueue(stall_s=5.0, wall_ms=lambda: 1_000)
    queue.read_credits([credit("w1", max_batch=5, busy_ms=100)], 1_000)
    left, at = 0, 0.0
    for _ in range(40):  # 6 s of one request per 0.15 s read, each read still counting one as waiting
        at += 0.15
        left += 1
        queue.predict(Backlog(1, left, left, at), Priority.NORMAL)
    predicted = queue.predict(Backlog(100, left, left, at + 0.05), Priority.NORMAL)
    assert predicted.rate_per_s == pytest.approx(50.0), "the workers' own word stands"
    assert not predicted.refuses(3.0), f"100 requests at 50/s are answered within 3 s: {predicted}"
