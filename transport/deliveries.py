"""How often each batch was delivered, and what was in flight when a worker died: poison detection.

A batch that comes back uncommitted was in the hands of a worker that died (crash, hung backend,
kill) or handed it back. The worker that gets it next asks the ``DeliveryLog`` which inputs were in
flight at that death (*suspects*) and how many deaths each has been part of (*strikes*), and runs
the suspects in smaller groups, marking each group before it runs it; an input that was in flight
alone at ``max_deliveries`` deaths goes to the dead-letter topic instead (see ``gpu_worker.careful``).
A worker that hands a batch back alive (a stop or a revocation whose drain ran out) records it
(``hand_back``): that is no death, and its inputs get no strike for it.

Two small Protocols with their in-memory twins here (embedded mode, unit tests); the Redis log is
``transport.redis.deliveries.RedisDeliveryLog``, the Kafka dead-letter producer
``transport.kafka.producers.KafkaDeadLetterProducer``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from schemas.deadletter import DeadLetter


@dataclass(frozen=True, slots=True)
class Suspects:
    """What the previous holder of a batch left behind when it died."""

    task_ids: frozenset[str]
    """Tasks in flight at that death (all of the given ones when it left no mark)."""
    strikes: Mapping[str, int]
    """Per suspect, the worker deaths it was in flight for, this one included."""
    marked: bool
    """Whether the previous holder marked what was in flight; False: it died before marking."""
    note: str | None = None
    """Why the previous holder gave up, when it could say (a hung backend)."""
    call_s: float | None = None
    """The call time the previous holder expected when it gave up (a hung backend), if it had one: a
    holder that has timed no call of its own starts from it (``BackendRunner.start_from``)."""
    handed_back: bool = False
    """The previous holder handed the batch back alive (``DeliveryLog.hand_back``): no suspects, no strikes."""


class DeliveryLog(Protocol):
    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def begin(self, batch_id: str, receipt: str) -> int:
        """Counts one more delivery of the batch; returns its number (1: the first).

        ``receipt`` names this worker's receipt of the delivery: called again with it (a retry after a
        reply lost once the count was written), it counts nothing and returns the same number.
        """
        ...

    async def suspects(self, batch_id: str, task_ids: Sequence[str], receipt: str) -> Suspects:
        """Reads and clears the in-flight mark, and strikes each marked task among ``task_ids`` once.

        Without a mark every one of ``task_ids`` is a suspect (the first delivery runs unmarked);
        after a recorded hand-back (``hand_back``) none is. Called again with the same ``receipt``
        (as ``begin``), it strikes nothing and answers as before.
        """
        ...

    async def mark(self, batch_id: str, task_ids: Sequence[str]) -> None:
        """Records that these tasks are in flight now (before the backend call that runs them); undoes a
        hand-back recorded before."""
        ...

    async def note(self, batch_id: str, text: str, call_s: float | None = None) -> None:
        """Tells the next holder why this one gave up (a hang: a death), and the call time it expected
        (``Suspects.call_s``); undoes a hand-back recorded before."""
        ...

    async def hand_back(self, batch_id: str, receipt: str) -> bool:
        """Records that the holder of ``receipt`` gives the batch back alive (its drain on a stop or a
        revocation ran out): the next ``suspects`` names no suspect and strikes nothing. Returns whether
        it recorded it: not when ``receipt`` is not the latest delivery, nor when it is a redelivery
        whose ``suspects`` it has not read (the death before it still counts). A hand-back that could
        not be recorded (Redis unreachable) counts as a death, as a crash does."""
        ...

    async def finish(self, batch_id: str) -> None:
        """Forgets the batch: it is committed and will not come back."""
        ...


class DeadLetterSink(Protocol):
    """Where dead-lettered inputs go (``names.dead_letter_topic`` over Kafka)."""

    where: str
    """Where a dead-lettered task's message says its input went, for the operator who looks for it."""

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def send(self, letter: DeadLetter) -> None:
        """Returns once the letter is durably stored."""
        ...


@dataclass(slots=True)
class _Record:
    deliveries: int = 0
    inflight: tuple[str, ...] | None = None
    note: str | None = None
    call_s: float | None = None
    handed_back: bool = False
    strikes: dict[str, int] = field(default_factory=dict)
    counted: dict[str, int] = field(default_factory=dict)
    """Per receipt, the delivery number ``begin`` gave it."""
    answered: dict[str, Suspects] = field(default_factory=dict)
    """Per receipt, what ``suspects`` answered it."""
    expires_s: float = 0.0


class MemoryDeliveryLog:
    """``DeliveryLog`` in a dict: for embedded mode (a hung worker is replaced in process) and tests."""

    def __init__(self, ttl_s: float = 3600.0) -> None:
        self.ttl_s = ttl_s
        self._records: dict[str, _Record] = {}

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def _get(self, batch_id: str) -> _Record:
        now = time.monotonic()
        record = self._records.get(batch_id)
        if record is None or record.expires_s <= now:
            for stale in [key for key, value in self._records.items() if value.expires_s <= now]:
                del self._records[stale]
            record = self._records[batch_id] = _Record()
        record.expires_s = now + self.ttl_s
        return record

    async def begin(self, batch_id: str, receipt: str) -> int:
        record = self._get(batch_id)
        if receipt not in record.counted:
            record.deliveries += 1
            record.counted[receipt] = record.deliveries
        return record.counted[receipt]

    async def suspects(self, batch_id: str, task_ids: Sequence[str], receipt: str) -> Suspects:
        record = self._get(batch_id)
        answer = record.answered.get(receipt)
        if answer is not None:
            return answer
        inflight, record.inflight = record.inflight, None
        note, record.note = record.note, None
        call_s, record.call_s = record.call_s, None
        handed_back, record.handed_back = record.handed_back, False
        given = set(task_ids)
        suspects = set() if handed_back else given if inflight is None else given.intersection(inflight)
        for task_id in suspects:
            record.strikes[task_id] = record.strikes.get(task_id, 0) + 1
        answer = record.answered[receipt] = Suspects(
            frozenset(suspects),
            {t: record.strikes[t] for t in suspects},
            marked=inflight is not None,
            note=note,
            call_s=call_s,
            handed_back=handed_back,
        )
        return answer

    async def mark(self, batch_id: str, task_ids: Sequence[str]) -> None:
        record = self._get(batch_id)
        record.inflight, record.handed_back = tuple(task_ids), False

    async def note(self, batch_id: str, text: str, call_s: float | None = None) -> None:
        record = self._get(batch_id)
        record.note, record.call_s, record.handed_back = text, call_s, False

    async def hand_back(self, batch_id: str, receipt: str) -> bool:
        record = self._get(batch_id)
        delivery = record.counted.get(receipt)
        if delivery is None or delivery != record.deliveries or (delivery > 1 and receipt not in record.answered):
            return False
        record.handed_back = True
        return True

    async def finish(self, batch_id: str) -> None:
        self._records.pop(batch_id, None)


class MemoryDeadLetters:
    """``DeadLetterSink`` as a list of the latest ``KEEP`` (embedded mode keeps no other copy; tests read
    them): a client that keeps sending inputs that kill the worker does not grow the process for ever."""

    KEEP = 1000

    where = "in this process's memory (embedded mode keeps no other copy; the worker's log names the task)"

    def __init__(self) -> None:
        self.letters: list[DeadLetter] = []

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def send(self, letter: DeadLetter) -> None:
        self.letters.append(letter)
        if len(self.letters) > self.KEEP:
            del self.letters[0]
