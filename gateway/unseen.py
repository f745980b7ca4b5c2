"""Requests this gateway admitted that its model's queue counters may not show yet.

Admission holds each request against the queue ahead of it, read from counters that lag behind the
gateway: over Kafka they are offsets read every ``refresh_s``, and a request is in them only once
its produce landed before the read began. Under a burst, produces wait behind each other for longer
than a refresh, so a request counts as *unseen* from its admission until it was sent before a read
of the counters began. One never sent (a cached answer, a failed publish) stops counting when its
submit ends, and one that waits for another's request (a collapsed caller, a retry of a key in
flight) when its wait begins. A burst is then held against all of itself, not against the last
read alone, which does not yet hold the requests still on their way to the bus.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

FORGET_AFTER_S = 5.0
"""Sent requests older than this are dropped even when no read came since: counters as old as that
are stale and not used (``transport.kafka.lag``)."""


class Unseen:
    """One model's admitted requests that the latest read of its counters may not hold."""

    def __init__(self, clock: Callable[[], float]) -> None:
        """``clock``: the monotonic clock that stamps the counters' reads (``Backlog.at_s``)."""
        self._clock = clock
        self._unsent = 0
        self._sent: deque[float] = deque()

    def admitted(self) -> Ticket:
        self._unsent += 1
        return Ticket(self)

    def count(self, read_at_s: float) -> int:
        """How many admitted requests a read of the counters begun at ``read_at_s`` may not hold."""
        sent = self._sent
        while sent and sent[0] < read_at_s:
            sent.popleft()
        return self._unsent + len(sent)

    def _landed(self, pending: bool) -> None:
        if pending:
            self._unsent -= 1
        now = self._clock()
        sent = self._sent
        while sent and sent[0] < now - FORGET_AFTER_S:
            sent.popleft()
        sent.append(now)

    def _dropped(self) -> None:
        self._unsent -= 1


class Ticket:
    """One admitted request's place among its model's unseen ones: ``sent`` once its publish
    landed on the bus, ``close`` when its submit ends (a no-op after ``sent``)."""

    __slots__ = ("_pending", "_unseen")

    def __init__(self, unseen: Unseen) -> None:
        self._unseen = unseen
        self._pending = True

    def sent(self) -> None:
        """Its request is on the bus: it counts until a read begun after now."""
        self._unseen._landed(self._pending)
        self._pending = False

    def close(self) -> None:
        """Its submit ended: unless it was sent, it adds nothing to the queue."""
        if self._pending:
            self._pending = False
            self._unseen._dropped()
