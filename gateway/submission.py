"""One accepted request on its way through the gateway: what publishing it and answering its caller need."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

from gateway.unseen import Ticket
from schemas.records import Priority


@dataclass(frozen=True, slots=True)
class Submission:
    """A request as ``Gateway.submit`` validated and admitted it, under the task id it was given."""

    task_id: str
    input: str
    model: str
    timeout_ms: int
    deadline: float
    """When its caller stops waiting, on the event loop's clock."""
    started: float
    """When the submit began, on the gateway's ``Clock.monotonic`` (for the answer's latency)."""
    owner: str | None
    tier: Priority = Priority.NORMAL
    """The tier it runs at (a collapsed caller that joins a computation runs at that one's, never a lower one)."""
    ticket: Ticket | None = None
    """Its place among the requests admission counts until the queue's counters show them."""

    def deadline_ms(self, now_ms: int) -> int:
        """Its ``deadline`` on the wall clock at ``now_ms``, as its task's records carry it: what the
        submit has spent of ``timeout_ms`` (admission's waits) is gone."""
        left_ms = math.ceil((self.deadline - asyncio.get_running_loop().time()) * 1000)
        return now_ms + max(0, min(self.timeout_ms, left_ms))
