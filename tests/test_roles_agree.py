"""A gateway or batcher started with another ``--models`` list than a live gateway or batcher of its
namespace stops at start: the request topic's partitions are split among the models in list order, so
the two would read one model's partitions as another's."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Any

import pytest

from schemas.heartbeat import Beat
from schemas.wire import Names
from transport.redis.fleet import RedisFleet

pytestmark = pytest.mark.timeout(120)

START_S = 60.0
"""The role's whole start with a refusal (a role that does not refuse runs on: the test fails at this bound)."""


async def _live(redis_url: str, names: Names, role: str, member_id: str, models: tuple[str, ...]) -> None:
    fleet = RedisFleet(redis_url, names)
    await fleet.start()
    try:
        at_ms = int(time.time() * 1000)
        await fleet.beat([Beat(role, member_id, "other-host", 1, "0", models, "idle", at_ms, 60.0)])
    finally:
        await fleet.close()


async def _started(argv: list[str]) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWIRE_")}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "batchwire.cli", *argv, env=env, stderr=asyncio.subprocess.PIPE
    )
    try:
        async with asyncio.timeout(START_S):
            _, err = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode, err.decode()


@pytest.mark.parametrize("role", ["gateway", "batcher"])
async def test_a_role_listing_the_models_in_another_order_than_a_live_one_stops_naming_both(
    infra: Any, names: Names, role: str
) -> None:
    """Silently started, a gateway on b,a beside a batcher on a,b sent b's requests to a's partitions: the
    other gateways counted them as a's queue (refusing a's submits, or reading a as stalled), and a batcher
    judged which model's partitions it held alone from the other list."""
    await _live(infra.redis_url, names, "batcher" if role == "gateway" else "gateway", "other-1", ("a", "b"))
    argv = [role, "--namespace", names.namespace, "--models", "b,a", "--kafka-bootstrap", infra.kafka_bootstrap]
    argv += ["--redis-url", infra.redis_url] + (["--port", "0"] if role == "gateway" else [])

    code, err = await _started(argv)

    assert code == 2, err
    assert "--models (BATCHWIRE_MODELS) is b,a" in err, err
    assert "other-1 on other-host serves a,b" in err, err
    assert "start this role with --models a,b" in err, err
