"""A worker the broker will not admit stops at once, non-zero, saying which setting to change."""

from __future__ import annotations

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
