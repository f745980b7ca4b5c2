"""A ``QueueDepth`` for tests that drive admission: the test sets each model's backlog."""

from __future__ import annotations

from transport.ports import Backlog


class Counters:
    """A ``QueueDepth`` whose counters the test sets."""

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
