"""What the batcher does with a credit it claimed, pure code: send at once, hold the idle worker in
reserve, or seal a busy worker's batch later to keep the calls spread. Times in seconds on the
caller's clock.

``batcher.dispatch`` asks it after every claim, over asyncio, the credit pool and the bus;
``batchwire.capacity.engine`` asks the same object on its virtual clock, so the simulation decides
as the service does. It weighs the two named options of the dispatch loop: the reserve hold
(``--reserve-ms``, ``BatchFormer.reserve_s``) and spacing (``--spacing-margin-ms``, ``Spacing``).

Spacing keeps busy workers' calls spread evenly over a call's duration. Under load, a request waits
for the next batch to be sealed and then for its call. With k busy workers that start their calls
L/k apart, the next seal is at most L/k away. Work conservation alone leaves the starts wherever
they fell (two workers idle at once both start at once, and every call then lasts the same L), and
two workers that start together split the queue badly: the first batch takes up to ``max_batch`` of
everything that waited a whole call, the second the few that came after, and a request may wait up
to L for a seal instead of L/k (``docs/performance.md``). Nothing pulls the starts apart again on its
own, so the batcher does: when a busy worker's next call would start less than L/k after another
busy worker's, its batch is sealed late enough that it starts L/k after. That worker idles for the
difference once; the starts stay spread from then on.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Generic

from batcher.policy import BatchFormer, Item


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


@dataclass(frozen=True, slots=True)
class Claimed:
    """A claimed credit, as the decision needs it."""

    worker: str
    free_s: float
    """When its worker became (or becomes) idle."""
    call_s: float
    """The worker's expected call (its credit's ``busy_ms``)."""


class Action(Enum):
    SEND = "send"
    HOLD = "hold"
    """Keep the idle worker until ``until_s``: a fresh arrival, or another worker freeing first, ends it."""
    SPACE = "space"
    """Seal the busy worker's batch at ``until_s``: a batch that fills up, or a deadline, ends it sooner."""


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    until_s: float = 0.0


SEND = Decision(Action.SEND)


class Scheduler(Generic[Item]):
    """Decides, per claimed credit, over one batcher's ``BatchFormer`` and its workers' call starts."""

    def __init__(self, former: BatchFormer[Item], clock: Callable[[], float], spacing_margin_s: float | None) -> None:
        self.former = former
        self._clock = clock
        self._margin_s = spacing_margin_s
        """None: no spacing."""
        self._spacing: defaultdict[str, Spacing] = defaultdict(Spacing)

    def decide(self, model: str, claimed: Claimed, claimed_from_s: float, *, alone: bool) -> Decision:
        """What to do with ``claimed``, claimed for ``model`` since ``claimed_from_s``. ``alone``: this
        batcher is the only one sending to the model's workers (spacing needs to know every start)."""
        now = self._clock()
        hold_s = self.former.reserve_s(model, claimed.call_s, claimed_from_s, claimed.free_s)
        if hold_s > 0:
            return Decision(Action.HOLD, now + hold_s)
        if self._margin_s is None or not alone or claimed.free_s <= now or self.former.sealed(model):
            return SEND  # an idle worker is never kept waiting, nor a batch that is already sealed
        due_s = self._spacing[model].due_s(claimed.worker, claimed.free_s, claimed.call_s)
        until_s = due_s - self._margin_s
        if due_s <= claimed.free_s or until_s <= now:
            return SEND
        return Decision(Action.SPACE, until_s)

    def sent(self, model: str, claimed: Claimed) -> None:
        """A batch went against ``claimed``: its call starts when its worker is free."""
        self._spacing[model].started(claimed.worker, max(self._clock(), claimed.free_s), claimed.call_s)
