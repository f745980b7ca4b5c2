"""What the e2e tests send over HTTP, and what they check of the answers."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter
from typing import Any

import httpx
from httpx_sse import aconnect_sse


def many_at_once(connections: int = 100) -> httpx.Limits:
    """A test client's limits when it has many requests in flight: it keeps every idle connection, as
    ``batchwire.client.POOL_LIMITS`` does. With a cap on idle ones (httpx keeps 20 by default), httpcore
    can close a surplus idle connection it has just handed to a request (encode/httpcore#1110): that
    request fails with a ReadError or hangs, a failure of the test's client, not of the service."""
    return httpx.Limits(max_connections=connections, max_keepalive_connections=None)


async def post_all(url: str, inputs: list[str], timeout_s: float = 60, *, keyed: bool = False) -> list[httpx.Response]:
    """Posts every input at once; the responses, in order. ``keyed``: each with an Idempotency-Key of its
    own, so the task is stored from its submit and its progress can be read (``TaskStore.apply``)."""
    async with httpx.AsyncClient(timeout=timeout_s, limits=many_at_once()) as client:
        return await asyncio.gather(
            *(
                client.post(f"{url}/v1/inference", json={"input": text}, headers=_key() if keyed else {})
                for text in inputs
            )
        )


def _key() -> dict[str, str]:
    return {"Idempotency-Key": uuid.uuid4().hex}


async def post_stream(url: str, inputs: list[str], interval_s: float, timeout_s: float = 60) -> list[httpx.Response]:
    """Open loop: one request every ``interval_s`` whatever the answers do; all the responses, in order."""
    async with httpx.AsyncClient(timeout=timeout_s, limits=many_at_once()) as client:
        sent = []
        for text in inputs:
            sent.append(asyncio.create_task(client.post(f"{url}/v1/inference", json={"input": text})))
            await asyncio.sleep(interval_s)  # pacing the load, not synchronization
        return await asyncio.gather(*sent)


def assert_answered(inputs: list[str], responses: list[httpx.Response]) -> list[dict[str, Any]]:
    """Asserts every request got 200 and its own reversed input; returns the bodies."""
    bodies = [r.json() for r in responses]
    statuses = Counter(r.status_code for r in responses)
    assert statuses == {200: len(inputs)}, f"every request answered 200, got {statuses}: {bodies[:3]}"
    for text, body in zip(inputs, bodies, strict=True):
        assert body["output"] == text[::-1], f"answer {body} does not belong to {text!r}"
    return bodies


async def collect_events(client: httpx.AsyncClient, url: str, task_id: str) -> list[tuple[str, dict[str, Any]]]:
    """The task's server-sent events (name, data) until the server closes the stream."""
    events: list[tuple[str, dict[str, Any]]] = []
    async with aconnect_sse(client, "GET", f"{url}/v1/result/{task_id}/events") as source:
        async for event in source.aiter_sse():
            if not event.data and event.event == "message":
                continue  # a keep-alive comment after an event with an id: httpx-sse yields it as an empty event
            events.append((event.event, json.loads(event.data)))
    return events
