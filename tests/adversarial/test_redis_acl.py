"""A Redis whose ACL user loses a command the roles run (``ACL SETUSER default -evalsha``: an operator's
narrowed rights) costs nothing accepted: a worker that cannot store a batch's results holds them and
retries, naming the setting to check, rather than exiting (a supervisor would restart it into the same
refusal, each restart a delivery toward ``--max-deliveries`` for the batch's inputs); once the user may
run the command again, the tasks complete.

Kafka mode only (embedded mode has no Redis). The deployment runs over the session's Kafka and a
PRIVATE redis-server started here, so its ACL changes disturb no other test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from infra.redis_server import RedisServer
from tests.support.eventually import eventually_sync
from tests.support.processes import Cluster, launch, stopped_after
from transport.redis.pools import CREDENTIALS_ADVICE

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

TASKS = 3


def _worker_log(cluster: Cluster) -> str:
    return "\n".join(p.log_path.read_text(errors="replace") for p in cluster.procs if p.name.startswith("worker"))


def _status(url: str, task_id: str) -> dict[str, Any]:
    state: dict[str, Any] = httpx.get(f"{url}/v1/result/{task_id}", timeout=10).json()
    return state


def test_a_worker_refused_its_result_writes_by_an_acl_holds_them_and_stores_them_once_allowed(
    primary: RedisServer, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    infra: Any = request.getfixturevalue("infra")
    cluster = launch(tmp_path, infra.kafka_bootstrap, primary.url, workers=2, sim_latency_ms=1500)
    with stopped_after(request, cluster), redis.Redis.from_url(primary.url) as admin:
        url = cluster.gateway_urls[0]
        accepted: dict[str, str] = {}
        for n in range(TASKS):
            response = httpx.post(f"{url}/v1/tasks", json={"input": f"task-{n}", "timeout_ms": 30_000}, timeout=30)
            assert response.status_code == 202, response.text
            accepted[response.json()["task_id"]] = f"task-{n}"
        eventually_sync(
            lambda: any(_status(url, task_id)["status"] == "running" for task_id in accepted),
            "a worker to take a batch",
        )
        pids = {proc.name: proc.pid for proc in cluster.procs}

        # Every script the roles run (task updates, credits, heartbeats) is refused NOPERM.
        admin.execute_command("ACL", "SETUSER", "default", "-evalsha", "-eval")

        def results_refused() -> bool:
            assert all(proc.alive() for proc in cluster.procs), f"a role exited on a refused ACL:\n{cluster.logs()}"
            return any(
                "storing task states failed" in line and "no permissions" in line and CREDENTIALS_ADVICE in line
                for line in _worker_log(cluster).splitlines()
            )

        eventually_sync(results_refused, "a worker to retry storing its results, saying what to check", timeout_s=30)

        admin.execute_command("ACL", "SETUSER", "default", "+@all")

        def all_completed() -> bool:
            for task_id, text in accepted.items():
                state = _status(url, task_id)
                if state["status"] != "completed":
                    return False
                assert state["output"] == text[::-1], state
            return True

        eventually_sync(all_completed, f"the {TASKS} accepted tasks to complete once the ACL allows", timeout_s=60)
        assert {proc.name: proc.pid for proc in cluster.procs if proc.alive()} == pids, "no process exited"
