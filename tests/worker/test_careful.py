"""Redelivered batches: crash bisection across deliveries, dead letters, healthy inputs still answered.

A worker *death* is simulated in process by a backend that raises ``Died`` (a BaseException the
worker does not handle, as a segfault would not be); the next worker is built over the same store,
partition and delivery log, and gets the same batch again, as Kafka would redeliver it uncommitted.
"""

from __future__ import annotations

import asyncio
import functools
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gpu_worker.careful import plan
from schemas.deadletter import DEAD_LETTERED, DeadLetter
from schemas.records import Batch, TaskState, TaskStatus
from telemetry import metrics, tracing
from tests.support.eventually import eventually
from tests.support.trace_checks import from_sdk
from tests.support.worker_rig import RecordingConsumer, Rig, ScriptedBackend, now_ms
from transport.deliveries import MemoryDeadLetters, MemoryDeliveryLog, Suspects
from transport.ports import PartitionsCallback, TransportError


def suspects(ids: set[str], strikes: int, marked: bool = True) -> Suspects:
    return Suspects(frozenset(ids), dict.fromkeys(ids, strikes), marked)


def test_plan_runs_suspects_in_halves_then_the_others_together() -> None:
    decided = plan(list("abcdef"), str, suspects({"c", "d", "e", "f"}, 1), max_deliveries=3)
    assert decided.groups == [["c", "d"], ["e", "f"], ["a", "b"]]
    assert decided.dead == []


def test_plan_sets_aside_a_lone_suspect_with_enough_strikes() -> None:
    decided = plan(list("abc"), str, suspects({"b"}, 3), max_deliveries=3)
    assert decided.groups == [["a", "c"]]
    assert decided.dead == ["b"]


def test_plan_runs_a_lone_suspect_again_while_it_has_few_strikes() -> None:
    assert plan(["x"], str, suspects({"x"}, 2), max_deliveries=3).groups == [["x"]]


def test_plan_never_dead_letters_a_group() -> None:
    decided = plan(list("ab"), str, suspects({"a", "b"}, 9), max_deliveries=3)
    assert decided.groups == [["a"], ["b"]] and decided.dead == []


def test_plan_runs_a_lone_remaining_suspect_whose_partner_at_the_death_ended() -> None:
    decided = plan(["a"], str, suspects({"a", "b"}, 3), max_deliveries=3)
    assert decided.groups == [["a"]] and decided.dead == [], "a was never in flight alone"


async def deliver_until_answered(
    rig: Rig, batch: Batch, die_on: str | None, rounds: int = 20
) -> tuple[int, list[list[str]]]:
    """Delivers ``batch`` to fresh workers until every task has ended; returns deaths and backend calls."""
    await rig.listen()
    ids = [item.task_id for item in batch.items]
    calls: list[list[str]] = []
    for deaths in range(rounds):
        backend = ScriptedBackend(die_on=die_on)
        worker = await rig.worker(backend)
        await rig.send(batch)
        answered = asyncio.create_task(rig.ended(ids))
        died = asyncio.create_task(worker.failed.wait())
        await asyncio.wait({answered, died}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        calls.extend(backend.calls)
        if answered.done():
            died.cancel()
            await asyncio.gather(died, return_exceptions=True)
            await worker.close()
            return deaths, calls
        answered.cancel()
        await asyncio.gather(answered, return_exceptions=True)
        assert died.done(), "the worker neither answered nor died within 10 s"
        assert isinstance(worker.failure, BaseException), "a dead worker records why"
        assert worker.state == "failed", "and its heartbeat shows it is not live"
        await worker.close()
    raise AssertionError(f"batch still not answered after {rounds} deliveries")


async def test_a_crashing_input_is_dead_lettered_and_the_rest_answered() -> None:
    rig = Rig()
    inputs = [f"ok{i}" for i in range(7)] + ["poison"]
    batch = rig.batch(inputs)
    await rig.create(batch)
    deaths, calls = await deliver_until_answered(rig, batch, die_on="poison")
    states = {task: replies for task, replies in rig.replies.items()}
    assert all(len(replies) == 1 for replies in states.values()), f"one answer per task: {states}"
    for i in range(7):
        assert states[f"t{i}"][0].output == f"ok{i}"[::-1], f"t{i} must be answered: {states[f't{i}'][0]}"
    poisoned = states["t7"][0]
    assert poisoned.status is TaskStatus.FAILED and poisoned.error_code == DEAD_LETTERED, poisoned
    assert len(rig.dead_letters.letters) == 1
    letter = rig.dead_letters.letters[0]
    assert [item.input for item in letter.items] == ["poison"]
    assert letter.deliveries == deaths + 1 and letter.items[0].strikes >= 3
    ran = Counter(text for call in calls for text in call if text != "poison")
    # a healthy input shares each crashing group with the culprit at most once per halving: 1 + log2(8)
    assert max(ran.values()) <= 4, f"healthy inputs ran too often: {ran}"
    # 8 inputs: death with all 8, then halves of 4, 2, 1, then the lone input twice more
    assert deaths <= 6, f"crash bisection should take about log2(8) + 2 deaths, took {deaths}"


async def test_two_crashing_inputs_in_both_halves_of_a_batch_are_dead_lettered_and_the_rest_answered() -> None:
    """The first death strikes every input and the halves each hold a crashing one: the half that did not
    run is not cleared by the other's death, and runs after it is split, else the two halves take turns
    killing workers until every deadline passes."""
    rig = Rig()
    batch = rig.batch(["ok0", "poison-a", "ok2", "poison-b"])
    await rig.create(batch)
    deaths, _ = await deliver_until_answered(rig, batch, die_on="poison", rounds=30)
    ended = {task: replies[0] for task, replies in rig.replies.items()}
    assert [ended[task].output for task in ("t0", "t2")] == ["0ko", "2ko"], ended
    assert {ended[task].error_code for task in ("t1", "t3")} == {DEAD_LETTERED}, ended
    assert deaths <= 10, f"two crashing inputs of four: {deaths} deaths"


async def test_a_lone_crashing_input_goes_to_the_dead_letter_topic_after_max_deliveries() -> None:
    rig = Rig()
    batch = rig.batch(["poison"])
    await rig.create(batch)
    deaths, calls = await deliver_until_answered(rig, batch, die_on="poison")
    assert deaths == 3, f"max_deliveries=3: three deaths, then set aside; got {deaths}"
    assert len(calls) == 3, "the fourth delivery does not call the backend"
    assert rig.replies["t0"][0].error_code == DEAD_LETTERED
    assert "set aside in this process's memory" in (rig.replies["t0"][0].error_message or ""), "where it went"


async def test_one_death_dead_letters_nothing() -> None:
    rig = Rig()
    batch = rig.batch(["a", "b", "c"])
    await rig.create(batch)
    await rig.deliveries.begin(batch.batch_id, "died")  # a first delivery whose worker was killed mid-call
    redelivered = _redelivered()
    deaths, calls = await deliver_until_answered(rig, batch, die_on=None)
    assert deaths == 0
    assert _redelivered() == redelivered + 1, "the worker counts the batch it took again"
    assert calls == [["a"], ["b", "c"]], f"a redelivered batch runs its suspects in halves, got {calls}"
    assert {task: states[0].status for task, states in rig.replies.items()} == dict.fromkeys(
        ["t0", "t1", "t2"], TaskStatus.COMPLETED
    )
    assert rig.dead_letters.letters == []


async def test_max_deliveries_1_sets_a_lone_input_aside_at_its_first_redelivery() -> None:
    rig = Rig()
    batch = rig.batch(["poison"])
    await rig.create(batch)
    await rig.listen()
    first = await rig.worker(ScriptedBackend(die_on="poison"), max_deliveries=1)
    await rig.send(batch)
    await asyncio.wait_for(first.failed.wait(), 10)
    await first.close()
    second = await rig.worker(ScriptedBackend(), max_deliveries=1)
    await rig.send(batch)
    ended = await rig.ended(["t0"])
    await second.close()
    assert ended["t0"].error_code == DEAD_LETTERED


def _redelivered() -> float:
    """``batchwire_batches_redelivered_total`` of the rig's first worker (its count from earlier tests too)."""
    return metrics.REGISTRY.get_sample_value("batchwire_batches_redelivered_total", {"worker": "w1"}) or 0.0


async def test_a_later_group_whose_items_can_no_longer_be_answered_in_time_ends_expired_unrun() -> None:
    """A redelivered batch runs its groups one call after another: before each, the items a call
    started then would answer past their deadline end ``expired`` (as a first delivery's do), not
    computed for callers who were answered 504."""
    rig = Rig()
    await rig.listen()
    backend = ScriptedBackend(latency_s=2.0)
    worker = await rig.worker(backend, expected_latency_ms=2000.0)
    # one call fits, two do not: 1.5 s of slack for the first group's start
    batch = rig.batch(["aa", "bb"], deadline_ms=now_ms() + 3500)
    await rig.create(batch)
    await rig.deliveries.begin(batch.batch_id, "died")  # its last holder died unmarked: both suspects, one group each
    await rig.send(batch)
    ended = await rig.ended(["t0", "t1"])
    await worker.close()
    assert ended["t0"].status is TaskStatus.COMPLETED, ended["t0"]
    assert ended["t1"].status is TaskStatus.EXPIRED, f"bb could only end past its deadline: {ended['t1']}"
    assert backend.calls == [["aa"]], f"only the group still in time reaches the backend, got {backend.calls}"


class LostReplies(MemoryDeliveryLog):
    """Loses the first answer of each ``lose`` call ("begin", "suspects") per batch: the call is done, then
    the worker sees an error and tries again (a connection that dropped after Redis's write)."""

    def __init__(self, lose: str) -> None:
        super().__init__()
        self.lose = lose
        self.lost: list[str] = []

    def _lose_once(self, call: str, batch_id: str) -> None:
        if call == self.lose and batch_id not in self.lost:
            self.lost.append(batch_id)
            raise TransportError(f"{call} of {batch_id}: the connection dropped after the write")

    async def begin(self, batch_id: str, receipt: str) -> int:
        count = await super().begin(batch_id, receipt)
        self._lose_once("begin", batch_id)
        return count

    async def suspects(self, batch_id: str, task_ids: Sequence[str], receipt: str) -> Suspects:
        found = await super().suspects(batch_id, task_ids, receipt)
        self._lose_once("suspects", batch_id)
        return found


async def test_a_first_delivery_whose_count_was_answered_too_late_runs_as_a_first() -> None:
    deliveries = LostReplies("begin")
    rig = Rig(deliveries=deliveries)
    await rig.listen()
    backend = ScriptedBackend()
    worker = await rig.worker(backend)
    batch = rig.batch(["a", "b", "c"])
    await rig.create(batch)
    await rig.send(batch)
    await rig.ended(["t0", "t1", "t2"])
    await worker.close()
    assert deliveries.lost == ["b1"], f"the count's answer was lost once: {deliveries.lost}"
    assert backend.calls == [["a", "b", "c"]], f"one call, not suspects in halves: {backend.calls}"


async def test_a_redelivery_whose_suspects_were_answered_too_late_keeps_the_mark() -> None:
    deliveries = LostReplies("suspects")
    rig = Rig(deliveries=deliveries)
    batch = rig.batch(["a", "b", "c"])
    await rig.create(batch)
    await deliveries.begin(batch.batch_id, "died")  # the first delivery, to a worker that died running c alone
    await deliveries.mark(batch.batch_id, ["t2"])
    await rig.listen()
    backend = ScriptedBackend()
    worker = await rig.worker(backend)
    await rig.send(batch)
    await rig.ended(["t0", "t1", "t2"])
    await worker.close()
    assert deliveries.lost == ["b1"], f"the suspects' answer was lost once: {deliveries.lost}"
    assert backend.calls == [["c"], ["a", "b"]], f"c (the one in flight) alone, a and b together: {backend.calls}"


async def test_a_batch_handed_back_by_each_stopping_worker_is_answered_not_dead_lettered() -> None:
    """Rolling restarts during a long call: each worker's drain runs out and it hands the batch back.
    Four hand-backs struck its inputs past ``max_deliveries`` (3) when each counted as a death."""
    rig = Rig()
    batch = rig.batch(["a", "b", "c"])
    await rig.create(batch)
    await rig.listen()
    blocked: list[ScriptedBackend] = []
    try:
        for _ in range(4):
            backend = ScriptedBackend(hang_on="")  # every call blocks until released
            blocked.append(backend)
            worker = await rig.worker(backend)
            await rig.send(batch)
            await eventually(functools.partial(len, backend.calls), "the worker's call to start")
            await worker.close(drain_timeout_s=0)
            assert worker.failure is None, f"a graceful stop: {worker.failure!r}"
        backend = ScriptedBackend()
        worker = await rig.worker(backend)
        await rig.send(batch)
        ended = await rig.ended(["t0", "t1", "t2"])
        await worker.close()
    finally:
        for stuck in blocked:
            stuck.release.set()
    assert rig.dead_letters.letters == [], f"nothing is dead-lettered: {rig.dead_letters.letters}"
    assert {task: state.status for task, state in ended.items()} == dict.fromkeys(
        ["t0", "t1", "t2"], TaskStatus.COMPLETED
    ), ended
    assert backend.calls == [["a", "b", "c"]], f"no suspects: the batch runs in one call, got {backend.calls}"


class Revocable(RecordingConsumer):
    """Keeps the worker's revocation callback, for the test to revoke the partition (a rebalance)."""

    async def start(self, on_assigned: PartitionsCallback, on_revoked: PartitionsCallback) -> None:
        self.revoke = on_revoked
        await super().start(on_assigned, on_revoked)


async def test_a_batch_handed_back_on_a_revocation_is_recorded_so_its_next_holder_strikes_nothing() -> None:
    rig = Rig()
    batch = rig.batch(["a", "b"])
    await rig.create(batch)
    backend = ScriptedBackend(hang_on="")  # the call runs until released
    consumer = Revocable(rig.bus, rig.committed)
    worker = await rig.worker(backend, consumer, drain_timeout_s=0)
    try:
        await rig.send(batch)
        await eventually(functools.partial(len, backend.calls), "the worker's call to start")
        await consumer.revoke(frozenset({0}))  # its drain (0 s) runs out: the batch goes uncommitted
        assert await rig.deliveries.begin(batch.batch_id, "next") == 2, "the next holder's is the second delivery"
        suspects = await rig.deliveries.suspects(batch.batch_id, ["t0", "t1"], "next")
    finally:
        backend.release.set()
        await worker.close()
    assert suspects.handed_back and not suspects.strikes, f"a hand-back, no strike: {suspects}"


class HandBackUnreachable(MemoryDeliveryLog):
    """Redis is unreachable just as the worker records its hand-back."""

    async def hand_back(self, batch_id: str, receipt: str) -> bool:
        raise TransportError(f"recording the hand-back of batch {batch_id}: connection refused")


async def test_a_hand_back_that_cannot_be_recorded_counts_as_a_death(caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig(deliveries=HandBackUnreachable())
    batch = rig.batch(["a", "b"])
    await rig.create(batch)
    backend = ScriptedBackend(hang_on="")
    worker = await rig.worker(backend)
    try:
        await rig.send(batch)
        await eventually(functools.partial(len, backend.calls), "the worker's call to start")
        await worker.close(drain_timeout_s=0)  # the stop goes on
    finally:
        backend.release.set()
    await rig.deliveries.begin(batch.batch_id, "next")
    suspects = await rig.deliveries.suspects(batch.batch_id, ["t0", "t1"], "next")
    assert dict(suspects.strikes) == {"t0": 1, "t1": 1}, f"struck as for a crash: {suspects}"
    assert any("could not record" in r.getMessage() for r in caplog.records), "the worker says it could not"


async def test_an_input_never_in_flight_alone_is_not_dead_lettered_when_its_partner_ended() -> None:
    """Two inputs were in flight together at every death; one of them ended before the batch came
    again (cancelled, or past its deadline). The other was never alone at a death, so nothing proves
    it the culprit: it runs alone, and is answered."""
    rig = Rig()
    batch = rig.batch(["a", "poison"])
    await rig.create(batch)
    await rig.deliveries.begin(batch.batch_id, "died")  # its last holder died with both in flight, unmarked
    await rig.store.apply([TaskState("t1", TaskStatus.CANCELLED, "sim", now_ms(), batch.items[1].enqueued_at_ms)])
    await rig.listen()
    backend = ScriptedBackend()
    worker = await rig.worker(backend, max_deliveries=1)
    await rig.send(batch)
    ended = await rig.ended(["t0"])
    await worker.close()
    assert rig.dead_letters.letters == [], f"a was never in flight alone: {rig.dead_letters.letters}"
    assert ended["t0"].status is TaskStatus.COMPLETED, ended["t0"]
    assert backend.calls == [["a"]], f"a runs alone, as a suspect: {backend.calls}"


async def test_the_embedded_dead_letters_keep_the_latest_ones_only() -> None:
    """Nothing reads them but a test or a debugger: a client that keeps sending inputs that kill the
    worker must not grow the process for ever."""
    sink = MemoryDeadLetters()
    for n in range(MemoryDeadLetters.KEEP + 5):
        await sink.send(DeadLetter(f"b{n}", "sim", "batcher", "worker", 3, "killed", n))
    assert len(sink.letters) == MemoryDeadLetters.KEEP
    assert [letter.batch_id for letter in sink.letters[:1] + sink.letters[-1:]] == [
        "b5",
        f"b{MemoryDeadLetters.KEEP + 4}",
    ]


async def test_a_redelivered_batch_has_its_backend_span_under_its_worker_span() -> None:
    """A redelivered batch's groups run one call after another: its ``worker.run`` span holds a
    ``backend`` span from the first call's start to the last one's end, as a first delivery's does."""
    exporter = InMemorySpanExporter()
    tracing.configure(None, "batchwire-test", exporter=exporter)
    try:
        rig = Rig()
        batch = replace(rig.batch(["a", "b", "c"]), traceparent=f"00-{'1' * 32}-{'2' * 16}-01")
        await rig.create(batch)
        await rig.deliveries.begin(batch.batch_id, "died")  # a first delivery whose worker was killed mid-call
        deaths, calls = await deliver_until_answered(rig, batch, die_on=None)
        assert deaths == 0 and len(calls) == 2, f"the suspects run in halves, in two calls: {calls}"
        await eventually(
            lambda: any(span.name == "result.store" for span in exporter.get_finished_spans()),
            "the batch's worker spans to be recorded",
        )
    finally:
        tracing.shutdown()
    spans = {span.name: span for span in from_sdk(exporter.get_finished_spans())}
    assert "backend" in spans, f"the batch's calls have no span: {sorted(spans)}"
    run, backend = spans["worker.run"], spans["backend"]
    assert backend.parent_id == run.span_id, "the calls are the worker span's child"
    # the call's times move from the monotonic clock to the wall clock: within a millisecond (docs/tracing.md)
    ms = 1_000_000
    assert run.start_ns - ms <= backend.start_ns < backend.end_ns <= run.end_ns + ms, "within the worker's run"
