"""The worker's credit: how it says it can take the next batch.

A worker holds at most one open credit, which one batcher claims to send a batch against. It
offers one when its backend is idle, or ``credit_lead_ms`` before the running call is expected to
end, so the next batch is formed and travels while the GPU finishes this one; the lead is short
next to a call, so a batch sent against an early credit waits at most about that long. The credit
names the worker's lowest batch partition and is replaced before it expires unclaimed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from gpu_worker.backends.base import Backend
from gpu_worker.runner import BackendRunner
from gpu_worker.settings import WorkerSettings
from gpu_worker.states import wall_ms
from schemas.records import Batch, Credit
from transport.ports import BatchConsumer, CreditPool, TransportError
from transport.replicas import ReplicaWait

log = logging.getLogger(__name__)


class CreditOffer:
    """Offers, refreshes and withdraws the worker's one credit."""

    def __init__(
        self,
        settings: WorkerSettings,
        pool: CreditPool,
        consumer: BatchConsumer,
        backend: Backend,
        runner: BackendRunner,
        busy_for_s: Callable[[], float],
        replicas: ReplicaWait | None,
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.consumer = consumer
        self.backend = backend
        self.runner = runner
        self.busy_for_s = busy_for_s
        """How long until the backend should be idle (0 when it is)."""
        self.replicas = replicas
        self._open: Credit | None = None
        # Past every ref of this worker id's earlier runs (one offer a microsecond is far beyond any
        # worker): a batch sent against a credit of its last run is not taken for one sent against this run's.
        self._seq = time.time_ns() // 1000
        self._stopped = False
        self._failed_offers = 0
        self._revoking: frozenset[int] = frozenset()
        """Partitions whose revocation runs (``on_revoked`` to ``revoked``): no credit names them."""

    async def stop(self) -> None:
        """Withdraws the open credit and offers no other."""
        self._stopped = True
        await self.withdraw()

    async def on_assigned(self, partitions: frozenset[int]) -> None:
        log.info("worker %s owns batch partitions %s", self.settings.worker_id, sorted(partitions))
        if self._open is not None and self._open.partition not in partitions:
            await self.withdraw()

    async def on_revoked(self, partitions: frozenset[int]) -> None:
        """Withdraws the credit naming ``partitions`` and offers none that does until ``revoked``: the
        assignment still lists them while their batches in hand end."""
        self._revoking |= partitions
        if self._open is not None and self._open.partition in partitions:
            await self.withdraw()

    def revoked(self, partitions: frozenset[int]) -> None:
        """The revocation of ``partitions`` is over (they left the assignment, or came back to it)."""
        self._revoking -= partitions

    async def withdraw(self) -> None:
        credit, self._open = self._open, None
        if credit is not None:
            try:
                await self.pool.withdraw(credit)
            except TransportError as err:
                level = logging.DEBUG if self._failed_offers else logging.WARNING  # its offer failed too
                log.log(level, "could not withdraw credit %s: %s (it expires on its own)", credit.ref, err)

    async def taken(self, batch: Batch | None) -> None:
        """A batch came: the open credit is used up, and withdrawn if the batch was not sent against it
        (keep one at a time)."""
        if self._open is not None and (batch is None or batch.credit != self._open.ref):
            await self.withdraw()
        self._open = None

    def lead_s(self, batch_size: int) -> float:
        """How long before a running call of ``batch_size`` inputs ends the next credit is offered."""
        full = 2 * batch_size >= (self.backend.max_batch or 0) > 0
        return (self.settings.credit_lead_full_ms if full else self.settings.credit_lead_ms) / 1000

    async def offer(self) -> None:
        """Offers a credit when idle, and replaces one that is about to expire unclaimed."""
        if self._stopped:
            return
        if self.replicas is not None and self.replicas.waiting:
            await self.withdraw()  # results wait for Redis replicas: no new batch until they are safe
            return
        now = wall_ms()
        fresh = self._open is not None and self._open.expires_at_ms - now > self.settings.refresh_margin_s * 1000
        if fresh and not self._failed_offers:
            return
        assignment = self.consumer.assignment() - self._revoking
        if not assignment:
            return
        await self.withdraw()
        credit = self._next_credit(min(assignment), now)
        try:
            await self.pool.offer(credit)
        except TransportError as err:
            self._failed_offers += 1
            if self._failed_offers == 1 or self._failed_offers % 20 == 0:
                log.warning("could not offer a credit (%d tries so far): %s; retrying", self._failed_offers, err)
        else:
            if self._failed_offers:
                log.info(
                    "worker %s offers credits again after %d failed tries", self.settings.worker_id, self._failed_offers
                )
                self._failed_offers = 0
        # Open even when the offer failed: a Redis whose answer came past the socket timeout (slow, or
        # this loop stalled) stored it all the same, and a batcher may claim it. Withdrawn as an open
        # credit is, and replaced at the next offer, it never stands beside a second one of this worker.
        self._open = credit
        if self._stopped or credit.partition in self._revoking:  # withdrawn while this offer was on its way
            await self.withdraw()

    def _next_credit(self, partition: int, now: int) -> Credit:
        self._seq += 1
        return Credit(
            worker_id=self.settings.worker_id,
            model=self.settings.model,
            partition=partition,
            seq=self._seq,
            issued_at_ms=now,
            expires_at_ms=now + int(self.settings.credit_ttl_s * 1000),
            max_batch=self.backend.max_batch,
            busy_ms=round((self.runner.expected_s or 0.0) * 1000),
            free_at_ms=now + round(self.busy_for_s() * 1000),
        )
