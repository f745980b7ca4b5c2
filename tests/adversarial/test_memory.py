"""A flood of large asynchronous inputs cannot take the embedded service's memory beyond its budget.

``batchwire up`` runs with a small ``--max-store-bytes`` and two models: the flood goes to ``bulk``,
whose two workers drain far fewer inputs than arrive, while the normal client (the rig's probe)
uses ``sim``. The flood's inputs wait in the queue until ``bulk``'s share of the budget is full,
then its submits get 503 ``overloaded``; its results are kept until newer ones push them out,
oldest first. Two floods in a row: the second must not take RSS past the bound either (memory
the first one used is given back or reused).

The bound is the budget plus the rig's 50 MB: besides what the budget counts, the process holds
the batches in its workers' hands (two models, two workers each, a few 2-input batches of 256 KiB
inputs and outputs) and the bodies being read from the flood's connections.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.support.adversarial_rig import RSS_GROWTH_BYTES, Service, ServiceFactory, attacker_output, unharmed
from tests.support.eventually import eventually_sync

pytestmark = [pytest.mark.slow, pytest.mark.timing, pytest.mark.timeout(300)]

BUDGET_BYTES = 32 * 2**20
INPUT_CHARS = 256 * 1024
MAX_BATCH = 2
FLOOD_REQUESTS = 600
FLOOD_RATE_PER_S = 80.0
"""Twice what ``bulk`` drains (two workers, ``MAX_BATCH`` inputs per 100 ms call), so its queue
grows and fills its share of the budget within seconds; paced, so that what the probe measures is
the service's work for the flood and not the attacker's own CPU use on a small test machine."""
FLOOD_CONNECTIONS = 6
ATTACKER_NICENESS = 10
FLOOD_MAX_S = 30.0
RSS_BOUND_BYTES = BUDGET_BYTES + RSS_GROWTH_BYTES


@dataclass
class Flood:
    """What the flood's submits got back, in the order they were answered.

    The flood runs in a process of its own at a lower CPU priority: on a small test machine the
    attacker's own CPU use would otherwise be what the probe measures, not the service's."""

    accepted: list[str] = field(default_factory=list)
    refusals: list[dict[str, Any]] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    def run(self, url: str, tag: str) -> None:
        for line in attacker_output("tests.adversarial.test_memory", url, tag, timeout_s=FLOOD_MAX_S + 30).splitlines():
            kind, _, rest = line.partition(" ")
            if kind == "accepted":
                self.accepted.append(rest)
            elif kind == "refused":
                self.refusals.append(json.loads(rest))
            else:
                self.unexpected.append(rest)


async def _flood(url: str, tag: str) -> None:
    """Sends the flood, printing one line per answer (``accepted <id>``, ``refused <json>``, ``other ...``)."""
    padding = b"z" * (INPUT_CHARS - 16)
    sent = iter(range(FLOOD_REQUESTS))
    start = time.monotonic()
    stop_at = start + FLOOD_MAX_S
    limits = httpx.Limits(max_connections=FLOOD_CONNECTIONS, max_keepalive_connections=FLOOD_CONNECTIONS)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:

        async def connection() -> None:
            for index in sent:
                if time.monotonic() > stop_at:
                    return
                await asyncio.sleep(start + index / FLOOD_RATE_PER_S - time.monotonic())
                body = b'{"model": "bulk", "input": "' + f"{tag}{index:015d}".encode()[:16] + padding + b'"}'
                response = await client.post("/v1/tasks", content=body, headers={"content-type": "application/json"})
                if response.status_code == 202:
                    print("accepted", response.json()["task_id"], flush=True)
                elif response.status_code == 503:
                    refusal = {"error": response.json()["error"], "retry_after": response.headers.get("retry-after")}
                    print("refused", json.dumps(refusal), flush=True)
                else:
                    print("other", response.status_code, response.text[:200].replace("\n", " "), flush=True)

        await asyncio.gather(*(connection() for _ in range(FLOOD_CONNECTIONS)))


def _started(factory: ServiceFactory) -> Service:
    return factory(
        "--models",
        "sim,bulk",
        "--max-batch",
        str(MAX_BATCH),
        "--max-store-bytes",
        str(BUDGET_BYTES),
        "--max-input-chars",
        str(INPUT_CHARS),
        "--max-body-bytes",
        str(INPUT_CHARS + 1024),
    )


def _result(service: Service, task_id: str) -> httpx.Response:
    return httpx.get(f"{service.url}/v1/result/{task_id}", timeout=10)


def test_a_flood_of_large_inputs_is_held_to_the_memory_budget(embedded_service_factory: ServiceFactory) -> None:
    service = _started(embedded_service_factory)
    rss_start = service.rss_bytes()

    first = Flood()
    harm = unharmed(service, lambda: first.run(service.url, "a"), rss_growth_bytes=RSS_BOUND_BYTES)

    assert first.unexpected == [], f"the flood got answers other than 202 and 503: {first.unexpected[:3]}"
    assert len(first.accepted) * INPUT_CHARS > BUDGET_BYTES, f"the flood never filled the budget: {harm}"
    assert first.refusals, f"the flood was never refused: {len(first.accepted)} accepted; {harm}"
    refusal = first.refusals[0]
    error = refusal["error"]
    assert error["code"] == "overloaded", refusal
    assert "BATCHWIRE_MAX_STORE_BYTES" in error["message"] and "'bulk'" in error["message"], error
    assert int(refusal["retry_after"]) >= 1, f"a 503 says when to retry: {refusal}"

    # Ended results go oldest first: the flood's first task is gone, its latest still answers.
    oldest, latest = first.accepted[0], first.accepted[-1]
    eventually_sync(
        lambda: _result(service, oldest).status_code == 404, "the oldest result to be evicted", timeout_s=30
    )
    assert _result(service, oldest).json()["error"]["code"] == "task_not_found"
    recent = _result(service, latest)
    assert recent.status_code == 200, f"the latest task must still answer: {recent.text}"

    second = Flood()
    again = unharmed(service, lambda: second.run(service.url, "b"), rss_growth_bytes=RSS_BOUND_BYTES)
    assert second.refusals and second.unexpected == [], f"{len(second.refusals)} refused; {second.unexpected[:3]}"
    grown = again.rss_peak - rss_start
    assert grown <= RSS_BOUND_BYTES, (
        f"a second flood took RSS {grown >> 20} MiB above its start, over the bound of {RSS_BOUND_BYTES >> 20} MiB: "
        f"first {harm}; second {again}"
    )


if __name__ == "__main__":
    os.nice(ATTACKER_NICENESS)
    asyncio.run(_flood(sys.argv[1], sys.argv[2]))
