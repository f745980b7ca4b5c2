"""`python -m tests.with_stack CMD`: a SIGTERM to the runner alone ends CMD and stops the servers."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from infra.kafka_probe import wait_for_kafka
from infra.process import ServiceProcess
from infra.redis_server import redis_pings
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


def test_a_sigterm_that_comes_as_cmd_starts_still_ends_cmd(tmp_path: Path) -> None:
    """CMD signals the runner as its first act, while the runner may still be starting it and not yet
    know it: the signal is passed on to CMD once known, not taken as one that came before any CMD (the
    runner stopped then, and left CMD running)."""
    marker = f"{300 + random.random():.6f}"  # CMD's command line, found by it once the runner is gone
    cmd = f"kill -TERM $PPID; exec sleep {marker}"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    runner = subprocess.Popen([sys.executable, "-m", "tests.with_stack", "sh", "-c", cmd], cwd=ROOT, env=env)
    try:
        runner.wait(timeout=90)
    finally:
        runner.kill()
        runner.wait(10)
    eventually_sync(lambda: not _running(marker), "CMD to end", timeout_s=10)


def _running(marker: str) -> list[int]:
    """The processes whose command line holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:  # gone meanwhile
            continue
    return found
