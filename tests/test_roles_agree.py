"""A role started with settings that must agree across a namespace and differ from a live role's is told at
start: ``--models`` stops a gateway or batcher (the request topic's partitions are split among the models in
list order, so the two would read one model's partitions as another's), and ``--result-ttl-s`` is a warning
for any role (each sets the expiry of the task states it writes)."""

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


async def _live(
    redis_url: str, names: Names, role: str, member_id: str, models: tuple[str, ...], result_ttl_s: float | None = None
) -> None:
    fleet = RedisFleet(redis_url, names)
    await fleet.start()
    try:
        at_ms = int(time.time() * 1000)
        beat = Beat(role, member_id, "other-host", 1, "0", models, "idle", at_ms, 60.0, result_ttl_s=result_ttl_s)
        await fleet.beat([beat])
    finally:
        await fleet.close()


async def _spawned(argv: list[str]) -> asyncio.subprocess.Process:
    """The role ``argv`` starts, with no BATCHWIRE_ variable of this environment, its stderr piped."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWIRE_")}
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "batchwire.cli", *argv, env=env, stderr=asyncio.subprocess.PIPE
    )


async def _started(argv: list[str]) -> tuple[int, str]:
    process = await _spawned(argv)
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


UP = {"gateway": b"Uvicorn running", "batcher": b" up ", "worker": b" up "}
"""A word of each role's log line that says it serves."""


async def _warnings_until_up(role: str, argv: list[str]) -> list[str]:
    """The WARNING lines a role logs until it serves (then it is killed); it must not end first."""
    process = await _spawned(argv)
    warnings = []
    try:
        assert process.stderr is not None
        async with asyncio.timeout(START_S):
            while UP[role] not in (line := await process.stderr.readline()):
                assert line, f"the {role} ended before it served; its warnings: {warnings}"
                if b"WARNING" in line:
                    warnings.append(line.decode())
    finally:
        process.kill()
        await process.wait()
    return warnings


@pytest.mark.parametrize("role", ["gateway", "batcher", "worker"])
async def test_a_role_keeping_results_another_time_than_a_live_one_warns_naming_both(
    infra: Any, names: Names, role: str
) -> None:
    """Each role sets the expiry of the task states it writes, a worker last (at the task's end): started
    silently, a worker on 5 s beside a gateway on 3,600 s had results vanish 5 s after they ended (polls
    404), though the gateway had checked its own TTL against its longest timeout. A warning, not a refusal:
    a rolling restart that changes the TTL passes through such a mix."""
    await _live(infra.redis_url, names, "gateway" if role != "gateway" else "worker", "other-1", ("a",), 3600.0)
    argv = [*_argv(role, infra, names), "--result-ttl-s", "5"]

    warnings = await _warnings_until_up(role, argv)

    [warning] = [line for line in warnings if "--result-ttl-s" in line]
    assert "--result-ttl-s (BATCHWIRE_RESULT_TTL_S) is 5 s" in warning, warning
    assert "other-1 on other-host 3600 s" in warning, warning


async def test_a_role_beside_one_that_states_no_ttl_or_the_same_does_not_warn(infra: Any, names: Names) -> None:
    """A live role whose beat carries no TTL (an earlier release) is no disagreement: the check needs both."""
    await _live(infra.redis_url, names, "gateway", "other-1", ("a",))
    await _live(infra.redis_url, names, "batcher", "other-2", ("a",), 5.0)

    warnings = await _warnings_until_up("worker", [*_argv("worker", infra, names), "--result-ttl-s", "5"])

    assert not [line for line in warnings if "--result-ttl-s" in line], warnings


def _argv(role: str, infra: Any, names: Names) -> list[str]:
    argv = [role, "--namespace", names.namespace, "--models", "a", "--kafka-bootstrap", infra.kafka_bootstrap]
    argv += ["--redis-url", infra.redis_url]
    if role == "gateway":
        return [*argv, "--port", "0", "--max-timeout-ms", "5000", "--default-timeout-ms", "5000"]
    return argv + (["--model", "a", "--backend", "sim"] if role == "worker" else [])
