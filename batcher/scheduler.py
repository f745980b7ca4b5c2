"""What the batcher does with a credit it claimed, pure code: send at once, hold the idle worker in
reserve, or seal a busy worker's batch later to keep the calls spread. Times in seconds on the
caller's clock.

``Scheduler.decide`` weighs the two named options of the dispatch loop: the reserve hold
(``--reserve-ms``, ``BatchFormer.reserve_s``) and spacing (``--spacing-margin-ms``, ``Spacing``).
``DispatchLoop`` is where one model's dispatch loop stands: the driver reports what happened (a
request arrived or a timer sealed a batch, a credit was claimed, a second credit came during a hold,
a wait ran out) and each call returns the next command (claim, hold, space, send, or wait for news).
``batcher.dispatch`` drives it over asyncio, the credit pool and the bus; ``batchwire.capacity.engine``
drives the same object on its virtual clock, so the simulation decides as the service does.

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
from typing import Any, Generic, TypeAlias, TypeVar

from batcher.policy import BatchFormer, Item

C = TypeVar("C")
"""A driver's credit: the dispatcher's ``Credit``, the simulation's tuple."""


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
        self.clock = clock
        self._margin_s = spacing_margin_s
        """None: no spacing."""
        self._spacing: defaultdict[str, Spacing] = defaultdict(Spacing)

    def decide(self, model: str, claimed: Claimed, claimed_from_s: float, *, alone: bool) -> Decision:
        """What to do with ``claimed``, claimed for ``model`` since ``claimed_from_s``. ``alone``: this
        batcher is the only one sending to the model's workers (spacing needs to know every start)."""
        now = self.clock()
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
        self._spacing[model].started(claimed.worker, max(self.clock(), claimed.free_s), claimed.call_s)


# one model's dispatch loop ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Idle:
    """Nothing to send: wait until a request arrives or a timer seals a batch (``poke``)."""


@dataclass(frozen=True, slots=True)
class Claim:
    """Claim a credit for the model; report it with ``claimed`` (or ``unclaimed``)."""


@dataclass(frozen=True, slots=True)
class Hold:
    """Keep the claimed idle worker until ``until_s`` and meanwhile claim a second credit: ``poke`` on
    a fresh arrival, ``second`` when another worker frees first, ``woke`` when the time is up."""

    until_s: float


@dataclass(frozen=True, slots=True)
class Space:
    """Seal the busy worker's batch at ``until_s``: ``poke`` when something may have sealed it sooner,
    ``woke`` when the time is up."""

    until_s: float


@dataclass(frozen=True, slots=True)
class Send(Generic[C]):
    """Send the model's batch against ``credit`` (offer ``back`` back, unused), then report ``sent``
    and ``poke``."""

    credit: C
    back: C | None = None


Command: TypeAlias = Idle | Claim | Hold | Space | Send[C]
IDLE, CLAIM = Idle(), Claim()


class _Stage(Enum):
    IDLE = "idle"
    CLAIMING = "claiming"
    HOLDING = "holding"
    SPACING = "spacing"
    SENDING = "sending"


class DispatchLoop(Generic[C]):
    """Where one model's dispatch loop stands, without I/O: a claim starts only while a batch is ready,
    and each claimed credit gets exactly one ``Send`` (or goes ``back``)."""

    def __init__(self, scheduler: Scheduler[Any], model: str) -> None:
        self._scheduler = scheduler
        self._former = scheduler.former
        self._model = model
        self._clock = scheduler.clock
        self._stage = _Stage.IDLE
        self._credit: C | None = None
        self._worker: str | None = None
        """The worker of ``_credit``."""
        self._wait: Hold | Space | None = None
        self.since_s = 0.0
        """When the claim (or the hold's second claim) began: the simulation serves waiting claims in
        this order, as the credit pools do."""

    @property
    def claiming(self) -> bool:
        """Whether a credit given now would be taken: a claim, or a hold's second claim, waits."""
        return self._stage in (_Stage.CLAIMING, _Stage.HOLDING)

    @property
    def holding(self) -> bool:
        return self._stage is _Stage.HOLDING

    def poke(self) -> Command[C]:
        """A request arrived or a timer sealed a batch: it may be time to claim, or to end a wait."""
        stage = self._stage
        if stage is _Stage.IDLE:
            if not self._former.ready(self._model):
                return IDLE
            self._stage, self.since_s = _Stage.CLAIMING, self._clock()
            return CLAIM
        if stage is _Stage.CLAIMING:
            if self._former.ready(self._model):
                return CLAIM
            self._stage = _Stage.IDLE  # what it waited for expired (a driver whose claim can stop)
            return IDLE
        if stage is _Stage.HOLDING or (stage is _Stage.SPACING and self._former.sealed(self._model)):
            return self._send()
        assert self._wait is not None, f"poked while {stage.value}"
        return self._wait  # spacing: not sealed yet

    def claimed(self, credit: C, claimed: Claimed, *, alone: bool) -> Command[C]:
        """The claim returned ``credit``; ``alone``: this batcher alone sends to the model's workers."""
        assert self._stage is _Stage.CLAIMING, self._stage
        self._credit, self._worker = credit, claimed.worker
        decision = self._scheduler.decide(self._model, claimed, self.since_s, alone=alone)
        if decision.action is Action.HOLD:
            self._stage, self.since_s = _Stage.HOLDING, self._clock()
            self._wait = Hold(decision.until_s)
        elif decision.action is Action.SPACE:
            self._stage, self._wait = _Stage.SPACING, Space(decision.until_s)
        else:
            return self._send()
        return self._wait

    def unclaimed(self) -> None:
        """The claim ended without a credit: ``poke`` starts again."""
        assert self._stage is _Stage.CLAIMING, self._stage
        self._stage = _Stage.IDLE

    def second(self, credit: C, claimed: Claimed) -> Command[C]:
        """During a hold, another worker freed first: it takes the batch, the held one goes back. One
        from the held worker itself renewed the held credit (its credits expire unclaimed): the held
        one is stale, and offered back it would send a second batch to a busy worker."""
        assert self._stage is _Stage.HOLDING, self._stage
        back = None if claimed.worker == self._worker else self._credit
        self._credit, self._worker = credit, claimed.worker
        return self._send(back)

    def woke(self) -> Command[C]:
        """The hold or the spacing ran out."""
        assert self._stage in (_Stage.HOLDING, _Stage.SPACING), self._stage
        return self._send()

    def sent(self) -> None:
        """The send took the credit: ``poke`` says what comes next."""
        assert self._stage is _Stage.SENDING, self._stage
        self._stage, self._credit = _Stage.IDLE, None

    def release(self) -> C | None:
        """The loop stops (its batcher closes): the claimed credit that no send has taken yet (held,
        spaced, or on its way to its send), for the pool. A credit dropped would keep its worker idle
        until the worker offers another, as the old one expires."""
        if self._stage not in (_Stage.HOLDING, _Stage.SPACING, _Stage.SENDING):
            return None
        credit, self._credit, self._wait, self._stage = self._credit, None, None, _Stage.IDLE
        return credit

    def _send(self, back: C | None = None) -> Send[C]:
        credit, self._wait = self._credit, None
        assert credit is not None
        self._stage = _Stage.SENDING
        return Send(credit, back)
