"""The worker loop over in-memory transports: one batch at a time, poison isolation, statuses."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from gpu_worker.settings import WorkerSettings
from gpu_worker.worker import Worker
from schemas.records import Batch, BatchItem, TaskState, TaskStatus, call_ms_named
from telemetry.metrics import REGISTRY
from tests.support.eventually import eventually
from tests.support.worker_rig import PoisonBackend, Rig, ScriptedBackend, now_ms, run_batch
from transport.memory.batches import MemoryBatchBus
from transport.memory.credits import MemoryCreditPool
from transport.memory.store import MemoryTaskStore


async def test_healthy_batch_completes_in_order() -> None:
    ended, backend = await run_batch(["a", "b", "c"])
    assert {k: (v.status, v.output) for k, v in ended.items()} == {
        "t0": (TaskStatus.COMPLETED, "A"),
        "t1": (TaskStatus.COMPLETED, "B"),
        "t2": (TaskStatus.COMPLETED, "C"),
    }
    assert backend.calls == [3]
    assert all(state.batch_size == 3 and state.worker_id == "w1" for state in ended.values())


async def test_a_poison_input_is_isolated_by_bisection() -> None:
    inputs = [f"ok{i}" for i in range(7)] + ["poison!"]
    ended, backend = await run_batch(inputs)
    failed = {k for k, v in ended.items() if v.status is TaskStatus.FAILED}
    assert failed == {"t7"}, f"only the poison input should fail, got {failed}"
    assert ended["t7"].error_code == "backend_error"
    assert "blew up" in (ended["t7"].error_message or "")
    assert all(ended[f"t{i}"].output == f"OK{i}" for i in range(7))
    assert backend.calls[0] == 8 and len(backend.calls) <= 1 + 2 * 3, "bisection stays logarithmic"


async def test_inputs_rejected_up_front_fail_alone() -> None:
    ended, backend = await run_batch(["short", "x" * 60])
    assert ended["t0"].status is TaskStatus.COMPLETED
    assert ended["t1"].status is TaskStatus.FAILED
    assert ended["t1"].error_code == "input_too_long"
    assert backend.calls == [1]


async def test_expired_items_never_reach_the_backend() -> None:
    ended, backend = await run_batch(["a", "b"], deadline_ms=now_ms() - 1)
    assert {v.status for v in ended.values()} == {TaskStatus.EXPIRED}
    assert backend.calls == []


async def test_items_whose_deadline_passes_before_the_call_could_end_are_not_run() -> None:
    """A call expected to take 5 s would answer a 1 s deadline too late: computing it is waste."""
    settings = WorkerSettings(worker_id="w1", expected_latency_ms=5000)
    ended, backend = await run_batch(["a", "b"], deadline_ms=now_ms() + 1000, settings=settings)
    assert {v.status for v in ended.values()} == {TaskStatus.EXPIRED}
    assert all(v.error_code == "deadline_exceeded" for v in ended.values())
    assert all("is shorter than one call of the model" in (v.error_message or "") for v in ended.values())
    assert all("above 5000" in (v.error_message or "") for v in ended.values())
    assert {call_ms_named(v.error_message) for v in ended.values()} == {5000}, "the gateway reads the call's length"
    assert backend.calls == []


async def test_a_timeout_longer_than_a_call_that_expires_blames_the_queue() -> None:
    """The timeout could have been met by a call: what it met was a queue, so waiting is the advice."""
    settings = WorkerSettings(worker_id="w1", expected_latency_ms=5000)
    ended, backend = await run_batch(["a"], deadline_ms=now_ms() + 4000, enqueued_ago_ms=6000, settings=settings)
    assert ended["t0"].status is TaskStatus.EXPIRED
    assert "queue was long" in (ended["t0"].error_message or "")
    assert backend.calls == []


class TimedBackend(PoisonBackend):
    """Each call sleeps ``call_s`` and records its monotonic start and end."""

    def __init__(self, call_s: float) -> None:
        super().__init__()
        self.call_s = call_s
        self.spans: list[tuple[float, float]] = []

    def batchstring(self, inputs: list[str]) -> list[str]:
        start = time.monotonic()
        time.sleep(self.call_s)
        self.spans.append((start, time.monotonic()))
        return super().batchstring(inputs)


async def test_the_next_credit_is_offered_before_the_running_call_ends() -> None:
    """With a lead, the next batch is claimed and sent while the GPU still runs the current one,
    and starts as soon as that one ends."""
    store = MemoryTaskStore()
    credits = MemoryCreditPool()
    bus = MemoryBatchBus(1)
    backend = TimedBackend(call_s=1.0)  # the lead leaves 0.5 s of slack for a busy event loop
    settings = WorkerSettings(worker_id="w1", expected_latency_ms=1000, credit_lead_ms=500)
    worker = Worker(settings, bus.consumer(0), credits, store, backend)
    answered: list[str] = []
    both = asyncio.Event()

    def on_reply(state: TaskState) -> None:
        answered.append(state.task_id)
        if len(answered) == 2:
            both.set()

    await store.listen_replies("gw", on_reply)
    await worker.start()
    try:
        first_credit = await credits.claim("sim", 5)
        assert first_credit is not None
        now = now_ms()
        first = (BatchItem("t0", "a", now, now + 30_000, "gw"),)
        await bus.send(Batch("b1", "sim", "test", now, "idle_worker", first_credit.ref, first), 0)
        second_credit = await credits.claim("sim", 5)
        claimed_at = time.monotonic()
        assert second_credit is not None and second_credit.ref != first_credit.ref
        assert len(backend.spans) == 0, "the next credit must come while the first call still runs"
        second = (BatchItem("t1", "b", now, now + 30_000, "gw"),)
        await bus.send(Batch("b2", "sim", "test", now, "idle_worker", second_credit.ref, second), 0)
        await asyncio.wait_for(both.wait(), 10)
        assert len(backend.spans) == 2, f"both batches must run, ran {len(backend.spans)}"
        (_, first_end), (second_start, _) = backend.spans
        assert claimed_at < first_end, "the credit was claimed before the first call ended"
        assert second_start - first_end < 0.5, f"the second batch waited {second_start - first_end:.3f} s"
        assert worker.batches_run == 2
    finally:
        await worker.close()


async def test_a_batch_that_needs_no_call_is_stored_after_the_one_still_running() -> None:
    """Results are stored (and batches committed) in the order batches came, even when a later batch
    needs no backend call while an earlier one still runs."""
    rig = Rig()
    await rig.listen()
    worker = await rig.worker(ScriptedBackend(latency_s=0.4), expected_latency_ms=400, credit_lead_ms=300)
    try:
        running = rig.batch(["a"], "b1")
        await rig.create(running)
        await rig.send(running)
        now = now_ms()
        late = Batch("b2", "sim", "test", now, "idle_worker", None, (BatchItem("t9", "z", now, now - 1, "gw"),))
        await rig.create(late)
        await rig.send(late)

        ended = await rig.ended(["t0", "t9"])
        assert ended["t0"].status is TaskStatus.COMPLETED and ended["t9"].status is TaskStatus.EXPIRED
        order = list(rig.replies)
        assert order.index("t0") < order.index("t9"), f"b2 was stored before b1, which ran first: {order}"
    finally:
        await worker.close()


async def test_a_batch_whose_call_failed_is_committed_before_the_one_whose_call_ran_behind_it() -> None:
    """b1's call fails and is split; its halves run behind b2's call, queued meanwhile. b2's results
    come first, but committing b2 would commit b1 too: a worker killed before b1's results are
    stored would lose it (never delivered again)."""
    rig = Rig()
    await rig.listen()
    backend = ScriptedBackend(latency_s=0.3, fail_on="poison")
    worker = await rig.worker(backend, expected_latency_ms=300, credit_lead_ms=250)
    try:
        first = rig.batch(["poison", "fine"], "b1", prefix="a")
        second = rig.batch(["next"], "b2", prefix="b")
        for batch in (first, second):
            await rig.create(batch)
            await rig.send(batch)
        ended = await rig.ended(["a0", "a1", "b0"])
        assert [ended[task].status for task in ("a0", "a1", "b0")] == [
            TaskStatus.FAILED,
            TaskStatus.COMPLETED,
            TaskStatus.COMPLETED,
        ]
        assert backend.calls[:2] == [["poison", "fine"], ["next"]], "b2's call ran before b1's halves"
        await eventually(lambda: len(rig.committed) == 2, "both batches committed")
        assert rig.committed == [0, 1], f"b2 (offset 1) was committed before b1 (offset 0): {rig.committed}"
    finally:
        await worker.close()


async def test_each_input_counts_its_batchs_wait_for_the_call_and_the_call_itself() -> None:
    """``batchwire_request_stage_seconds``: a batch of n adds n times its wait and its call, and n to
    ``batchwire_request_stage_inputs``, so the one over the other is a mean per request (what
    ``batchwire bench`` reports as stages), even where a deterministic model runs a duplicate once."""

    def sample(name: str, labels: dict[str, str]) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    def stage(name: str) -> float:
        return sample("batchwire_request_stage_seconds_total", {"model": "sim", "stage": name})

    def counted() -> tuple[float, float]:
        return (
            sample("batchwire_request_stage_inputs_total", {"model": "sim"}),
            sample("batchwire_backend_items_total", {"model": "sim"}),
        )

    before = (stage("call"), stage("sealed_to_started"))
    calls_before = sample("batchwire_backend_call_seconds_sum", {"model": "sim", "backend": "poison"})
    inputs_before = counted()
    started = time.monotonic()
    await run_batch(["a", "b", "a"], settings=WorkerSettings(worker_id="w1", deterministic=True))
    took_s = time.monotonic() - started
    call_s = sample("batchwire_backend_call_seconds_sum", {"model": "sim", "backend": "poison"}) - calls_before
    assert stage("call") - before[0] == pytest.approx(3 * call_s), "three inputs, each the whole call"
    waited_s = stage("sealed_to_started") - before[1]
    # A batch's created_at_ms is whole milliseconds, so its wait reads up to 1 ms long.
    assert 0.0 <= waited_s <= 3 * (took_s + 0.001), f"three inputs' waits, each within the run's {took_s:.4f} s"
    inputs_after = counted()
    assert inputs_after[0] - inputs_before[0] == 3, "the stages' denominator counts every input"
    assert inputs_after[1] - inputs_before[1] == 2, "the backend ran the duplicate once"


async def test_a_closed_worker_leaves_no_running_call_gauge_holding_its_backend() -> None:
    """The gauge reads the worker's calls through a function the registry keeps: left there, it would keep
    a replaced worker's backend (a model's weights) alive for the process's life, and export a figure for
    a worker that is gone."""
    rig = Rig()
    await rig.listen()
    worker = await rig.worker(ScriptedBackend(latency_s=0.01))
    gauge = {"worker": worker.settings.worker_id}
    assert REGISTRY.get_sample_value("batchwire_worker_call_running_seconds", gauge) == 0.0, "exported while it runs"
    await worker.close()
    assert REGISTRY.get_sample_value("batchwire_worker_call_running_seconds", gauge) is None


async def test_a_restarted_worker_offers_credits_its_last_run_never_did() -> None:
    """A worker restarted with the same ``--worker-id``: a batch still on its partition, sent against a
    credit of its last run, must not look sent against a credit of this one."""
    store = MemoryTaskStore()
    credits = MemoryCreditPool()
    bus = MemoryBatchBus(1)
    refs: list[str] = []
    for _ in range(2):
        worker = Worker(WorkerSettings(worker_id="w1"), bus.consumer(0), credits, store, PoisonBackend())
        await worker.start()
        try:
            credit = await credits.claim("sim", 5)
            assert credit is not None and credit.worker_id == "w1"
            refs.append(credit.ref)
        finally:
            await worker.close()
    assert refs[0] != refs[1], f"both runs offered {refs[0]}"


class SlowLoadBackend(ScriptedBackend):
    """Its load runs until the test lets it end; notes a close that came while it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.loading = threading.Event()
        self.load_may_end = threading.Event()
        self.closed_while_loading = False

    def load(self) -> None:
        self.loading.set()
        self.load_may_end.wait(timeout=30)
        self.loading.clear()

    def close(self) -> None:
        self.closed_while_loading = self.loading.is_set()
        super().close()


async def test_a_worker_shut_down_while_its_model_loads_never_closes_the_model_under_the_load() -> None:
    """A shutdown during a slow load (hf weights): the load runs on in the runner thread, and freeing the
    model under it would crash or corrupt it. The process is ending: the backend is left unclosed."""
    backend = SlowLoadBackend()
    worker = Worker(
        WorkerSettings(worker_id="w1"), MemoryBatchBus(1).consumer(0), MemoryCreditPool(), MemoryTaskStore(), backend
    )
    starting = asyncio.create_task(worker.start())
    await eventually(backend.loading.is_set, "the load running on the runner thread")
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    try:
        await worker.close(drain_timeout_s=0)
        assert not backend.closed_while_loading and not backend.closed, "the backend closed under its load"
    finally:
        backend.load_may_end.set()


async def test_a_timeout_shorter_than_a_call_is_blamed_without_advising_to_leave_it_out() -> None:
    """The worker cannot tell a caller's timeout_ms from the gateway's default: leaving timeout_ms out
    helps only when that default is longer than a call, so the advice names the default's setting."""
    settings = WorkerSettings(worker_id="w1", expected_latency_ms=5000)
    ended, backend = await run_batch(["a"], deadline_ms=now_ms() + 1000, settings=settings)
    message = ended["t0"].error_message or ""
    assert "or leave it out" not in message, f"the default may be what is too short: {message}"
    assert "--default-timeout-ms" in message, f"the advice names the default's setting: {message}"
    assert backend.calls == []
