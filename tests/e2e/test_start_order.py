"""Roles start in any order: a gateway started before any batcher or worker serves at once, quietly."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from tests.support.processes import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.timeout(90)]


async def _group_coordinator_up(bootstrap: str, timeout_s: float = 30.0) -> None:
    """Until the broker coordinates groups (a fresh one does not yet): only then does a gateway's first read
    of its queue depth go on to the batch topics."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                try:
                    await admin.find_coordinator(f"probe-{uuid.uuid4().hex[:8]}")
                    return
                except KafkaError:
                    await asyncio.sleep(0.2)
    finally:
        await admin.close()


def test_a_gateway_started_alone_serves_without_error_lines(tmp_path: Path, infra: Any) -> None:
    """Its queue depth reads the batch topics' end offsets; before a batcher or a worker created them, each
    read was aiokafka retrying a missing topic for its 2 s timeout, one ERROR line each 100 ms."""
    asyncio.run(_group_coordinator_up(infra.kafka_bootstrap))
    cluster = Cluster(tmp_path, infra.kafka_bootstrap, infra.redis_url, f"c{uuid.uuid4().hex[:8]}")
    try:
        log = cluster.gateway().tail(200)
        assert "not found in cluster metadata" not in log, log
    finally:
        cluster.stop()
