"""Embedded mode: gateway, batcher and workers in one process over in-memory transports.

The same ``Batcher``, ``Worker`` and ``Gateway`` classes as the multi-process deployment; only
the transports differ. A worker that stops is replaced in place, as a process supervisor restarts a
worker process that exits: a fresh ``Worker`` over a fresh backend and thread takes its partition,
and the batches it had not committed are sent to that partition again. A hung backend's worker is
replaced at once; a crashed one after a backoff, so that a fault that crashes every replacement
does not turn into a busy loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from batcher.service import Batcher
from batcher.settings import BatcherSettings
from batcher.tokens import TokenCounter, estimated
from batchwire.fleet import Heartbeats, batcher_beat, last_beat, worker_beat
from batchwire.settings import SettingsError, SharedSettings
from gpu_worker.backends.base import Backend
from gpu_worker.journal import BatchJournal
from gpu_worker.settings import WorkerSettings
from gpu_worker.worker import Worker
from schemas.heartbeat import Beat
from schemas.records import Batch
from telemetry import metrics
from telemetry.heartbeat import Window
from transport.deliveries import MemoryDeadLetters, MemoryDeliveryLog
from transport.memory.batches import MemoryBatchBus
from transport.memory.credits import MemoryCreditPool
from transport.memory.fleet import MemoryFleet
from transport.memory.lag import MemoryQueueDepth
from transport.memory.requests import MemoryRequestBus
from transport.memory.store import MemoryTaskStore
from transport.retry import backoff_s
from transport.routing import Partitioner

log = logging.getLogger(__name__)

CRASH_BACKOFF_S = 1.0
"""How long a crashed worker's slot stays down before its replacement starts; it doubles while each
replacement crashes before it finishes a batch."""
CRASH_BACKOFF_MAX_S = 60.0

RESULT_CACHE_SHARE = 4
"""The result cache (with ``--cache-ttl-s``) holds at most ``max_store_bytes`` over this."""


def crash_backoff_s(crashes: int) -> float:
    """How long a slot stays down after its ``crashes``-th crash in a row."""
    return backoff_s(crashes, CRASH_BACKOFF_MAX_S, CRASH_BACKOFF_S)


async def _back_off(worker_id: str, what: str, crashes: int) -> None:
    backoff_s = crash_backoff_s(crashes)
    log.error("embedded worker %s %s; replacing it in %.0f s", worker_id, what, backoff_s)
    await asyncio.sleep(backoff_s)


async def _close_logged(worker: Worker, drain_timeout_s: float | None = None) -> None:
    """Closes a worker. An error doing so is logged and goes no further: raised, it would end the slot's
    watcher (the slot never replaced again), or the shutdown before the other parts are closed."""
    try:
        await worker.close(drain_timeout_s=drain_timeout_s)
    except Exception as err:
        log.error("embedded worker %s did not close cleanly: %r", worker.settings.worker_id, err, exc_info=err)


class _BatchRouter:
    """The batcher's view of all models' batch buses."""

    def __init__(self, buses: dict[str, MemoryBatchBus]) -> None:
        self.buses = buses
        self.sent: dict[str, int] = dict.fromkeys(buses, 0)
        """Batches sent per model (the queue depth's sign that a model's workers take work)."""

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def send(self, batch: Batch, partition: int) -> None:
        await self.buses[batch.model].send(batch, partition)
        self.sent[batch.model] += 1


@dataclass
class EmbeddedSettings:
    shared: SharedSettings = field(default_factory=SharedSettings)
    batcher: BatcherSettings = field(default_factory=BatcherSettings)
    workers_per_model: int = 2
    batch_log: str | None = None
    worker: WorkerSettings = field(default_factory=WorkerSettings)
    """Template of every worker's settings (its id, model and batch log are set per worker)."""
    deterministic_models: tuple[str, ...] = ()
    """Models whose workers run each distinct input of a batch once."""
    max_store_bytes: int = 256 * 2**20
    """Bytes the task store may hold for results, ids and queued inputs (0: no limit): ended tasks
    are dropped oldest first, and once only live tasks are left, submits get 503 ``overloaded``. The
    result cache holds a share of it besides (``result_cache_max_bytes``)."""

    def __post_init__(self) -> None:
        if self.workers_per_model < 1:
            raise SettingsError(
                f"workers must be at least 1 per model, got {self.workers_per_model} (BATCHWIRE_WORKERS)"
            )
        if self.max_store_bytes < 0:
            raise SettingsError(
                f"max_store_bytes must be >= 0 (0: no limit), got {self.max_store_bytes} (BATCHWIRE_MAX_STORE_BYTES)"
            )
        if 0 < self.max_store_bytes < self.worker.max_output_bytes:
            raise SettingsError(
                f"max_store_bytes ({self.max_store_bytes}, BATCHWIRE_MAX_STORE_BYTES) must hold at least one "
                f"result of max_output_bytes ({self.worker.max_output_bytes}, BATCHWIRE_MAX_OUTPUT_BYTES)"
            )

    @property
    def result_cache_max_bytes(self) -> int | None:
        """The result cache's byte bound (None: no budget, so none): its answers live beside the store's,
        so it takes a fixed share of the same setting instead of a flag of its own."""
        if self.max_store_bytes == 0:
            return None
        return max(1, self.max_store_bytes // RESULT_CACHE_SHARE)


class EmbeddedRuntime:
    """Owns every in-process part; ``start`` and ``close`` bring them up and down in order."""

    def __init__(
        self,
        settings: EmbeddedSettings,
        backend_factory: Callable[[str, int], Backend],
        count_tokens: TokenCounter = estimated,
    ) -> None:
        """``count_tokens``: each input's length for the batcher's token budget (when it has one)."""
        self.settings = settings
        shared = settings.shared
        self.partitioner = Partitioner(shared.models, shared.request_partitions)
        self.requests = MemoryRequestBus(self.partitioner)
        self.producer = self.requests.producer()
        self.store = MemoryTaskStore(
            ttl_s=shared.result_ttl_s,
            max_bytes=settings.max_store_bytes or None,
            queued=self.requests,  # inputs waiting for a batch count against the same budget
        )
        self.credits = MemoryCreditPool()
        self.batch_buses = {model: MemoryBatchBus(settings.workers_per_model) for model in shared.models}
        router = _BatchRouter(self.batch_buses)
        self.batcher = Batcher(
            settings.batcher, self.requests.consumer(), router, self.credits, self.store, count_tokens=count_tokens
        )
        # The gateway's admission: queue depth and drain per model.
        self.queue_depth = MemoryQueueDepth(self.requests, router.sent.__getitem__)
        self.backend_factory = backend_factory
        self.deliveries = MemoryDeliveryLog(ttl_s=shared.result_ttl_s)
        self.dead_letters = MemoryDeadLetters()
        self._slots = [(model, index) for model in shared.models for index in range(settings.workers_per_model)]
        self._generations = [0] * len(self._slots)
        self.workers: list[Worker] = [self._worker(slot) for slot in range(len(self._slots))]
        self.replaced = 0
        self._retired: list[Worker] = []
        """Workers replaced since the last beat: beaten once more, their last beat, in the state they stopped
        in (not live), or the fleet would show them as they last beat (busy: live) until their beats went stale."""
        self._watchers: list[asyncio.Task[None]] = []
        self.fleet = MemoryFleet()
        self.heartbeats: Heartbeats | None = None
        """Set by the composition root, which adds the gateway's beat to ``beats``; it beats from before the
        workers start until after they drained, so a draining worker is shown draining, not gone."""

    def load(self) -> None:
        """Loads every worker's backend, one after another (weights load one at a time in a process
        anyway), before the service starts: a model that cannot load ends ``up`` with its message,
        before anything serves (inside the HTTP server's start it would be a traceback)."""
        for worker in self.workers:
            worker.backend.load()

    def beats(self, window: Window) -> list[Beat]:
        """The batcher's and every worker's heartbeat."""
        batcher = batcher_beat(self.batcher, self.settings.shared.models, window)
        retired, self._retired = self._retired, []
        ended = [last_beat(worker_beat(worker, window)) for worker in retired]
        return [batcher, *ended, *(worker_beat(worker, window) for worker in self.workers)]

    def _worker(self, slot: int) -> Worker:
        model, index = self._slots[slot]
        generation = self._generations[slot]
        worker_id = f"{model}-worker-{index}" + (f".{generation}" if generation else "")
        worker_settings = dataclasses.replace(
            self.settings.worker,
            worker_id=worker_id,
            model=model,
            batch_log=self.settings.batch_log,
            deterministic=model in self.settings.deterministic_models,
        )
        journal = BatchJournal(self.settings.batch_log) if self.settings.batch_log else None
        return Worker(
            worker_settings,
            self.batch_buses[model].consumer(index),
            self.credits,
            self.store,
            self.backend_factory(model, index),
            journal,
            deliveries=self.deliveries,
            dead_letters=self.dead_letters,
        )

    async def _watch(self, slot: int) -> None:
        """Replaces the slot's worker whenever it stops: at once when its backend hung, after a backoff
        when it crashed or a replacement could not start (the process is unready meanwhile only when no
        other worker lives)."""
        crashes = 0
        while True:
            worker = self.workers[slot]
            await worker.failed.wait()
            if not worker.hung:
                crashes = crashes + 1 if worker.batches_done == 0 else 1
                await worker.offers.stop()  # no batch is sent against its credit while it is down
                await _back_off(worker.settings.worker_id, "crashed", crashes)
            model, index = self._slots[slot]
            await _close_logged(worker, drain_timeout_s=0)  # it stopped: nothing to drain
            metrics.forget_worker(worker.settings.worker_id)
            # Uncommitted: in memory that means sent again, ahead of what was sent since, before the
            # replacement reads.
            await self.batch_buses[model].send_again(worker.given_back, index)
            while (fresh := await self._started(slot)) is None:  # a load that fails is a crash too
                crashes += 1
                await _back_off(f"{model}-worker-{index}", "could not start", crashes)
            self.workers[slot] = fresh
            self.replaced += 1
            log.warning(
                "embedded worker %s %s and was replaced by %s over a fresh backend",
                worker.settings.worker_id,
                "hung" if worker.hung else "crashed",
                fresh.settings.worker_id,
            )
            self._retired.append(worker)
            if self.heartbeats is not None:
                self.heartbeats.beat_soon()  # the replacement shown serving, the worker it replaced stopped

    async def _started(self, slot: int) -> Worker | None:
        """A fresh worker for the slot, started; None (logged, closed) when it could not start."""
        self._generations[slot] += 1
        fresh = self._worker(slot)
        try:
            await fresh.start()
        except Exception as err:
            log.error("embedded worker %s could not start: %r", fresh.settings.worker_id, err, exc_info=err)
            await _close_logged(fresh, drain_timeout_s=0)
            return None
        except BaseException:  # shut down while it started: it is in no list that close() goes through
            await _close_logged(fresh, drain_timeout_s=0)  # an error there must not stand in for the cancel
            raise
        return fresh

    async def start(self) -> None:
        await self.store.start()
        await self.credits.start()
        if self.heartbeats is not None:
            await self.heartbeats.start()
        # Every start ends before a failure is raised: a worker still coming up then would start after the
        # ``close`` that follows, its tasks left running.
        started = await asyncio.gather(*(worker.start() for worker in self.workers), return_exceptions=True)
        if failure := next((result for result in started if isinstance(result, BaseException)), None):
            raise failure
        self._watchers = [
            asyncio.create_task(self._watch(slot), name=f"embedded-watch-{slot}") for slot in range(len(self._slots))
        ]
        await self.batcher.start()
        if self.heartbeats is not None:
            self.heartbeats.beat_soon()  # the workers shown serving now, not a period later
        log.info(
            "embedded runtime up: models %s, %d workers each",
            list(self.settings.shared.models),
            self.settings.workers_per_model,
        )

    async def close(self) -> None:
        # The watchers first: a slot refilled while the batcher closes would load a model only to be closed.
        for watcher in self._watchers:
            watcher.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        await self.batcher.close()
        await asyncio.gather(*(_close_logged(worker) for worker in self.workers))
        if self.heartbeats is not None:
            await self.heartbeats.close()
        await self.credits.close()
        await self.store.close()

    def failure(self) -> BaseException | None:
        """What stopped a part that is not replaced (the batcher, a slot's watcher): the process ends."""
        if self.batcher.failure is not None:
            return self.batcher.failure
        ended = (watcher for watcher in self._watchers if watcher.done() and not watcher.cancelled())
        return next((err for watcher in ended if (err := watcher.exception()) is not None), None)

    async def ready(self) -> dict[str, bool]:
        return {
            "bus": await self.producer.ready(),
            "store": await self.store.ready(),
            "batcher": self.batcher.healthy(),
            "workers": self._serving(),
        }

    def _serving(self) -> bool:
        """Whether some model has a live worker. A model whose workers are all down (crashed, in their
        backoff, or failing to load again) is ``stalled`` for its own submits once they wait, as over Kafka;
        were the process unready for it, a load balancer would take every other model out with it."""
        return any(worker.healthy() for worker in self.workers)
