"""Process-level behaviour of the Kafka deployment: several gateways share every task."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.support.e2e_system import System
from tests.support.http_calls import collect_events

pytestmark = pytest.mark.slow


async def test_a_task_from_one_gateway_is_polled_and_streamed_from_another(kafka_system: System) -> None:
    first, second = kafka_system.urls[0], kafka_system.urls[1]
    async with httpx.AsyncClient(timeout=30) as client:
        created = (await client.post(f"{first}/v1/tasks", json={"input": "crossing"})).json()
        streamed, polled = await asyncio.gather(
            asyncio.wait_for(collect_events(client, second, created["task_id"]), 20),
            client.get(f"{second}/v1/result/{created['task_id']}", params={"wait": 20}),
        )
    assert polled.json()["output"] == "gnissorc"
    assert streamed[-1][0] == "completed"
    assert streamed[-1][1]["output"] == "gnissorc"
