"""Gateway test rig: memory transports, a tiny fake worker, a stub lifecycle, and helpers.

The fake worker stands in for batcher + GPU worker: it reads the request bus and answers through
``store.apply`` with the reversed input, as the real worker answers through the real store.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

from batchwire.client import GRACE_S
from gateway.service import Gateway
from gateway.settings import GatewaySettings
from schemas.records import InferenceRequest, TaskState, TaskStatus
from tests.support.eventually import eventually
from transport.memory.requests import MemoryRequestBus
from transport.memory.store import MemoryTaskStore
from transport.ports import TransportError

MODELS = ("sim", "echo")


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class RecordingStore(MemoryTaskStore):
    """The memory store, counting ``create`` calls so tests can assert nothing was stored."""

    def __init__(self) -> None:
        super().__init__()
        self.created: list[TaskState] = []

    async def create(self, state: TaskState) -> bool:
        self.created.append(state)
        return await super().create(state)


class StalledStore(RecordingStore):
    """A store that does not answer (Redis under ``CLIENT PAUSE``, or its network stalled) until ``back`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.back = asyncio.Event()
        self.applied: list[TaskState] = []

    async def create(self, state: TaskState) -> bool:
        await self.back.wait()
        return await super().create(state)

    async def get(self, task_id: str) -> TaskState | None:
        await self.back.wait()
        return await super().get(task_id)

    async def apply(self, updates: Sequence[TaskState], *, counted: bool = True) -> list[bool]:
        await self.back.wait()
        self.applied.extend(updates)
        return await super().apply(updates, counted=counted)


async def deadline_passed_on(rig: Rig, path: str, text: str, timeout_s: float) -> str:
    """Submits ``text`` to ``path`` with ``timeout_s`` while the rig's ``StalledStore`` does not answer:
    asserts the 504 comes within the shipped client's grace of the deadline (``batchwire.client.GRACE_S``),
    else that client gives up first, without the task id; returns that id."""
    started = time.monotonic()
    async with asyncio.timeout(20):
        response = await rig.client.post(path, json={"input": text, "timeout_ms": int(timeout_s * 1000)})
    elapsed = time.monotonic() - started
    assert response.status_code == 504, response.text
    assert elapsed < timeout_s + GRACE_S, f"the 504 came {elapsed - timeout_s:.2f} s past the deadline"
    return str(error_of(response)["task_id"])


class FakeWorker:
    """Answers every request on the bus with ``input[::-1]``; an input starting ``fail:`` fails, one
    starting ``refuse:<code>:`` fails as its model refusing it would (``input_too_long``, ``input_empty``).

    ``gate`` holds the worker before it touches a fetched batch (clear it to hold, set to release);
    ``progress`` also writes ``batched`` and ``running``; ``reply=False`` drops the reply address
    (a reply message lost in transit).
    """

    def __init__(
        self, bus: MemoryRequestBus, store: MemoryTaskStore, *, progress: bool = False, reply: bool = True
    ) -> None:
        self.consumer = bus.consumer()
        self.store = store
        self.progress = progress
        self.reply = reply
        self.gate = asyncio.Event()
        self.gate.set()
        self.seen: list[InferenceRequest] = []
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        async def ignore(_: frozenset[int]) -> None:
            return None

        await self.consumer.start(ignore, ignore)
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task})
            if not self._task.cancelled() and self._task.exception() is not None:
                raise AssertionError("fake worker died") from self._task.exception()

    async def _run(self) -> None:
        while True:
            records = await self.consumer.fetch(timeout_s=1.0, max_records=512)
            if not records:
                continue
            await self.gate.wait()
            requests = [record.value for record in records if record.value is not None]
            self.seen.extend(requests)
            if self.progress:
                for status in (TaskStatus.BATCHED, TaskStatus.RUNNING):
                    await self.store.apply([self._state(r, status, len(requests)) for r in requests])
            await self.store.apply([self._final(r, len(requests)) for r in requests])
            offsets: dict[int, int] = {}
            for record in records:
                offsets[record.partition] = max(offsets.get(record.partition, 0), record.offset + 1)
            await self.consumer.commit(offsets)

    def _state(self, request: InferenceRequest, status: TaskStatus, size: int, **extra: Any) -> TaskState:
        return TaskState(
            request.task_id,
            status,
            request.model,
            now_ms(),
            request.enqueued_at_ms,
            batch_size=size,
            reply_to=request.reply_to if self.reply else None,
            **extra,
        )

    def _final(self, request: InferenceRequest, size: int) -> TaskState:
        if request.input.startswith("fail:"):
            return self._state(
                request, TaskStatus.FAILED, size, error_code="backend_error", error_message="the model raised"
            )
        if request.input.startswith("refuse:"):  # "refuse:<code>": the model refused the input (INPUT_REFUSED)
            code = request.input.split(":")[1]
            return self._state(request, TaskStatus.FAILED, size, error_code=code, error_message=f"refused: {code}")
        if request.input.startswith("expire:"):
            return self._state(
                request, TaskStatus.EXPIRED, size, error_code="deadline_exceeded", error_message="expired in the queue"
            )
        return self._state(request, TaskStatus.COMPLETED, size, output=request.input[::-1])


@dataclass
class StubLifecycle:
    """The composition root's part: records the calls, reports ``parts`` as its readiness."""

    parts: dict[str, bool] = field(default_factory=lambda: {"bus": True, "store": True, "batcher": True})
    calls: list[str] = field(default_factory=list)
    fail_ready: bool = False

    async def start(self) -> None:
        self.calls.append("lifecycle.start")

    async def close(self) -> None:
        self.calls.append("lifecycle.close")

    async def ready(self) -> dict[str, bool]:
        if self.fail_ready:
            raise RuntimeError("ready check exploded")
        return dict(self.parts)


@dataclass
class Rig:
    settings: GatewaySettings
    bus: MemoryRequestBus
    store: RecordingStore
    gateway: Gateway
    lifecycle: StubLifecycle
    app: FastAPI
    client: httpx.AsyncClient
    workers: list[FakeWorker]

    async def worker(self, **options: Any) -> FakeWorker:
        worker = FakeWorker(self.bus, self.store, **options)
        await worker.start()
        self.workers.append(worker)
        return worker

    def produced(self) -> int:
        """How many requests reached the bus so far."""
        return sum(self.bus.log.end(p) for p in range(self.bus.partitioner.partitions))

    def only_request(self) -> InferenceRequest:
        """The one request on the bus (a synchronous request's task is not stored until batched)."""
        requests = [request for records in self.bus.log.records for request in records]
        assert len(requests) == 1, f"expected one request on the bus, found {len(requests)}"
        return requests[0]


RigFactory = Callable[..., Awaitable[Rig]]


def http_scope(
    method: str, path: str, query: bytes = b"", headers: Sequence[tuple[bytes, bytes]] = ()
) -> dict[str, Any]:
    """An ASGI HTTP scope, for a test that plays the server itself (a client that leaves, say)."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "root_path": "",
        "headers": [(b"host", b"gateway"), *headers],
        "client": ("127.0.0.1", 1234),
        "server": ("gateway", 80),
    }


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The ``error`` object of a JSON error answer, failing clearly if the shape is wrong."""
    assert response.headers.get("content-type", "").startswith("application/json"), (
        f"expected a JSON error, got {response.status_code} {response.headers.get('content-type')}: {response.text!r}"
    )
    doc = response.json()
    assert "error" in doc, f"not the error shape: {doc}"
    assert {"code", "message"} <= set(doc["error"]), f"not the error shape: {doc}"
    error: dict[str, Any] = doc["error"]
    return error


def statuses(states: Sequence[TaskState]) -> list[str]:
    return [state.status.value for state in states]


@asynccontextmanager
async def serving(rig: Rig) -> AsyncIterator[httpx.AsyncClient]:
    """The rig's app on a free 127.0.0.1 port; stops the server (and checks it stopped) on exit."""
    config = uvicorn.Config(rig.app, host="127.0.0.1", port=0, lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=None))
    try:
        await eventually(lambda: server.started or task.done(), "uvicorn to start")
        assert server.started, "uvicorn failed to start"
        port = server.servers[0].sockets[0].getsockname()[1]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            yield client
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


class DownProducer:
    """A request producer whose broker is unreachable: every send fails."""

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def ready(self) -> bool:
        return False

    def reachable(self) -> bool:
        return True  # not known yet: the send finds out

    async def send(self, request: InferenceRequest) -> None:
        raise TransportError("broker unreachable")
