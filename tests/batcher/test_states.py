"""The states the batcher writes carry what a gateway needs to read them alone."""

from __future__ import annotations

from batcher import states
from schemas.records import Batch, BatchItem, TaskStatus


def test_a_batched_state_carries_its_deadline_and_a_synchronous_item_has_none_written() -> None:
    """A task waits ``batched`` for a worker that may never come: its deadline travels with the state,
    so a gateway that reads it late ends it (``gateway.answers.reads``)."""
    items = (BatchItem("t0", "a", 1_000, 5_000, None), BatchItem("t1", "b", 1_000, 6_000, "gw"))
    batch = Batch("b1", "sim", "batcher-1", 2_000, "size", credit="w1:0", items=items)
    written = states.batched("sim", batch, 2_000)
    assert [(s.task_id, s.status, s.deadline_ms) for s in written] == [("t0", TaskStatus.BATCHED, 5_000)]
