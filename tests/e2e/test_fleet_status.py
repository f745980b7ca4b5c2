"""``batchwire status`` against a deployment over Kafka and Redis: two gateways, two batchers, three workers.

Every process beats into the namespace's fleet in Redis, so either gateway shows all seven. The command
runs as a process of its own, as a person runs it: exit 0 while every model has a live batcher and
worker, 1 once the model's workers, or its batchers, are killed with ``kill -9`` (naming the model) or
Kafka is down (the gateway not ready), 2 when the URL answers nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from infra.local_stack import LocalStack
from tests.support.cluster_checks import proc_named
from tests.support.eventually import eventually_sync
from tests.support.processes import Cluster, launch, respawn, stopped_after

EXIT_UNSERVED, EXIT_UNREACHABLE = 1, 2
FLEET = {
    "gateway": {"gw0", "gw1"},
    "batcher": {"batcher0", "batcher1"},
    "worker": {"worker0", "worker1", "worker2"},
}
LIVE = ("idle", "busy")


def status(*args: str) -> subprocess.CompletedProcess[str]:
    """``batchwire status ARGS`` run as a command, outside the deployment's environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWIRE_")}
    return subprocess.run(
        [sys.executable, "-m", "batchwire.cli", "status", *args], capture_output=True, text=True, env=env, timeout=60
    )


def by_role(view: dict[str, Any]) -> dict[str, dict[str, str]]:
    """Each role's members and their states."""
    roles: dict[str, dict[str, str]] = {}
    for member in view["members"]:
        roles.setdefault(member["role"], {})[member["id"]] = member["state"]
    return roles


def wait_for_status(url: str, what: str, holds: Any, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """Runs ``status --url URL --json`` until ``holds(run, view)``; returns that run."""
    runs: list[subprocess.CompletedProcess[str]] = []

    def check() -> bool:
        run = status("--url", url, "--json")
        runs.append(run)
        return run.returncode in (0, EXIT_UNSERVED) and bool(holds(run, json.loads(run.stdout)))

    try:
        eventually_sync(check, what, timeout_s=timeout_s, interval_s=0.2)
    except AssertionError as err:
        last = runs[-1] if runs else None
        raise AssertionError(f"{err}; last run: {last and (last.returncode, last.stdout, last.stderr)}") from None
    return runs[-1]


def whole_fleet_live(run: subprocess.CompletedProcess[str], view: dict[str, Any]) -> bool:
    roles = by_role(view)
    return {role: set(members) for role, members in roles.items()} == FLEET and all(
        state in LIVE for members in roles.values() for state in members.values()
    )


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, infra: Any) -> Iterator[Cluster]:
    base = tmp_path_factory.mktemp("fleet")
    cluster = launch(base, infra.kafka_bootstrap, infra.redis_url, gateways=2, batchers=2, workers=3)
    with stopped_after(request, cluster):
        yield cluster


@pytest.mark.slow
@pytest.mark.kafka
def test_either_gateway_shows_the_whole_fleet(fleet: Cluster) -> None:
    for url in fleet.gateway_urls:
        run = wait_for_status(url, f"2 gateways, 2 batchers and 3 workers, all live, from {url}", whole_fleet_live)
        assert run.returncode == 0, (run.returncode, run.stderr)
        view = json.loads(run.stdout)
        assert view["models"]["sim"]["workers_live"] == 3, view["models"]

        table = status("--url", url)
        assert table.returncode == 0 and table.stderr == "", (table.returncode, table.stderr)
        lines = table.stdout.splitlines()
        assert lines[0].split()[:4] == ["ROLE", "ID", "MODELS", "STATE"], table.stdout
        for role, ids in FLEET.items():
            for member_id in ids:
                row = next((line.split() for line in lines if line.split()[:2] == [role, member_id]), None)
                assert row is not None, f"no row for {role} {member_id} in:\n{table.stdout}"
                assert row[2] == "sim" and row[3] in LIVE, row
        assert "no live worker" not in table.stdout, table.stdout


@pytest.mark.slow
@pytest.mark.kafka
def test_a_model_whose_workers_were_killed_exits_1_and_is_named(fleet: Cluster) -> None:
    url = fleet.gateway_urls[0]
    wait_for_status(url, "the whole fleet live", whole_fleet_live)
    workers = [proc_named(fleet, name) for name in sorted(FLEET["worker"])]
    try:
        for worker in workers:
            worker.kill9()
        run = wait_for_status(
            url,
            "every worker to show as gone",
            lambda run, view: all(state == "gone" for state in by_role(view)["worker"].values()),
        )
        assert run.returncode == EXIT_UNSERVED, (run.returncode, run.stdout)
        assert json.loads(run.stdout)["models"]["sim"]["workers_live"] == 0, run.stdout
        table = status("--url", url)
        assert table.returncode == EXIT_UNSERVED, (table.returncode, table.stderr)
        assert "no live worker for sim" in table.stdout, table.stdout
        for name in FLEET["worker"]:
            row = next(line.split() for line in table.stdout.splitlines() if line.split()[:2] == ["worker", name])
            assert row[3] == "gone", row
    finally:
        for worker in workers:  # the module's fleet whole again for the tests that follow
            respawn(fleet, worker)


def worker_busy_fraction(view: dict[str, Any], worker_id: str) -> float:
    """The busy fraction the live member beating as worker ``worker_id`` last sent (-1: none live)."""
    live = [m for m in view["members"] if m["role"] == "worker" and m["id"] == worker_id and m["state"] != "gone"]
    return float(live[0]["figures"].get("busy_fraction", 0.0)) if live else -1.0


@pytest.mark.slow
@pytest.mark.kafka
def test_a_worker_inside_a_long_call_counts_it_busy_while_it_runs(
    tmp_path: Path, infra: Any, clusters: list[Cluster]
) -> None:
    """A call's time counts toward the busy fraction as it runs, not only once it ends: a worker held by a
    hung call (up to its hang limit) shows nearly all of each second busy, as does one whose calls take
    longer than a beat."""
    hangs = ("--sim-hang-on", "forever", "--expected-latency-ms", "100", "--hang-min-s", "60")
    cluster = launch(
        tmp_path, infra.kafka_bootstrap, infra.redis_url, workers=1, worker_args=(*hangs, "--drain-timeout-s", "1")
    )
    clusters.append(cluster)
    url = cluster.gateway_urls[0]
    created = httpx.post(f"{url}/v1/tasks", json={"input": "hang forever", "timeout_ms": 30000}, timeout=10)
    assert created.status_code == 202, created.text
    wait_for_status(
        url,
        "worker0, inside its hung call, to show it busy most of a beat",
        lambda run, view: (
            worker_busy_fraction(view, "worker0") >= 0.8 and view["models"]["sim"]["busy_fraction"] >= 0.8
        ),
        timeout_s=30,
    )


@pytest.mark.slow
@pytest.mark.kafka
def test_a_fleet_whose_batchers_were_killed_exits_1_and_names_the_model(fleet: Cluster) -> None:
    """With every batcher gone, requests wait on Kafka unbatched while the workers idle: the model is not
    served, as with no worker, and the refusal once it stalls names the missing batchers among the causes."""
    url = fleet.gateway_urls[0]
    wait_for_status(url, "the whole fleet live", whole_fleet_live)
    batchers = [proc_named(fleet, name) for name in sorted(FLEET["batcher"])]
    try:
        for batcher in batchers:
            batcher.kill9()
        run = wait_for_status(
            url,
            "every batcher to show as gone",
            lambda run, view: all(state == "gone" for state in by_role(view)["batcher"].values()),
        )
        assert run.returncode == EXIT_UNSERVED, (run.returncode, run.stdout)
        row = json.loads(run.stdout)["models"]["sim"]
        assert (row["batchers_live"], row["workers_live"]) == (0, 3), row
        table = status("--url", url)
        assert table.returncode == EXIT_UNSERVED, (table.returncode, table.stderr)
        assert "no live batcher for sim" in table.stdout, table.stdout

        waiting = httpx.post(f"{url}/v1/tasks", json={"input": "unbatched", "timeout_ms": 30000}, timeout=10)
        assert waiting.status_code == 202, waiting.text
        answers: list[httpx.Response] = []

        def refused() -> bool:
            answers.append(httpx.post(f"{url}/v1/tasks", json={"input": "unbatched too"}, timeout=10))
            return answers[-1].status_code == 503

        eventually_sync(refused, "the model to stall and its submits to be refused", timeout_s=30, interval_s=0.5)
        error = answers[-1].json()["error"]
        assert error["code"] == "overloaded" and "no batcher" in error["message"], error
    finally:
        for batcher in batchers:  # the module's fleet whole again for the tests that follow
            respawn(fleet, batcher)


@pytest.mark.slow
@pytest.mark.kafka
def test_a_gateway_that_cannot_reach_kafka_exits_1_and_says_why(
    tmp_path_factory: pytest.TempPathFactory, clusters: list[Cluster]
) -> None:
    """Every member still beats into Redis while Kafka is down, and each idles: the fleet alone reads as
    healthy while every submit is refused. The command also reads the gateway's ``/readyz``."""
    with LocalStack(tmp_path_factory.mktemp("private-stack")) as stack:  # a broker of its own to stop
        cluster = launch(tmp_path_factory.mktemp("fleet"), stack.kafka_bootstrap, stack.redis_url, workers=1)
        clusters.append(cluster)
        url = cluster.gateway_urls[0]
        wait_for_status(url, "the fleet served", lambda run, view: run.returncode == 0)
        stack.stop_kafka()
        try:
            run = wait_for_status(url, "status to exit 1 with Kafka down", lambda run, view: run.returncode == 1)
            assert "kafka" in run.stderr, run.stderr
            table = status("--url", url)
            assert table.returncode == EXIT_UNSERVED, (table.returncode, table.stdout)
            assert "the gateway is not ready" in table.stdout and "kafka" in table.stdout, table.stdout
            stack.start_kafka()
            wait_for_status(url, "status to exit 0 once Kafka is back", lambda run, view: run.returncode == 0)
        finally:
            cluster.stop()  # before its Kafka and Redis go


def test_an_unreachable_gateway_exits_2_saying_why(refusing_port: int) -> None:
    url = f"http://127.0.0.1:{refusing_port}"
    for args in (("--url", url), ("--url", url, "--json")):
        run = status(*args)
        assert run.returncode == EXIT_UNREACHABLE, (run.returncode, run.stdout, run.stderr)
        assert run.stdout == "", run.stdout
        assert run.stderr.startswith(f"batchwire status: cannot read the fleet from {url}"), run.stderr


def worker_states(view: dict[str, Any], worker_id: str) -> list[str]:
    """The states of the members that beat as worker ``worker_id``."""
    return [m["state"] for m in view["members"] if m["role"] == "worker" and m["id"] == worker_id]


@pytest.mark.slow
@pytest.mark.kafka
def test_a_worker_running_a_redelivered_batch_shows_busy(tmp_path: Path, infra: Any, clusters: list[Cluster]) -> None:
    """A redelivered batch runs carefully, outside the calls a first delivery queues: the worker that runs
    it beats ``busy`` (and the model counts it busy) for as long as its call runs, here a hung one."""
    hangs = ("--sim-hang-on", "forever", "--expected-latency-ms", "100")
    cluster = launch(
        tmp_path, infra.kafka_bootstrap, infra.redis_url, workers=1, worker_args=(*hangs, "--hang-min-s", "1")
    )
    clusters.append(cluster)
    url = cluster.gateway_urls[0]
    first = proc_named(cluster, "worker0")
    created = httpx.post(f"{url}/v1/tasks", json={"input": "hang forever", "timeout_ms": 30000}, timeout=10)
    assert created.status_code == 202, created.text
    assert first.stopped(30) == 75, "the first worker gives up on its hung call with exit 75"
    # The next worker takes the batch back from Kafka: its second delivery, which it runs with care.
    cluster.worker(1, *hangs, "--hang-min-s", "60", "--drain-timeout-s", "1")
    run = wait_for_status(
        url,
        "worker1, running the redelivered batch's hung call, to show busy",
        lambda run, view: worker_states(view, "worker1") == ["busy"] and view["models"]["sim"]["workers_busy"] == 1,
    )
    assert "is delivered for the 2nd time" in proc_named(cluster, "worker1").tail(80), run.stdout


def member(view: dict[str, Any], role: str, member_id: str, pid: int) -> dict[str, Any]:
    """The member ``role member_id`` whose process is ``pid`` ({} while none)."""
    found = [m for m in view["members"] if (m["role"], m["id"], m["pid"]) == (role, member_id, pid)]
    return found[0] if found else {}


def past_3_beats(view: dict[str, Any], role: str, member_id: str, pid: int) -> bool:
    """Whether that member's last beat is over 3 beats old: a member that only fell silent reads gone by then."""
    return float(member(view, role, member_id, pid).get("age_s", 0.0)) > 3.5


@pytest.mark.slow
@pytest.mark.kafka
def test_a_member_stopped_with_sigterm_shows_stopped_not_gone(
    tmp_path: Path, infra: Any, clusters: list[Cluster]
) -> None:
    """A worker, a batcher and a gateway stopped cleanly beat once more on their way out: each reads
    ``stopped`` (not counted live, no alarm while the others serve) until its record is dropped, so an
    operator tells a planned stop from a crash (``kill -9``, which reads ``gone``)."""
    cluster = launch(tmp_path, infra.kafka_bootstrap, infra.redis_url, gateways=2, batchers=2, workers=2)
    clusters.append(cluster)
    url = cluster.gateway_urls[0]
    wait_for_status(url, "the fleet served", lambda run, view: run.returncode == 0 and len(view["members"]) == 6)
    stopping = {("worker", "worker1"): "worker1", ("batcher", "batcher1"): "batcher1", ("gateway", "gw1"): "gateway1"}
    pids = {key: proc_named(cluster, name).pid for key, name in stopping.items()}
    for name in stopping.values():
        assert proc_named(cluster, name).stop() == 0, f"{name} stops cleanly on SIGTERM"
    run = wait_for_status(
        url,
        "the stopped members' last beats to be over 3 beats old",
        lambda run, view: all(past_3_beats(view, role, i, pids[role, i]) for role, i in stopping),
    )
    view = json.loads(run.stdout)
    shown = {(role, i): member(view, role, i, pids[role, i])["state"] for role, i in stopping}
    assert shown == dict.fromkeys(stopping, "stopped"), shown
    assert run.returncode == 0, (run.returncode, run.stdout, run.stderr)
    row = view["models"]["sim"]
    assert (row["batchers_live"], row["workers_live"]) == (1, 1), row
    table = status("--url", url)
    assert table.returncode == 0, (table.returncode, table.stdout, table.stderr)
    for role, member_id in stopping:
        line = next(line.split() for line in table.stdout.splitlines() if line.split()[:2] == [role, member_id])
        assert line[3] == "stopped", line


@pytest.mark.slow
@pytest.mark.kafka
def test_a_worker_whose_backend_hung_shows_hung_after_it_exits(
    tmp_path: Path, infra: Any, clusters: list[Cluster]
) -> None:
    """A worker stops (exit 75) once its backend call hangs past the hang limit: its last beat says
    ``hung``, which the fleet shows until the record is dropped, instead of going from busy to gone."""
    hangs = ("--sim-hang-on", "forever", "--expected-latency-ms", "100", "--hang-min-s", "1")
    cluster = launch(tmp_path, infra.kafka_bootstrap, infra.redis_url, workers=1, worker_args=hangs)
    clusters.append(cluster)
    url = cluster.gateway_urls[0]
    worker = proc_named(cluster, "worker0")
    created = httpx.post(f"{url}/v1/tasks", json={"input": "hang forever", "timeout_ms": 30000}, timeout=10)
    assert created.status_code == 202, created.text
    assert worker.stopped(30) == 75, "the worker gives up on its hung call with exit 75"
    run = wait_for_status(
        url,
        "the hung worker's last beat to be over 3 beats old",
        lambda run, view: past_3_beats(view, "worker", "worker0", worker.pid),
    )
    view = json.loads(run.stdout)
    assert member(view, "worker", "worker0", worker.pid)["state"] == "hung", view["members"]
    assert (view["models"]["sim"]["workers_live"], run.returncode) == (0, EXIT_UNSERVED), run.stdout
