"""Roles that cannot run stop at once, non-zero, saying why: a worker the broker will not admit, a
gateway whose port is taken."""

from __future__ import annotations

import socket
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.kafka]


def test_a_session_timeout_the_broker_refuses_ends_the_worker_with_a_clear_message(tmp_path: Path, infra: Any) -> None:
    cluster = Cluster(tmp_path, infra.kafka_bootstrap, infra.redis_url, f"c{uuid.uuid4().hex[:8]}")
    # the session's broker allows 1000 ms and up (group.min.session.timeout.ms)
    proc = cluster.worker(0, "--session-timeout-ms", "500")
    assert proc.popen is not None
    code = proc.popen.wait(60)
    log = proc.tail(60)
    assert code not in (0, None), f"the worker must not run without a group, exited {code}"
    assert "refuses session_timeout_ms=500" in log and "BATCHWIRE_SESSION_TIMEOUT_MS" in log, log


def test_a_gateway_whose_port_is_taken_exits_at_once_saying_so(tmp_path: Path, infra: Any) -> None:
    """uvicorn finds the port taken only after the app has started, so the gateway's parts (its
    background readers of Redis among them) are stopped mid-flight; each start must still end the
    process promptly, non-zero, rather than leave it waiting on a reader that lost its cancellation."""
    cluster = Cluster(tmp_path, infra.kafka_bootstrap, infra.redis_url, f"c{uuid.uuid4().hex[:8]}")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for attempt in range(3):
            proc = cluster.spawn(f"gateway{attempt}", "gateway", "--port", str(port))
            assert proc.popen is not None
            try:
                code = proc.popen.wait(30)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()
                pytest.fail(f"start {attempt}: still running 30 s after failing to bind:\n{proc.tail(20)}")
            log = proc.tail(20)
            assert code != 0, f"start {attempt}: exited 0 without serving:\n{log}"
            assert "address already in use" in log, log
