"""Keeps busy workers' calls spread evenly over a call's duration: pure code, times in seconds.

Under load, a request waits for the next batch to be sealed and then for its call. With k busy
workers that start their calls L/k apart, the next seal is at most L/k away. Work conservation
alone leaves the starts wherever they fell (two workers idle at once both start at once, and every
call then lasts the same L), and two workers that start together split the queue badly: the first
batch takes up to ``max_batch`` of everything that waited a whole call, the second the few that came
after, and a request may wait up to L for a seal instead of L/k (``docs/performance.md``).

Nothing pulls the starts apart again on its own, so the batcher does: when a busy worker's next
call would start less than L/k after another busy worker's, its batch is sealed late enough that it
starts L/k after. That worker idles for the difference once; the starts stay spread from then on.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class _Start:
    at_s: float
    call_s: float


class Spacing:
    """The last call start of each worker of one model, and where the next one should fall."""

    def __init__(self, tolerance: float = 0.2, similar: float = 0.25) -> None:
        self.tolerance = tolerance
        """Starts closer than the even spacing by at most this fraction of it are left alone."""
        self.similar = similar
        """Only workers whose calls take within this fraction of each other's are spaced together: a
        slow worker's phase says nothing about a fast one's (and holding it would waste its GPU)."""
        self._starts: dict[str, _Start] = {}

    def due_s(self, worker: str, start_s: float, call_s: float) -> float:
        """When ``worker``'s next call should start, given the soonest it can (``start_s``).

        Later than ``start_s`` only when that start falls less than L/k after another busy worker's
        (one whose last call started within 1.5 calls, so it is still taking batches back to back).
        """
        if call_s <= 0:
            return start_s
        others = [
            s.at_s
            for w, s in self._starts.items()
            if w != worker and start_s - 1.5 * call_s < s.at_s and abs(s.call_s - call_s) <= self.similar * call_s
        ]
        if not others:
            return start_s
        even_s = call_s / (len(others) + 1)
        behind_s = min((start_s - at_s) % call_s for at_s in others)
        short_s = even_s - behind_s
        return start_s + short_s if short_s > self.tolerance * even_s else start_s

    def started(self, worker: str, at_s: float, call_s: float) -> None:
        """Records that ``worker``'s call starts at ``at_s`` (its batch was just sent)."""
        self._starts[worker] = _Start(at_s, call_s)
        if len(self._starts) > 16:  # forget workers gone quiet (left, died, or idle for long)
            self._starts = {w: s for w, s in self._starts.items() if at_s - s.at_s < 3 * max(s.call_s, call_s)}
