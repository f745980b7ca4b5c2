"""Busy workers' calls are kept evenly spread: the pure rule (``Spacing``), and the batcher that seals
late for it (only for a busy worker's early credit, only when it alone serves the model)."""

from __future__ import annotations

import time

import pytest

from batcher.scheduler import Spacing
from batcher.service import Batcher
from batcher.settings import BatcherSettings
from schemas.records import Credit
from tests.support.eventually import eventually
from tests.support.sim_records import PARTITIONS, request
from transport.memory.batches import MemoryBatchBus
from transport.memory.credits import MemoryCreditPool
from transport.memory.requests import MemoryRequestBus
from transport.memory.store import MemoryTaskStore
from transport.routing import Partitioner

L = 0.1


def test_a_worker_starting_with_another_is_moved_half_a_call_later() -> None:
    spacing = Spacing()
    spacing.started("w1", 10.0, L)
    assert spacing.due_s("w2", 10.002, L) == pytest.approx(10.05)


def test_a_worker_already_about_evenly_spaced_starts_when_it_can() -> None:
    spacing = Spacing()
    spacing.started("w1", 10.0, L)
    assert spacing.due_s("w2", 10.045, L) == 10.045, "within the tolerance (20 % of L/2)"
    assert spacing.due_s("w2", 10.08, L) == 10.08, "more than L/2 behind: never held"


def test_its_own_last_start_does_not_count() -> None:
    spacing = Spacing()
    spacing.started("w1", 10.0, L)
    assert spacing.due_s("w1", 10.1, L) == 10.1


def test_three_workers_are_spread_a_third_of_a_call_apart() -> None:
    spacing = Spacing()
    spacing.started("w1", 10.0, L)
    spacing.started("w2", 10.034, L)
    assert spacing.due_s("w3", 10.04, L) == pytest.approx(10.034 + L / 3)


def test_a_worker_gone_quiet_or_much_slower_is_ignored() -> None:
    spacing = Spacing()
    spacing.started("idle", 10.0, L)
    assert spacing.due_s("w2", 10.0 + 1.6 * L + 0.001, L) == pytest.approx(10.0 + 1.6 * L + 0.001)
    spacing.started("slow", 20.0, 5 * L)
    assert spacing.due_s("w2", 20.001, L) == 20.001, "a slow worker's phase says nothing about a fast one's"


# the batcher ------------------------------------------------------------------------------------
CALL_MS = 1000  # long, so that the bounds below leave room for a slow machine


def credit(worker: str, frees_in_ms: int) -> Credit:
    now = int(time.time() * 1000)
    return Credit(worker, "sim", 1, 1, now, now + 60_000, max_batch=100, busy_ms=CALL_MS, free_at_ms=now + frees_in_ms)


async def second_batch_after_s(spacing_margin_ms: float, then_send: int = 1) -> float:
    """w1 (idle) takes a batch; then w2, busy for 250 ms more (a slow machine still claims its credit
    before then), offers an early credit: how long after w1's batch does w2's go out?"""
    pool = MemoryCreditPool()
    bus = MemoryRequestBus(Partitioner(("sim",), PARTITIONS))
    settings = BatcherSettings(models=("sim",), request_partitions=PARTITIONS, spacing_margin_ms=spacing_margin_ms)
    batcher = Batcher(settings, bus.consumer(), MemoryBatchBus(2), pool, MemoryTaskStore())
    await batcher.start()
    try:
        await bus.producer().send(request("first"))
        await pool.offer(credit("w1", 0))
        await eventually(lambda: batcher.batches_sent == 1, "w1's batch", timeout_s=5)
        first_at = time.monotonic()
        await pool.offer(credit("w2", 250))
        for n in range(then_send):
            await bus.producer().send(request(f"next-{n}"))
        await eventually(lambda: batcher.batches_sent == 2, "w2's batch", timeout_s=5)
        return time.monotonic() - first_at
    finally:
        await batcher.close()


async def test_a_busy_workers_batch_is_sealed_to_start_half_a_call_after_the_other() -> None:
    after_s = await second_batch_after_s(spacing_margin_ms=5)
    # w2 could start 250 ms after w1, is due half a call (500 ms) after it, and is sealed 5 ms before
    assert after_s >= 0.4, f"w2's batch went {after_s * 1000:.0f} ms after w1's, not about 495 ms"


async def test_without_spacing_it_goes_at_once() -> None:
    after_s = await second_batch_after_s(spacing_margin_ms=-1)
    assert after_s < 0.4, f"w2's batch went {after_s * 1000:.0f} ms after w1's"


async def test_a_batch_that_fills_up_while_held_goes_at_once() -> None:
    after_s = await second_batch_after_s(spacing_margin_ms=5, then_send=100)
    assert after_s < 0.4, f"the full batch went {after_s * 1000:.0f} ms after w1's"
