"""A ``QueueDepth`` for tests that drive admission: the test sets each model's backlog."""

from __future__ import annotations

from gateway.admission.gate import ANONYMOUS, Admission, Caller
from schemas.records import Priority
from transport.ports import Backlog


class Counters:
    """A ``QueueDepth`` whose counters the test sets; ``clock`` is the time of the latest read."""

    def __init__(self) -> None:
        self.backlogs: dict[str, Backlog] = {}

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def depth(self) -> int:
        return sum(b.depth for b in self.backlogs.values())

    def backlog(self, model: str) -> Backlog | None:
        return self.backlogs.get(model)

    def clock(self) -> float:
        return max((b.at_s for b in self.backlogs.values()), default=0.0)


async def admit_sent(
    admission: Admission, model: str, timeout_ms: int, tier: Priority = Priority.NORMAL, caller: Caller = ANONYMOUS
) -> None:
    """Admits one request that the bus takes at once, as the gateway does: it counts as queued until
    the next read of the counters (raises what ``admit`` raises)."""
    ticket = await admission.admit(caller, model, timeout_ms, tier)
    if ticket is not None:
        ticket.sent()
        ticket.close()
