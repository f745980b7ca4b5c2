"""`batchwire stack up` on a half-dead stack under a running deployment: a careless operator
`kill -9`s Redis (or Kafka) and runs `stack up` again. It must bring back only the dead server, on
its address and with its data, so the running roles reconnect by themselves and every task they
had accepted still completes.

The stack lives in this test's own state dir, the roles (gateway, batcher, two sim workers) run
over it, and the CLI is run as a subprocess, as an operator runs it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from infra.process import ServiceProcess
from infra.stack import KAFKA_ENV, REDIS_ENV, read_env_file, stack_down, stack_status
from tests.support.eventually import eventually_sync
from tests.support.processes import launch, stopped_after

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

ACCEPTED = 12


def stack_cli(state_dir: Path, action: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("BATCHWIRE_")}
    env["BATCHWIRE_STACK_ENV"] = str(state_dir.parent / "no-stack.env")
    return subprocess.run(
        [sys.executable, "-m", "batchwire.cli", "stack", action, "--state-dir", str(state_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "stack"
    done = stack_cli(path, "up")
    assert done.returncode == 0, done.stderr
    yield path
    stack_down(path)


def kill9(pid: int | None) -> None:
    assert pid is not None
    process = ServiceProcess.attach(pid, [])
    assert process is not None, f"process {pid} is not running"
    os.kill(pid, signal.SIGKILL)
    assert process.wait_exit(10.0), f"process {pid} survived SIGKILL"


def ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def answers(url: str, text: str) -> bool:
    try:
        response = httpx.post(f"{url}/v1/inference", json={"input": text, "timeout_ms": 5000}, timeout=10)
    except httpx.HTTPError:
        return False
    return response.status_code == 200 and response.json().get("output") == text[::-1]


@pytest.mark.parametrize("victim", ["redis", "kafka"])
def test_stack_up_on_a_half_dead_stack_brings_the_running_deployment_back_with_its_tasks(
    victim: str, state_dir: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    env = read_env_file(state_dir / "stack.env")
    before = stack_status(state_dir)
    roles = tmp_path / "roles"
    roles.mkdir()
    cluster = launch(roles, env[KAFKA_ENV], env[REDIS_ENV], workers=2, sim_latency_ms=300)
    with stopped_after(request, cluster):
        url = cluster.gateway_urls[0]
        pids = {proc.name: proc.pid for proc in cluster.procs}
        assert answers(url, "before")
        accepted: dict[str, str] = {}
        for n in range(ACCEPTED):
            response = httpx.post(f"{url}/v1/tasks", json={"input": f"task-{n}", "timeout_ms": 30_000}, timeout=10)
            assert response.status_code == 202, response.text
            accepted[response.json()["task_id"]] = f"task-{n}"

        kill9(getattr(before, victim).pid)  # the tasks are queued or running: some still wait in Kafka
        done = stack_cli(state_dir, "up")

        assert done.returncode == 0, done.stderr
        assert read_env_file(state_dir / "stack.env") == env, "the same addresses the roles hold"
        after = stack_status(state_dir)
        survivor = "kafka" if victim == "redis" else "redis"
        assert getattr(after, survivor).pid == getattr(before, survivor).pid, f"the live {survivor} was touched"
        assert after.healthy, after
        eventually_sync(lambda: ready(url), f"the gateway to be ready again after {victim} came back", timeout_s=60)
        eventually_sync(lambda: answers(url, "after"), "a synchronous request to be answered again", timeout_s=60)

        def completed() -> bool:
            for task_id, text in accepted.items():
                state = httpx.get(f"{url}/v1/result/{task_id}", timeout=10).json()
                if state.get("status") != "completed":
                    return False
                assert state.get("output") == text[::-1], state
            return True

        eventually_sync(completed, f"the {ACCEPTED} tasks accepted before the crash to complete", timeout_s=60)
        ended = [f"{proc.name} exited {proc.stop()}:\n{proc.tail(30)}" for proc in cluster.procs if not proc.alive()]
        assert not ended, "every role runs on; these ended:\n" + "\n".join(ended)
        assert {proc.name: proc.pid for proc in cluster.procs} == pids, "no role was started again"
