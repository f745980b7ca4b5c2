"""``batchwire.client`` against a server that misbehaves: a call ends by its deadline and the grace.

The server is a small ASGI app under uvicorn, on a real socket, in a thread of its own so that the
blocking client can call it too.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from batchwire.client import GRACE_S, AsyncClient, Client, DeadlineExceeded
from tests.support.eventually import eventually_sync

pytestmark = pytest.mark.timeout(120)

TRICKLE_S = 15.0
"""How long the trickling server goes on sending its answer, a byte at a time: far past any call's deadline."""
PACE_S = 0.1
TIMEOUT_S = 1.0


async def trickle(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A 200 whose body comes a byte every ``PACE_S``, for ``TRICKLE_S``: each read gets a byte well within
    any read timeout, so only a deadline over the whole answer ends it. Stops once its client is gone."""
    if scope["type"] != "http":
        return
    gone = asyncio.Event()

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        gone.set()

    watcher = asyncio.create_task(watch())
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    for _ in range(int(TRICKLE_S / PACE_S)):
        if gone.is_set():
            break
        await send({"type": "http.response.body", "body": b" ", "more_body": True})
        await asyncio.sleep(PACE_S)
    else:
        await send({"type": "http.response.body", "body": b'{"output": "late", "task_id": "t1"}'})
    watcher.cancel()


@pytest.fixture(scope="module")
def trickling_server() -> Iterator[str]:
    server = uvicorn.Server(uvicorn.Config(trickle, host="127.0.0.1", port=0, lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, name="trickling-server", daemon=True)
    thread.start()
    eventually_sync(lambda: server.started or not thread.is_alive(), "uvicorn to start")
    assert server.started, "uvicorn failed to start"
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    server.should_exit = True
    thread.join(10)
    assert not thread.is_alive(), "the trickling server did not stop"


BOUND_S = TIMEOUT_S + GRACE_S + 3.0
"""The deadline, the grace, and room for a busy machine; far under ``TRICKLE_S``."""


def test_an_answer_that_trickles_past_the_deadline_raises_by_the_deadline_and_grace(trickling_server: str) -> None:
    with Client(trickling_server, timeout=TIMEOUT_S, max_retries=0) as client:
        for call in (lambda: client.infer("x"), lambda: client.submit("x"), lambda: client.result("t1")):
            began = time.monotonic()
            with pytest.raises(DeadlineExceeded):
                call()
            took = time.monotonic() - began
            assert took < BOUND_S, f"a call with a {TIMEOUT_S:g} s timeout took {took:.1f} s (bound {BOUND_S:g} s)"


async def test_async_an_answer_that_trickles_past_the_deadline_raises_by_the_deadline_and_grace(
    trickling_server: str,
) -> None:
    async with AsyncClient(trickling_server, timeout=TIMEOUT_S, max_retries=0) as client:
        for call in (lambda: client.infer("x"), lambda: client.submit("x"), lambda: client.result("t1")):
            began = time.monotonic()
            with pytest.raises(DeadlineExceeded):
                await call()
            took = time.monotonic() - began
            assert took < BOUND_S, f"a call with a {TIMEOUT_S:g} s timeout took {took:.1f} s (bound {BOUND_S:g} s)"
