"""A circuit breaker: while a dependency is known to be down, callers are refused at once.

Without it, each caller finds out alone, by waiting out its own timeout. The breaker is *closed*
while the dependency answers. A failure (a send that failed, a readiness probe that said no)
*opens* it: ``open`` is then True and callers refuse their work without trying. While open, one
background probe at a time (the *half-open* check) asks the dependency every ``retry_s``, each try
bounded by ``probe_timeout_s`` of the time the event loop could run (``transport.loop_time``); the
first success closes the breaker. Callers never wait for a probe. The probing task belongs to the
breaker: it starts with the first failure, ends with the first success, and ``close()`` cancels and
awaits it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable

from transport import loop_time
from transport.cancelling import cancel_and_wait

log = logging.getLogger(__name__)

Probe = Callable[[], Awaitable[bool]]
"""Whether the dependency answers now; trouble with the dependency is False, not an exception."""


class CircuitBreaker:
    """Open from a failure until a probe succeeds; see the module docstring."""

    def __init__(
        self,
        name: str,
        probe: Probe,
        *,
        retry_s: float = 0.5,
        probe_timeout_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not retry_s > 0 or not probe_timeout_s > 0:
            raise ValueError(f"retry_s and probe_timeout_s must be positive, got {retry_s} and {probe_timeout_s}")
        self.name = name
        self.retry_s = retry_s
        self.probe_timeout_s = probe_timeout_s
        self._probe = probe
        self._clock = clock
        self._open = False
        self._opened_at = 0.0
        self._closed_at = -math.inf
        self._reason = ""
        self._prober: asyncio.Task[None] | None = None
        self._closed_for_good = False
        self.opened = 0
        """How often the breaker opened (for metrics and tests)."""

    @property
    def open(self) -> bool:
        """True while the dependency is known to be down: refuse the work instead of trying."""
        return self._open

    @property
    def reason(self) -> str:
        """What opened the breaker, and how long ago (for the refusal's message)."""
        if not self._open:
            return ""
        return f"{self._reason}; down for {self._clock() - self._opened_at:.1f} s"

    def failed(self, reason: str, *, started_at: float | None = None) -> None:
        """Opens the breaker (a call or a readiness probe failed) and starts the probing if none runs.

        ``started_at`` (the breaker's clock): a call begun before the breaker last closed says nothing
        of the dependency since, so its failure (one in flight through the outage, failing late) is
        ignored rather than reopening a breaker that a probe closed meanwhile."""
        if self._closed_for_good or (started_at is not None and started_at < self._closed_at):
            return
        if not self._open:
            self._open = True
            self._opened_at = self._clock()
            self.opened += 1
            log.warning("%s is down (%s): refusing at once until a probe reaches it", self.name, reason)
        self._reason = reason
        self._start_probing(first_delay_s=self.retry_s)

    def succeeded(self) -> None:
        """Closes the breaker: the dependency answered (a readiness probe or a call went through)."""
        if self._open:
            self._open = False
            self._closed_at = self._clock()
            log.warning("%s is reachable again after %.1f s", self.name, self._clock() - self._opened_at)

    def suspect(self) -> None:
        """Probes once now without opening (a call was slow and gave up); a failed probe opens the breaker."""
        if not self._closed_for_good and not self._open:
            self._start_probing(first_delay_s=0.0)

    async def close(self) -> None:
        """Stops probing for good; the breaker stays as it is."""
        self._closed_for_good = True
        prober, self._prober = self._prober, None
        if prober is not None:
            await cancel_and_wait(prober)

    def _start_probing(self, first_delay_s: float) -> None:
        # A prober that has just ended is still set until its done callback runs, a loop turn later:
        # a failure reported in between must start a new one, or nothing would ever close the breaker.
        if self._prober is not None and not self._prober.done():
            return
        self._prober = asyncio.create_task(self._probe_until_up(first_delay_s), name=f"{self.name}-breaker-probe")
        self._prober.add_done_callback(self._probing_ended)

    async def _probe_until_up(self, first_delay_s: float) -> None:
        delay_s = first_delay_s
        while True:
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            if await self._probe_once():
                self.succeeded()
                return
            if not self._open:
                self.failed("a probe found it down")  # from suspect(): open now
            delay_s = self.retry_s

    async def _probe_once(self) -> bool:
        # Bounded in the loop's time: a probe whose answer came while the loop was blocked (the
        # process's own stall) finds the dependency up.
        try:
            async with loop_time.timeout(self.probe_timeout_s):
                return bool(await self._probe())
        except TimeoutError:
            return False
        except Exception:
            log.warning("probing %s raised; counted as down", self.name, exc_info=True)
            return False

    def _probing_ended(self, task: asyncio.Task[None]) -> None:
        if self._prober is task:
            self._prober = None
        if not task.cancelled() and task.exception() is not None:
            log.error("the %s breaker's probe died", self.name, exc_info=task.exception())
