"""Each client's fair share of a model's capacity while its queue builds: pure, and in admission."""

from __future__ import annotations

import math
import time

import pytest

from gateway.admission.fair_share import LEVEL_FOR_S, FairShare, water_level
from gateway.admission.gate import Admission, Caller
from gateway.errors import Overloaded
from gateway.settings import GatewaySettings
from schemas.records import Credit
from tests.support.queue_depth import Counters, admit_sent
from transport.memory.credits import MemoryCreditPool
from transport.ports import Backlog


def test_the_water_level_meets_small_demands_whole_and_splits_the_rest() -> None:
    assert water_level([5.0, 150.0], 50.0) == 45.0
    assert water_level([30.0, 30.0, 30.0], 60.0) == 20.0
    assert water_level([1.0, 2.0], 50.0) == math.inf, "demands under the capacity are all met"


def test_a_client_over_its_share_is_named_and_one_under_it_is_not() -> None:
    fair = FairShare()
    for step in range(40):  # 2 s: "flood" at 100/s, "quiet" at 2/s
        now = step / 20
        for _ in range(5):
            fair.admitted("m", "flood", now)
        if step % 10 == 0:
            fair.admitted("m", "quiet", now)
    over = fair.over_share("m", "flood", 50.0, 2.0)
    assert over is not None, "the flood sends more than the 48/s left to it"
    rate, share, clients = over
    assert 60 < rate < 110 and share > 45 and clients == 2, over  # the rate nears 100/s as history grows
    assert fair.over_share("m", "quiet", 50.0, 2.0) is None


def test_weighed_by_tokens_the_client_of_long_inputs_is_over_its_share_not_the_one_of_many_short() -> None:
    """30 requests/s drained: "long" sends 20/s of 250 tokens, "short" 40/s of 5. By count, "short" is
    over its share (15/s); by weight, "long" sends nearly all the work, and is."""
    fair = FairShare()
    for step in range(40):  # 2 s
        now = step / 20
        fair.admitted("m", "long", now, 250)
        fair.admitted("m", "short", now, 5)
        fair.admitted("m", "short", now, 5)
    over = fair.over_share("m", "long", 30.0, 2.0)
    assert over is not None, "the long inputs' client sends more work than is left to it"
    _, share, clients = over
    mean = (20 * 250 + 40 * 5) / 60
    assert clients == 2 and abs(share - (30 * mean - 40 * 5)) < 0.2 * 30 * mean, f"a share in tokens/s: {over}"
    assert fair.over_share("m", "short", 30.0, 2.0) is None, "the short inputs' client is within its share"
    by_count = FairShare()
    for step in range(40):
        now = step / 20
        for client in ("long", "short", "short"):
            by_count.admitted("m", client, now)
    assert by_count.over_share("m", "short", 30.0, 2.0) is not None, "counted, the many short requests look over"


def test_a_lone_clients_share_is_the_whole_drain() -> None:
    """Alone, a client may send what the model drains, not more: a flood that queued work up to its
    own deadline would hold off every later client of a shorter one."""
    fair = FairShare()
    for step in range(40):
        for _ in range(5):
            fair.admitted("m", "flood", step / 20)  # 100 requests/s
    assert fair.over_share("m", "flood", 150.0, 2.0) is None, "under the drain, alone: no share holds it"
    over = fair.over_share("m", "flood", 50.0, 2.0)
    assert over is not None and over[0] > 50.0 and over[1:] == (50.0, 1), "over the drain, alone: the drain holds it"
    fair.admitted("m", "quiet", 2.0)
    over = fair.over_share("m", "flood", 50.0, 2.0)
    assert over is not None and over[1] < 50.0 and over[2] == 2, "a second client sending takes its part"
    assert fair.over_share("m", "flood", 50.0, 12.0) is None, "once both stopped, nobody is over a share"


async def test_a_key_flooding_a_building_queue_is_refused_and_another_key_is_admitted() -> None:
    """A queue of 100 that drains 50/s (2 s of work): key A at 100 requests/s is refused past its share
    of the capacity, naming it; key C at 2 requests/s is admitted every time."""
    counters = Counters()
    admission = Admission(GatewaySettings(models=("a",), default_model="a"), counters, None, clock=counters.clock)
    flood, quiet = Caller(owner="tenant-a"), Caller(owner="tenant-c")
    left = batches = 0
    refused: list[str] = []
    for step in range(1, 41):  # 4 s, sampled every 0.1 s as the gateway's sampler does
        left, batches = left + 5, batches + 1
        counters.backlogs = {"a": Backlog(100, left, batches, step / 10)}
        admission.models()
        for _ in range(10):
            try:
                await admit_sent(admission, "a", 30_000, caller=flood)
            except Overloaded as err:
                refused.append(err.message)
        if step % 5 == 0:
            await admit_sent(admission, "a", 30_000, caller=quiet)  # raises if the quiet key is refused
    assert refused, "the flooding key is held to its share"
    assert "above its fair share" in refused[-1] and "model 'a'" in refused[-1], refused[-1]
    assert len(refused) < 400 - 100, f"the flood keeps about its share of the capacity: {len(refused)} refused"


async def test_a_burst_of_two_keys_that_an_idle_workers_next_batch_takes_is_admitted_whole() -> None:
    """One worker of 64 inputs per 8 s call: its next batch holds 8 s of work, past ``FAIR_AFTER_S``.
    Two keys sending 32 each (over 1.3 s) fill that batch and no more; no request of theirs makes
    another wait, so none is refused for its share."""
    counters = Counters()
    pool = MemoryCreditPool()
    admission = Admission(GatewaySettings(models=("a",), default_model="a"), counters, None, pool, clock=counters.clock)
    now_ms = int(time.time() * 1000)
    await pool.offer(Credit("w1", "a", 0, 1, now_ms, now_ms + 60_000, max_batch=64, busy_ms=8_000))
    counters.backlogs = {"a": Backlog(0, 0, 0, 1.0)}
    await admission.read_worker_rates()
    refused = []
    for index in range(64):
        counters.backlogs = {"a": Backlog(0, 0, 0, 1.0 + index * 0.02)}  # the counters lag: admissions add up
        try:
            await admission.admit(Caller(owner="tenant-a" if index % 2 else "tenant-b"), "a", 30_000)
        except Overloaded as err:
            refused.append(err.message)
    assert not refused, f"{len(refused)} of 64 refused: {refused[0]}"
    with pytest.raises(Overloaded, match="above its fair share"):
        await admission.admit(Caller(owner="tenant-a"), "a", 30_000)  # the 65th waits a call: shares hold


@pytest.mark.parametrize("caller", [Caller(), Caller(client="-")])
async def test_callers_not_told_apart_have_no_share(caller: Caller) -> None:
    counters = Counters()
    admission = Admission(GatewaySettings(models=("a",), default_model="a"), counters, None, clock=counters.clock)
    left = batches = 0
    for step in range(1, 21):
        left, batches = left + 5, batches + 1
        counters.backlogs = {"a": Backlog(100, left, batches, step / 10)}
        admission.models()
        for _ in range(10):
            await admit_sent(admission, "a", 30_000, caller=caller)


def test_clients_that_stopped_sending_are_forgotten() -> None:
    fair = FairShare()
    for n in range(5000):
        fair.admitted("m", f"ip:10.0.{n // 256}.{n % 256}", n / 100)  # each sends once, 10 ms apart
    assert fair.remembered("m") < 2048, "the map holds the clients still sending, not every one seen"


class Decays:
    """Counts the rates ``FairShare`` brings up to date: the work an admission costs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        decayed = FairShare._decayed

        def counted(fair: FairShare, entry: tuple[float, float] | None, now_s: float) -> float:
            self.count += 1
            return decayed(fair, entry, now_s)

        monkeypatch.setattr(FairShare, "_decayed", counted)


@pytest.fixture
def decays(monkeypatch: pytest.MonkeyPatch) -> Decays:
    return Decays(monkeypatch)


def test_an_admission_does_not_walk_every_client_while_many_are_sending(decays: Decays) -> None:
    """3,000 clients sending at once: each admission brings one rate up to date, and the walks that
    prune the stopped clients come once the map has doubled, not on every admission past the limit."""
    fair = FairShare()
    for n in range(3_000):
        fair.admitted("m", f"key:{n}", n / 10_000)  # all within 0.3 s: every one still sending
    for n in range(3_000):
        fair.admitted("m", f"key:{n}", 0.3 + n / 10_000)
    assert fair.remembered("m") == 3_000
    assert decays.count < 6_000 + 4 * 3_000, f"{decays.count} rates brought up to date for 6,000 admissions"


def test_judging_shares_does_not_walk_every_client_on_each_admission(decays: Decays) -> None:
    """3,000 clients sending while the queue is long: the shares among them are worked out once in a
    while, not on every admission, so a crowd of senders cannot make each admission cost a walk of all."""
    fair = FairShare()
    for n in range(3_000):
        fair.admitted("m", f"key:{n}", n / 10_000)
    decays.count = 0
    named = 0
    for n in range(3_000):  # 0.3 s of admissions, judged against a drain above what they send in all
        now = 0.3 + n / 10_000
        named += fair.over_share("m", f"key:{n}", 4_000.0, now) is not None
        fair.admitted("m", f"key:{n}", now)
    assert decays.count < 2 * 3_000 + 4 * 3_000, f"{decays.count} rates brought up to date for 3,000 judgements"
    assert named == 0, "3,000 clients at about 1/s each send under the 4,000/s drained"
    for _ in range(2_000):
        fair.admitted("m", "key:7", 0.6)
    flood = fair.over_share("m", "key:7", 4_000.0, 0.6 + LEVEL_FOR_S)
    assert flood is not None, "a client that floods is named once the share is worked out again"
