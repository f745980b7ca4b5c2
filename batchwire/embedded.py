"""Embedded mode: gateway, batcher and workers in one process over in-memory transports.

The same ``Batcher``, ``Worker`` and ``Gateway`` classes as the multi-process deployment; only
the transports differ.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from batcher.service import Batcher
from batcher.settings import BatcherSettings
from batchwire.routing import Partitioner
from batchwire.settings import SharedSettings
from batchwire.transport.memory import (
    MemoryBatchBus,
    MemoryCreditPool,
    MemoryRequestBus,
    MemoryTaskStore,
)
from gpu_worker.backends.base import Backend
from gpu_worker.journal import BatchJournal
from gpu_worker.settings import WorkerSettings
from gpu_worker.worker import Worker
from schemas.records import Batch

log = logging.getLogger(__name__)


class _BatchRouter:
    """The batcher's view of all models' batch buses."""

    def __init__(self, buses: dict[str, MemoryBatchBus]) -> None:
        self.buses = buses

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def send(self, batch: Batch, partition: int) -> None:
        await self.buses[batch.model].send(batch, partition)


@dataclass
class EmbeddedSettings:
    shared: SharedSettings = field(default_factory=SharedSettings)
    batcher: BatcherSettings = field(default_factory=BatcherSettings)
    workers_per_model: int = 2
    batch_log: str | None = None


class EmbeddedRuntime:
    """Owns every in-process part; ``start`` and ``close`` bring them up and down in order."""

    def __init__(self, settings: EmbeddedSettings, backend_factory: Callable[[str, int], Backend]) -> None:
        self.settings = settings
        shared = settings.shared
        self.partitioner = Partitioner(shared.models, shared.request_partitions)
        self.requests = MemoryRequestBus(self.partitioner)
        self.producer = self.requests.producer()
        self.store = MemoryTaskStore(ttl_s=shared.result_ttl_s)
        self.credits = MemoryCreditPool()
        self.batch_buses = {model: MemoryBatchBus(settings.workers_per_model) for model in shared.models}
        self.batcher = Batcher(
            settings.batcher, self.requests.consumer(), _BatchRouter(self.batch_buses), self.credits, self.store
        )
        self.workers: list[Worker] = []
        for model in shared.models:
            for index in range(settings.workers_per_model):
                worker_settings = WorkerSettings(
                    worker_id=f"{model}-worker-{index}", model=model, batch_log=settings.batch_log
                )
                journal = BatchJournal(settings.batch_log) if settings.batch_log else None
                self.workers.append(
                    Worker(
                        worker_settings,
                        self.batch_buses[model].consumer(index),
                        self.credits,
                        self.store,
                        backend_factory(model, index),
                        journal,
                    )
                )

    async def start(self) -> None:
        await self.store.start()
        await self.credits.start()
        await asyncio.gather(*(worker.start() for worker in self.workers))
        await self.batcher.start()
        log.info(
            "embedded runtime up: models %s, %d workers each",
            list(self.settings.shared.models),
            self.settings.workers_per_model,
        )

    async def close(self) -> None:
        await self.batcher.close()
        await asyncio.gather(*(worker.close() for worker in self.workers))
        await self.credits.close()
        await self.store.close()

    async def ready(self) -> dict[str, bool]:
        return {
            "batcher": self.batcher.healthy(),
            "workers": bool(self.workers) and all(worker.healthy() for worker in self.workers),
        }
