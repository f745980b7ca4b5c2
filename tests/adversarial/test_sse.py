"""Many event streams at once: bounded by ``--max-watchers``, and their memory comes back once they close.

The streams follow tasks of a ``parked`` model that stay unfinished for the whole test (no worker
takes them over Kafka; in embedded mode its workers hang on them), so every stream stays open
until its client closes it. The normal client (the rig's probe) uses ``sim`` meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest

from tests.support.adversarial_rig import ONE_PER_CALL, RSS_GROWTH_BYTES, Service, ServiceFactory, unharmed
from tests.support.eventually import eventually_sync

pytestmark = [pytest.mark.slow, pytest.mark.timing, pytest.mark.timeout(300)]

STREAMS = 1000
OPEN_RATE_PER_S = 200.0
"""Paced, as many clients would come: the probe measures the service's work for the streams, not a
burst of the attacker's own CPU on a small test machine."""
CLOSE_RATE_PER_S = 500.0
"""The streams go paced too, five every 10 ms: a thousand closed in one instant is a burst of the
gateway's teardown that a probe request waits behind (``test_http_edge`` allows such a burst 0.1 ms
per connection); paced, the probe measures what each stream's end costs the others."""
ATTACKER_NICENESS = 10
SUBMITTING = 8
PARK = "PARK"
SETTINGS = {
    "BATCHWIRE_MODELS": "sim,parked",
    "BATCHWIRE_MAX_WATCHERS": str(STREAMS),
    "BATCHWIRE_MAX_WATCHERS_PER_CLIENT": str(STREAMS),  # the streams all come from one address
    "BATCHWIRE_ADMIT_BY_WAIT": "false",  # the parked queue must take every task the streams follow
    "BATCHWIRE_STALL_S": "3600",
    "BATCHWIRE_MAX_TIMEOUT_MS": "120000",
}


def _start(request: pytest.FixtureRequest, mode: str) -> Service:
    factory: ServiceFactory = request.getfixturevalue(f"{mode}_service_factory")
    if mode == "embedded":
        # ``parked`` gets two workers too: each hangs on its first batch (no hang detection), the
        # rest waits for them. A short drain lets the process exit despite the hung calls.
        extra = {
            **SETTINGS,
            "BATCHWIRE_SIM_HANG_ON": PARK,
            "BATCHWIRE_HANG_FACTOR": "0",
            "BATCHWIRE_DRAIN_TIMEOUT_S": "1",
        }
        flags = [item for name, value in extra.items() for item in (f"--{name[10:].lower().replace('_', '-')}", value)]
        return factory(*flags)
    return factory(extra_env=SETTINGS)  # every worker serves ``sim``, the first model


def _watchers(client: httpx.Client) -> float:
    found = re.search(r"^batchwire_open_watchers (\S+)$", client.get("/metrics").text, flags=re.MULTILINE)
    assert found, "the gateway exports batchwire_open_watchers"
    return float(found.group(1))


async def _open(host: str, port: int, task_id: str) -> tuple[asyncio.StreamWriter, bytes]:
    """An event stream's connection, read up to its first event (or up to a refusal's headers)."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(f"GET /v1/result/{task_id}/events HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    if head.startswith(b"HTTP/1.1 200"):
        head += await reader.readuntil(b"\r\n\r\n")  # the chunk carrying the first event
    return writer, head


async def _streams(url: str, task_ids: list[str]) -> None:
    """Opens one stream per task but the last (paced), then one more; prints what they got as one
    JSON line, and closes them all once told to on stdin."""
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    opened: list[tuple[asyncio.StreamWriter, bytes]] = []
    started = time.monotonic()
    for n, task_id in enumerate(task_ids[:-1]):
        opened.append(await _open(host, int(port), task_id))
        await asyncio.sleep(max(0.0, started + (n + 1) / OPEN_RATE_PER_S - time.monotonic()))  # pacing the attack
    writer, refused = await _open(host, int(port), task_ids[-1])
    writer.close()
    seen = {
        "first_events": sum(b"\r\nevent: " in head for _, head in opened),
        "statuses": sorted({head.split(b" ", 2)[1].decode() for _, head in opened}),
        "refused": refused.decode(errors="replace"),
    }
    print(json.dumps(seen), flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    started = time.monotonic()
    for n, (writer, _) in enumerate(opened):
        writer.close()
        await asyncio.sleep(max(0.0, started + (n + 1) / CLOSE_RATE_PER_S - time.monotonic()))  # pacing the leave
    await asyncio.gather(*(writer.wait_closed() for writer, _ in opened), return_exceptions=True)


async def _park(url: str) -> list[str]:
    """The tasks the streams follow, one more than the cap: submitted a few at a time, as the test's set-up."""
    limits = httpx.Limits(max_connections=SUBMITTING)
    async with httpx.AsyncClient(base_url=url, timeout=10, limits=limits) as client:

        async def one(n: int) -> str:
            body = {"input": f"{PARK}-{n}", "model": "parked", "timeout_ms": 120_000}
            task_id: str = (await client.post("/v1/tasks", json=body)).json()["task_id"]
            return task_id

        return list(await asyncio.gather(*(one(n) for n in range(STREAMS + 1))))


def _attack(service: Service, task_ids: list[str], seen: dict[str, Any]) -> None:
    """The streams from a process of their own at a lower CPU priority: on a small test machine the
    attacker's own CPU use would otherwise be what the probe measures, not the service's."""
    args = [sys.executable, "-m", "tests.adversarial.test_sse", service.url, *task_ids]
    with subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as attacker:
        assert attacker.stdin is not None and attacker.stdout is not None
        line = attacker.stdout.readline()
        assert line, f"the attacker's process ended early (exit {attacker.wait(10)})"
        seen.update(json.loads(line))
        seen["rss_open"] = service.rss_bytes()
        with httpx.Client(base_url=service.url, timeout=10) as client:
            seen["watchers_open"] = _watchers(client)
        attacker.stdin.write("close\n")
        attacker.stdin.flush()
        assert attacker.wait(60) == 0, "the attacker's process failed"


@pytest.mark.parametrize("mode", ["embedded", "kafka"])
def test_many_event_streams_are_bounded_and_their_memory_comes_back(request: pytest.FixtureRequest, mode: str) -> None:
    service = _start(request, mode)
    task_ids = asyncio.run(_park(service.url))
    seen: dict[str, Any] = {}

    # One probe request per call: the streams open over five seconds, and a faster probe meets more of
    # their opening bursts on two shared cores.
    harm = unharmed(service, lambda: _attack(service, task_ids, seen), **ONE_PER_CALL)

    assert seen["statuses"] == ["200"], f"every stream up to the cap opens: {seen['statuses']}"
    assert seen["first_events"] == STREAMS, f"each stream got its task's state first: {seen['first_events']}"
    assert seen["watchers_open"] == STREAMS, f"the gateway counts {seen['watchers_open']} open streams"
    refused = seen["refused"]
    assert refused.startswith("HTTP/1.1 503"), f"one stream beyond --max-watchers is refused: {refused}"
    assert "retry-after" in refused.lower(), refused
    with httpx.Client(base_url=service.url, timeout=10) as client:
        eventually_sync(lambda: _watchers(client) == 0, "the gateway's open streams to go back to 0", timeout_s=30)
        with client.stream("GET", f"/v1/result/{task_ids[0]}/events") as again:
            assert again.status_code == 200, "a new stream opens once the others have gone"
    rss_after = service.rss_bytes()
    print(
        f"\n{mode}: {STREAMS} streams: RSS {harm.rss_before >> 20} MiB before, {seen['rss_open'] >> 20} MiB open, "
        f"{rss_after >> 20} MiB after closing; {harm}"
    )
    assert rss_after - harm.rss_before <= RSS_GROWTH_BYTES, (
        f"RSS after closing the streams is {(rss_after - harm.rss_before) >> 20} MiB over its value before them"
    )


if __name__ == "__main__":
    os.nice(ATTACKER_NICENESS)
    asyncio.run(_streams(sys.argv[1], sys.argv[2:]))
