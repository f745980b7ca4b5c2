"""What the batcher does with a credit it claimed, pure code: send at once, hold the idle worker in
reserve, or seal a busy worker's batch later to keep the calls spread. Times in seconds on the
caller's clock.

``batcher.dispatch`` asks it after every claim, over asyncio, the credit pool and the bus;
``batchwire.capacity.engine`` asks the same object on its virtual clock, so the simulation decides
as the service does. It weighs the two named options of the dispatch loop: the reserve hold
(``--reserve-ms``, ``BatchFormer.reserve_s``) and spacing (``--spacing-margin-ms``,
``batcher.spacing``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Generic

from batcher.policy import BatchFormer, Item
from batcher.spacing import Spacing


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
