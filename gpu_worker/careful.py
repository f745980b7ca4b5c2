"""How a redelivered batch runs: suspects in halves, the others together, the proven culprit set aside.

A batch delivered again was in the hands of a worker that died (or handed it back). The plan is
pure: from the inputs still to run and what the ``DeliveryLog`` says was in flight at the death,
it returns the groups to run (each marked in flight before it runs, so the next death narrows the
suspects by half: a crash bisection across deliveries) and the inputs to dead-letter: one that was
in flight *alone* when a worker died, and has been in flight at ``max_deliveries`` deaths in all.
The suspects' halves run first. The others were not in flight at the last death, but that clears
none of them: after a death with no mark (every input struck) only one half of the suspects ran,
and the other may hold a crashing input too. Run first and killing the worker, they would be the
next suspects and the first half the others, run whole again: two crashing inputs would take turns
killing workers until every deadline passed, and no group would ever shrink.
Healthy inputs of the batch still get their answers; a random kill -9 never dead-letters anything
unless the same input was in flight at ``max_deliveries`` deaths. A batch its last holder recorded
handing back alive has no suspects: it runs in one group, and no input is struck.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from schemas.deadletter import DeadLetter, DeadLetterItem
from schemas.records import Batch, BatchItem
from transport.deliveries import Suspects

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class CarefulPlan(Generic[T]):
    groups: list[list[T]] = field(default_factory=list)
    """Run in this order, one backend call (with exception bisection) each, marked before it runs."""
    dead: list[T] = field(default_factory=list)
    """Set aside: dead-letter topic, and ``failed`` with ``dead_lettered``."""


def plan(items: Sequence[T], task_id: Callable[[T], str], suspects: Suspects, max_deliveries: int) -> CarefulPlan[T]:
    """``suspects``: read for every task of the batch, so that an input whose partners at the death
    have ended since (cancelled, expired) is not taken for one that was in flight alone."""
    others = [item for item in items if task_id(item) not in suspects.task_ids]
    suspected = [item for item in items if task_id(item) in suspects.task_ids]
    alone = len(suspected) == 1 and len(suspects.task_ids) == 1
    if alone and suspects.strikes.get(task_id(suspected[0]), 0) >= max_deliveries:
        return CarefulPlan([others] if others else [], suspected)
    groups: list[list[T]] = []
    if len(suspected) > 1:
        middle = len(suspected) // 2
        groups.extend([suspected[:middle], suspected[middle:]])
    elif suspected:
        groups.append(suspected)
    if others:
        groups.append(others)
    return CarefulPlan(groups, [])


def dead_letter(
    batch: Batch, items: Sequence[BatchItem], suspects: Suspects, count: int, worker_id: str, now_ms: int
) -> DeadLetter:
    """The record for ``items`` set aside from ``batch`` on its ``count``-th delivery."""
    strikes = {item.task_id: suspects.strikes.get(item.task_id, 0) for item in items}
    why = suspects.note or "the worker process died (crash, kill or out of memory)"
    return DeadLetter(
        batch_id=batch.batch_id,
        model=batch.model,
        batcher_id=batch.batcher_id,
        worker_id=worker_id,
        deliveries=count,
        error=f"in flight at {max(strikes.values())} worker deaths, the last time alone; last: {why}",
        dead_lettered_at_ms=now_ms,
        items=tuple(
            DeadLetterItem(i.task_id, i.input, i.enqueued_at_ms, strikes[i.task_id], i.reply_to) for i in items
        ),
    )


def dead_lettered_message(letter: DeadLetter, where: str) -> str:
    """What the caller of a dead-lettered task reads (its error message); ``where`` the letter went."""
    deaths = max(item.strikes for item in letter.items)
    return (
        f"the model's worker died {deaths} times while running this input, the last time with nothing else in "
        f"flight ({letter.error}); it was set aside {where} (batch {letter.batch_id}): check the input, or send "
        "another"
    )


def ordinal(n: int) -> str:
    """``n``th delivery, as a log line names it."""
    return {1: "1st", 2: "2nd", 3: "3rd"}.get(n, f"{n}th")
