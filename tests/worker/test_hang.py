"""A hung backend call: the runner notices, the worker gives the batch back and stops."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import pytest

from gpu_worker.runner import FIRST_CALL_LIMIT_S, BackendHung, BackendRunner, NotStarted, Timing
from schemas.records import Batch, BatchItem, TaskState, TaskStatus
from tests.support.eventually import eventually
from tests.support.metrics import tasks_ended
from tests.support.worker_rig import Rig, ScriptedBackend, now_ms
from transport.memory.store import MemoryTaskStore


def test_the_limit_follows_the_moving_average_of_calls() -> None:
    runner = BackendRunner("r", hang_factor=10, hang_min_s=0.5)
    assert runner.limit_s() == FIRST_CALL_LIMIT_S, "no estimate yet: the generous first-call limit"
    runner._observe(0.2)
    assert runner.limit_s() == pytest.approx(2.0)
    runner._observe(0.0)
    assert runner.limit_s() == pytest.approx(1.6), "EWMA with alpha 0.2: 0.2 -> 0.16"
    runner._observe(0.0)
    runner._observe(0.0)
    assert runner.limit_s() == pytest.approx(1.024)
    for _ in range(30):
        runner._observe(0.0)
    assert runner.limit_s() == 0.5, "never below hang_min_s"
    runner.close()


def test_a_runner_that_timed_nothing_starts_from_a_call_time_it_is_given() -> None:
    """A worker that replaces one that hung runs its batch first: with the hung worker's call time, not
    the first-call limit, which would outlast the deadlines of the inputs that shared the batch."""
    fresh = BackendRunner("r", hang_factor=10, hang_min_s=0.5)
    fresh.start_from(0.2)
    assert fresh.limit_s() == pytest.approx(2.0)
    timed = BackendRunner("r", hang_factor=10, hang_min_s=0.5)
    timed._observe(0.1)
    timed.start_from(0.2)
    assert timed.limit_s() == pytest.approx(1.0), "a runner's own timing wins"
    fresh.close()
    timed.close()


def test_a_configured_latency_wins_and_factor_0_turns_detection_off() -> None:
    fixed = BackendRunner("r", hang_factor=10, hang_min_s=0.1, expected_s=0.05)
    fixed._observe(3.0)
    assert fixed.limit_s() == pytest.approx(0.5)
    off = BackendRunner("r", hang_factor=0)
    assert off.limit_s() is None
    fixed.close()
    off.close()


async def test_a_call_past_its_limit_is_hung_and_the_runner_refuses_more() -> None:
    release = threading.Event()
    runner = BackendRunner("r", hang_factor=10, hang_min_s=0.2, expected_s=0.001)
    assert await runner.call(lambda: "fast") == "fast"
    started = time.monotonic()
    with pytest.raises(BackendHung, match=r"hang limit of 0\.2 s"):
        await runner.call(release.wait)
    assert 0.15 < time.monotonic() - started < 2.0
    assert runner.hung
    # The next call does not run: it says so, rather than "has run 0.0 s, past its hang limit of 0.0 s".
    with pytest.raises(BackendHung, match=r"^the backend's thread is still held by an earlier call") as refused:
        await runner.call(lambda: "refused")
    assert "0.0 s" not in str(refused.value), refused.value
    release.set()
    runner.close()


async def test_a_call_that_ends_in_time_is_not_hung_however_late_the_event_loop_wakes() -> None:
    """A process held up (a starved machine) past the limit while its call ended in time: not a hang."""
    runner = BackendRunner("r", hang_factor=10, hang_min_s=0.2, expected_s=0.001)
    call = asyncio.ensure_future(runner.call(time.sleep, 0.01))
    await asyncio.sleep(0)  # the call is on the thread and its limit armed
    time.sleep(0.6)  # noqa: ASYNC251  # the event loop held up three limits long; the call ends meanwhile
    assert await call is None
    assert not runner.hung
    runner.close()


async def test_a_call_whose_process_was_held_up_past_its_limit_is_not_hung_when_it_ends_as_it_resumes() -> None:
    """SIGSTOP, a frozen VM or a starved machine holds the backend's thread up with the event loop: the
    call ends only once the process runs again, as the loop finds its limit passed. It gets the time it
    was held up again before its verdict, so the worker keeps its answer instead of stopping as hung."""
    release = threading.Event()
    runner = BackendRunner("r", hang_factor=10, hang_min_s=0.2, expected_s=0.001)
    call = asyncio.ensure_future(runner.call(release.wait))
    await asyncio.sleep(0)  # the call is on the thread and its limit armed
    time.sleep(0.6)  # noqa: ASYNC251  # the process held up three limits long, the call unfinished
    release.set()  # it ends as the process runs again
    assert await call is True
    assert not runner.hung
    runner.close()


async def test_a_call_still_stuck_after_a_long_hold_up_is_hung_within_its_limit_of_the_resume() -> None:
    """The time a held-up process gets again is bounded: a frozen VM resumed after minutes, its GPU call never
    to end, gets its limit again from the moment it runs again, not the length of the freeze again (its
    model's batches would wait that much longer for a worker that stops)."""
    release = threading.Event()
    runner = BackendRunner("r", hang_factor=10, hang_min_s=0.2, expected_s=0.001)
    call = asyncio.ensure_future(runner.call(release.wait))
    await asyncio.sleep(0)  # the call is on the thread and its limit armed
    time.sleep(2.4)  # noqa: ASYNC251  # the process held up twelve limits long
    resumed = time.monotonic()
    with pytest.raises(BackendHung):
        await call
    judged_s = time.monotonic() - resumed
    assert judged_s < 1.2, (
        f"hung within its 0.2 s limit of the resume (a loaded machine's lateness aside), took {judged_s:.1f} s"
    )
    assert runner.hung
    release.set()
    runner.close()


async def test_a_call_that_ran_past_its_limit_while_held_up_does_not_raise_the_next_limit() -> None:
    """Its time is mostly the hold-up's, no measure of the model: averaged in, it raised the limit of the calls
    after it many times over, and a call that really hung next was declared that much later."""
    release = threading.Event()
    runner = BackendRunner("r", hang_factor=10, hang_min_s=0.2)
    runner.start_from(0.01)
    call = asyncio.ensure_future(runner.call(release.wait))
    await asyncio.sleep(0)  # the call is on the thread and its limit armed
    time.sleep(0.6)  # noqa: ASYNC251  # the process held up three limits long, the call unfinished
    release.set()  # it ends as the process runs again
    assert await call is True
    assert runner.limit_s() == pytest.approx(0.2), f"the limit stays 0.2 s, got {runner.limit_s()} s"
    runner.close()


async def test_a_call_still_queued_at_its_start_by_is_withdrawn_and_never_runs() -> None:
    """Behind a call that overran, a queued call whose start_by passes is taken back: the thread skips it."""
    release = threading.Event()
    runner = BackendRunner("r", hang_factor=10, hang_min_s=30, expected_s=0.01)
    ran: list[str] = []
    blocking = asyncio.ensure_future(runner.call(release.wait))
    await asyncio.sleep(0)  # it reaches the thread first
    with pytest.raises(NotStarted):
        await runner.call(ran.append, "queued", start_by=runner.clock() + 0.2)
    release.set()
    assert await blocking is True
    assert await runner.call(ran.append, "after", start_by=runner.clock() + 0.2) is None, "one that starts in time runs"
    assert ran == ["after"], "the withdrawn call never ran"
    runner.close()


async def test_with_detection_off_a_call_running_past_its_start_by_is_waited_for_not_hung() -> None:
    """``start_by`` withdraws a call the thread has not taken; with no hang limit (factor 0), one that
    runs on past it is waited for, and the worker is not stopped as hung."""
    release = threading.Event()
    runner = BackendRunner("r", hang_factor=0)
    call = asyncio.ensure_future(runner.call(release.wait, start_by=runner.clock() + 0.1))
    done, _ = await asyncio.wait({call}, timeout=0.6)  # five times start_by: the call runs on past it
    assert not done, f"the call ended without its answer: {call.exception() if call.done() else None!r}"
    release.set()
    assert await asyncio.wait_for(call, 10) is True
    assert not runner.hung
    runner.close()


async def test_a_queued_call_whose_caller_is_cancelled_never_runs() -> None:
    """A worker that stops taking batches (its loop cancelled, and the calls in flight with it)
    leaves no call waiting on the thread to compute a batch that goes back uncommitted."""
    release = threading.Event()
    runner = BackendRunner("r", hang_factor=10, hang_min_s=30, expected_s=0.01)
    ran: list[str] = []
    blocking = asyncio.ensure_future(runner.call(release.wait))
    await asyncio.sleep(0)  # it reaches the thread first
    queued = asyncio.ensure_future(runner.call(ran.append, "given up"))
    await asyncio.sleep(0)  # queued behind it
    queued.cancel()
    with pytest.raises(asyncio.CancelledError):
        await queued
    release.set()
    assert await blocking is True
    assert await runner.call(ran.append, "after") is None
    assert ran == ["after"], f"the call given up on before it began never ran; ran {ran}"
    runner.close()


async def test_a_call_records_its_threads_cpu_time_computing_not_waiting() -> None:
    """A model computing on the CPU uses its thread's CPU; one waiting for a device (a sleep) does not."""
    runner = BackendRunner("test")

    def compute(cpu_s: float) -> None:
        until = time.thread_time() + cpu_s
        while time.thread_time() < until:
            pass

    computing, waiting = Timing(), Timing()
    await runner.call(compute, 0.05, timing=computing)
    await runner.call(time.sleep, 0.2, timing=waiting)
    runner.close()
    assert computing.cpu_s is not None and computing.cpu_s >= 0.05
    assert waiting.cpu_s is not None and waiting.started is not None and waiting.ended is not None
    assert waiting.cpu_s < (waiting.ended - waiting.started) / 2, "a sleep is wall time, not CPU"


async def test_a_worker_whose_backend_hangs_gives_the_batch_back_and_stops() -> None:
    rig = Rig()
    await rig.listen()
    backend = ScriptedBackend(hang_on="stuck")
    worker = await rig.worker(backend, hang_min_s=0.3, expected_latency_ms=10.0)
    batch = rig.batch(["fine", "stuck"])
    await rig.create(batch)
    await rig.send(batch)
    await asyncio.wait_for(worker.failed.wait(), 10)
    assert worker.hung and isinstance(worker.failure, BackendHung)
    assert worker.batches_done == 0, "nothing stored, nothing committed"
    for task in ("t0", "t1"):
        state = await rig.store.get(task)
        assert state is not None and state.status is TaskStatus.RUNNING, f"{task} is handed back unfinished: {state}"
    suspects = await rig.deliveries.suspects(batch.batch_id, ["t0", "t1"], "next")
    assert suspects.note is not None and "hang limit" in suspects.note, "the next holder learns why"
    closing = time.monotonic()
    await worker.close()
    assert time.monotonic() - closing < 2, "closing must not wait for the stuck thread"
    assert worker.given_back == [batch], "the supervisor needs the batch to send it again (embedded mode)"
    assert not backend.closed, "a backend under a stuck call is not closed"
    backend.release.set()


async def test_a_batch_fetched_behind_a_hung_call_is_given_back_with_it() -> None:
    """b2 was taken off the bus while b1's call ran; b1 hangs, b2's call never starts. Both go
    back uncommitted, and both are named for a supervisor to send again (embedded mode)."""
    rig = Rig()
    backend = ScriptedBackend(hang_on="stuck")
    worker = await rig.worker(backend, expected_latency_ms=400, credit_lead_ms=300, hang_min_s=0.5)
    first, second = rig.batch(["stuck"], "b1", prefix="a"), rig.batch(["fine"], "b2", prefix="b")
    for batch in (first, second):
        await rig.create(batch)
        await rig.send(batch)
    await asyncio.wait_for(worker.failed.wait(), 10)
    assert not rig.bus.queues[0], "b2 was fetched while b1's call ran"
    await worker.close(drain_timeout_s=0)
    backend.release.set()
    assert worker.given_back == [first, second]
    assert rig.committed == [], "nothing committed"


async def test_a_task_queued_behind_a_hung_call_expires_at_its_deadline_and_its_call_runs_without_it() -> None:
    """b2 is admitted (``running``) and its call queued while b1's call hangs, well inside the hang
    limit: its item whose deadline comes first ends ``expired`` then, not once the worker gives up;
    when b1's call returns after all, b2's call runs its other item alone."""
    rig = Rig()
    await rig.listen()
    backend = ScriptedBackend(hang_on="stuck")
    worker = await rig.worker(backend, expected_latency_ms=400, credit_lead_ms=300, hang_min_s=60)
    first = rig.batch(["stuck"], "b1", prefix="a")
    now = now_ms()
    items = (BatchItem("b0", "soon", now, now + 3_000, "gw"), BatchItem("b1", "later", now, now + 60_000, "gw"))
    second = Batch("b2", "sim", "test", now, "idle_worker", None, items)
    seen: list[TaskState] = []
    async with rig.store.watch("b0") as changes:
        for batch in (first, second):
            await rig.create(batch)
            await rig.send(batch)
        async with asyncio.timeout(15):
            async for state in changes:
                seen.append(state)
                if state.status.terminal:
                    break
    assert [state.status for state in seen][-2:] == [TaskStatus.RUNNING, TaskStatus.EXPIRED], seen
    ended = seen[-1]
    assert ended.status is TaskStatus.EXPIRED and ended.error_code == "deadline_exceeded", ended
    assert now + 3_000 - 400 - 5 <= ended.updated_at_ms <= now + 3_000 + 5_000, (
        f"ended {ended.updated_at_ms - now} ms in: once a call could no longer end in time, near its deadline"
    )
    assert not worker.hung
    later = await rig.store.get("b1")
    assert later is not None and later.status is TaskStatus.RUNNING, f"b1 still waits for its call: {later}"
    backend.release.set()
    done = await rig.ended(["a0", "b1"])
    assert done["a0"].output == "kcuts" and done["b1"].output == "retal", done
    assert backend.calls == [["stuck"], ["later"]], "the expired item never reaches the backend"
    await eventually(lambda: rig.committed == [0, 1], "both batches committed")
    assert rig.replies["b0"] == [ended], "b0 answered once"
    await worker.close()


async def test_a_batch_whose_every_item_expired_behind_a_hung_call_keeps_its_place() -> None:
    """b2's only item expires while b1's call hangs: the worker still has a batch waiting for the
    thread, so it takes no other (b3 stays on the bus for a worker that can run it) until b1's call ends."""
    rig = Rig()
    await rig.listen()
    backend = ScriptedBackend(hang_on="stuck")
    worker = await rig.worker(backend, expected_latency_ms=400, credit_lead_ms=300, hang_min_s=60)
    now = now_ms()
    first = rig.batch(["stuck"], "b1", prefix="a")
    second = rig.batch(["soon"], "b2", deadline_ms=now + 2_000, prefix="b")
    third = rig.batch(["next"], "b3", prefix="c")
    for batch in (first, second, third):
        await rig.create(batch)
        await rig.send(batch)
    ended = (await rig.ended(["b0"], timeout_s=15))["b0"]
    assert ended.status is TaskStatus.EXPIRED, ended
    with pytest.raises(AssertionError, match="timed out"):
        await eventually(lambda: not rig.bus.queues[0], "b3 taken while b1's call hangs", timeout_s=1.0)
    waiting = await rig.store.get("c0")
    assert waiting is not None and waiting.status is TaskStatus.QUEUED, waiting
    backend.release.set()
    done = await rig.ended(["a0", "c0"])
    assert done["c0"].output == "txen", done
    assert backend.calls == [["stuck"], ["next"]], "the expired item never reaches the backend"
    await eventually(lambda: rig.committed == [0, 1, 2], "the three batches committed in order")
    await worker.close()


async def test_a_redelivered_task_admitted_behind_a_hung_call_expires_at_its_deadline() -> None:
    """b2 comes again (its last holder died) while b1's call hangs, well inside the hang limit: its
    item, admitted ``running`` to wait for the backend, ends ``expired`` at its deadline, as a first
    delivery's does, not once the worker gives up on b1's call."""
    rig = Rig()
    await rig.listen()
    backend = ScriptedBackend(hang_on="stuck")
    worker = await rig.worker(backend, expected_latency_ms=400, credit_lead_ms=300, hang_min_s=60)
    now = now_ms()
    first = rig.batch(["stuck"], "b1", prefix="a")
    second = rig.batch(["soon"], "b2", deadline_ms=now + 2_000, prefix="b")
    await rig.deliveries.begin("b2", "died")  # its first delivery, to a worker that died
    for batch in (first, second):
        await rig.create(batch)
        await rig.send(batch)
    ended = (await rig.ended(["b0"], timeout_s=15))["b0"]
    assert ended.status is TaskStatus.EXPIRED and ended.error_code == "deadline_exceeded", ended
    assert ended.updated_at_ms <= now + 2_000 + 5_000, f"ended {ended.updated_at_ms - now} ms in, near its deadline"
    assert not worker.hung
    backend.release.set()
    done = await rig.ended(["a0"])
    assert done["a0"].output == "kcuts", done
    assert backend.calls == [["stuck"]], "the expired item never reaches the backend"
    await eventually(lambda: rig.committed == [0, 1], "both batches committed in order")
    await worker.close()


async def test_a_batch_fetched_again_while_its_own_call_runs_here_is_answered_by_that_call() -> None:
    """A rebalance hands a kept partition back at its committed offset, so b1 comes again while its own
    call runs here, a call that ends past the point where a new one could end by the item's deadline.
    The call in flight answers the item: the second delivery neither ends it ``expired`` nor runs it again."""
    rig = Rig()
    await rig.listen()
    backend = ScriptedBackend(latency_s=2.5)
    worker = await rig.worker(backend, expected_latency_ms=400, credit_lead_ms=300, hang_min_s=60)
    batch = rig.batch(["slow"], "b1", deadline_ms=now_ms() + 2_000)
    await rig.create(batch)
    await rig.send(batch)
    await eventually(lambda: backend.calls == [["slow"]], "the first delivery's call runs")
    await rig.send(batch)  # fetched again, as after a rebalance
    ended = (await rig.ended(["t0"], timeout_s=15))["t0"]
    assert ended.status is TaskStatus.COMPLETED and ended.output == "wols", ended
    await eventually(lambda: rig.committed == [0, 1], "both deliveries committed in order")
    assert backend.calls == [["slow"]], "the item ran once"
    assert [state.status for state in rig.replies["t0"]] == [TaskStatus.COMPLETED], rig.replies["t0"]
    await worker.close()


class _SlowToStore(MemoryTaskStore):
    """Stores the results of the tasks named ``a...`` only after ``STORE_S``: a store that retries, or
    waits for its replicas."""

    STORE_S = 1.5

    async def apply(self, updates: Sequence[TaskState]) -> list[bool]:
        if any(state.status.terminal and state.task_id.startswith("a") for state in updates):
            await asyncio.sleep(self.STORE_S)  # the slow store's own latency
        return await super().apply(updates)


async def test_a_redelivered_item_that_the_wait_for_stored_results_made_late_ends_expired_unrun() -> None:
    """b1 comes again (its last holder died) while b0's results are being stored, slowly: it runs once
    they are, and by then its item's call could no longer end by its deadline. It ends ``expired``, unrun."""
    rig = Rig(store=_SlowToStore())
    await rig.listen()
    backend = ScriptedBackend()
    worker = await rig.worker(backend, expected_latency_ms=400, credit_lead_ms=300, hang_min_s=60)
    first = rig.batch(["first"], "b0", prefix="a")
    second = rig.batch(["late"], "b1", deadline_ms=now_ms() + 1_000, prefix="b")
    await rig.deliveries.begin("b1", "died")  # its first delivery, to a worker that died
    for batch in (first, second):
        await rig.create(batch)
        await rig.send(batch)
    ended = (await rig.ended(["b0"], timeout_s=15))["b0"]
    assert ended.status is TaskStatus.EXPIRED and ended.error_code == "deadline_exceeded", ended
    assert backend.calls == [["first"]], "the late item never reaches the backend"
    await eventually(lambda: rig.committed == [0, 1], "both batches committed in order")
    await worker.close()


async def test_a_hung_calls_items_past_their_deadline_end_expired_before_the_worker_stops() -> None:
    """The worker gives up on a hung call: its item whose deadline has passed ends ``expired`` then,
    not when another worker takes the batch (there may be none); the item still in time goes back
    ``running`` with the batch, for its next holder to run with care."""
    rig = Rig()
    await rig.listen()
    backend = ScriptedBackend(hang_on="stuck")
    worker = await rig.worker(backend, hang_min_s=1.0, expected_latency_ms=10.0)
    expired_before = tasks_ended("expired")
    now = now_ms()
    items = (BatchItem("t0", "stuck soon", now, now + 500, "gw"), BatchItem("t1", "later", now, now + 60_000, "gw"))
    batch = Batch("b1", "sim", "test", now, "idle_worker", None, items)
    await rig.create(batch)
    await rig.send(batch)
    await asyncio.wait_for(worker.failed.wait(), 10)
    ended = await rig.store.get("t0")
    assert ended is not None and ended.status is TaskStatus.EXPIRED, f"t0 is past its deadline: {ended}"
    assert ended.error_code == "deadline_exceeded" and "hung" in (ended.error_message or ""), ended
    assert rig.replies.get("t0") == [ended], "its caller is answered once"
    kept = await rig.store.get("t1")
    assert kept is not None and kept.status is TaskStatus.RUNNING, f"t1 goes back with the batch: {kept}"
    suspects = await rig.deliveries.suspects(batch.batch_id, ["t0", "t1"], "next")
    assert suspects.note is not None and "hang limit" in suspects.note, "the next holder learns why"
    assert tasks_ended("expired") - expired_before == 1, (
        "t0's end is counted by the worker that wrote it, next holder or none"
    )
    await worker.close()
    assert worker.given_back == [batch]
    backend.release.set()
    await rig.worker(ScriptedBackend(), expected_latency_ms=10.0)
    await rig.send(batch)  # its next holder
    done = await rig.ended(["t1"])
    assert done["t1"].output == "retal", done
    assert tasks_ended("expired") - expired_before == 1, "t0's end is counted once, by the worker whose write ended it"
