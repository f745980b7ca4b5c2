"""A batcher frozen (SIGSTOP) with requests in hand past its group session, then resumed: a zombie.

Its partitions, and the requests it held, move to the other batcher while it is frozen. Once it runs
again it finds itself out of the group, gives up what it held (its commit is refused) and rejoins:
every request is answered once, and the resumed batcher serves again without a restart.

Real processes over the session's Kafka and Redis, real signals; the default 3 s group session.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.cluster_checks import logged, proc_named, terminal_events, two_batchers_one_slow_worker
from tests.support.eventually import eventually_sync
from tests.support.http_calls import assert_answered, post_stream
from tests.support.processes import Cluster, TerminalEvents, metric

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

FROZEN_S = 6.0
"""The fault: twice the group session, so the group drops the frozen batcher."""


async def test_a_batcher_frozen_past_its_session_loses_nothing_answers_once_and_serves_again(
    tmp_path: Path, infra: Any, clusters: list[Cluster]
) -> None:
    cluster, port = await two_batchers_one_slow_worker(tmp_path, infra, clusters)
    inputs = [f"zombie-{n}" for n in range(60)]
    joined_before = logged(cluster, "batcher0", "assigned request partitions")
    with TerminalEvents(cluster.redis_url, cluster.namespace) as events:
        sent = asyncio.create_task(post_stream(cluster.gateway_urls[0], inputs, 0.15))
        await asyncio.to_thread(
            eventually_sync,
            lambda: metric(port, "batchwire_batcher_pending") > 0,
            "batcher0 to hold requests",
            timeout_s=20,
        )
        batcher = proc_named(cluster, "batcher0")
        os.kill(batcher.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(FROZEN_S)  # the fault's length, not a synchronisation
        finally:
            os.kill(batcher.pid, signal.SIGCONT)
        thawed_at = time.monotonic()
        responses = await sent
        answered_in = time.monotonic() - thawed_at
        bodies = assert_answered(inputs, responses)
        twice = await terminal_events(cluster, events, [body["task_id"] for body in bodies])
    assert not twice, f"tasks answered twice: {twice}"
    assert batcher.alive(), f"the resumed batcher exited:\n{batcher.tail()}"
    await asyncio.to_thread(
        eventually_sync,
        lambda: logged(cluster, "batcher0", "assigned request partitions") > joined_before,
        "the resumed batcher to rejoin its group and own partitions again",
        timeout_s=30,
    )
    print(f"\nbatcher0 frozen {FROZEN_S:.0f} s holding requests: all answered {answered_in:.1f} s after its thaw")
