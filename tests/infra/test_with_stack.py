"""`python -m tests.with_stack CMD`: a SIGTERM to the runner alone ends CMD and stops the servers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from infra.kafka_probe import wait_for_kafka
from infra.process import ServiceProcess
from infra.redis_server import redis_pings
from tests import with_stack
from tests.support.eventually import eventually_sync

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]


def test_a_sigterm_to_the_runner_ends_cmd_and_stops_kafka_and_redis(tmp_path: Path) -> None:
    seen = tmp_path / "seen"
    # CMD records the addresses it was given and its pid, then waits to be ended.
    cmd = f'echo "$BATCHWIRE_TEST_KAFKA_BOOTSTRAP $BATCHWIRE_TEST_REDIS_URL $$" > {seen}.tmp && mv {seen}.tmp {seen}'
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    runner = subprocess.Popen(
        [sys.executable, "-m", "tests.with_stack", "sh", "-c", f"{cmd} && exec sleep 300"], cwd=ROOT, env=env
    )
    try:
        eventually_sync(seen.exists, "CMD to start under the stack", timeout_s=90)
        bootstrap, redis_url, cmd_pid = seen.read_text().split()
        redis_port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
        assert redis_pings(redis_port)

        runner.send_signal(signal.SIGTERM)

        runner.wait(timeout=60)
    finally:
        runner.kill()
        runner.wait(10)
    assert ServiceProcess.attach(int(cmd_pid), []) is None, "CMD still runs"
    assert not redis_pings(redis_port), "Redis still runs"
    assert not wait_for_kafka(bootstrap, timeout_s=0.5), "Kafka still runs"
    assert not list(tmp_path.glob("batchwire-stack-*")), "the stack's temporary folder is left"


class _NoStack:
    """Stands in for the servers: this test is about CMD's start."""

    kafka_bootstrap = "127.0.0.1:1"
    redis_url = "redis://127.0.0.1:1/0"

    def __enter__(self) -> _NoStack:
        return self

    def __exit__(self, *_: object) -> None:
        return None


class _SignalledAsStarted(subprocess.Popen[bytes]):
    """CMD started, and a SIGTERM to the runner before the runner's next step: as a CMD that signals
    it at once, or a CI timeout, can make it come while the runner is still starting CMD."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.timeout(60)
def test_a_sigterm_that_comes_as_cmd_starts_is_passed_on_to_cmd(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not taken as a signal that came before any CMD: the runner stopped then, and left CMD running."""
    monkeypatch.setattr(with_stack, "LocalStack", _NoStack)
    monkeypatch.setattr(with_stack.subprocess, "Popen", _SignalledAsStarted)
    before = signal.getsignal(signal.SIGTERM)
    try:
        status = with_stack.main(["sleep", "300"])
    finally:
        signal.signal(signal.SIGTERM, before)
    assert status == -signal.SIGTERM, f"CMD ended by the SIGTERM passed on, got {status}"
