"""Session-wide infrastructure: one real Kafka broker and Redis server for the whole run.

Which infrastructure (local processes, testcontainers, or external) is chosen by
``infra.select.provide_infra``; each test gets its own namespace (topics and Redis keys), so tests
never see each other's traffic. ``make test`` runs pytest under ``tests.with_stack``, so every
pytest process (the xdist workers included) shares one Kafka and one Redis as external ones.

The tiers (see the Makefile): ``--no-servers`` runs the tests that need neither Kafka nor Redis, and
a test that asks for them there fails, naming the mark it lacks.
"""

from __future__ import annotations

import json
import socket
import statistics
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from schemas.wire import Names
from tests.support.transport_kits import REAL


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--no-servers", action="store_true", help="the check tier: a test that asks for Kafka or Redis fails"
    )
    parser.addoption(
        "--record-durations",
        action="store_true",
        help=f"write each test file's seconds (setup, call and teardown) into {DURATIONS.name} (`make durations`)",
    )


DURATIONS = Path(__file__).parent / "durations.json"
"""Each test file's seconds in the last `make durations`. Files run longest first: xdist hands a whole
file to a worker (``--dist loadfile``), and a run whose long files come last ends with one worker
busy and the others idle."""


def _file_of(nodeid: str) -> str:
    return nodeid.partition("::")[0]


class _DurationRecorder:
    """Sums each file's test seconds as reports reach this process (under xdist, the controller)."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[_file_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if hasattr(session.config, "workerinput"):  # an xdist worker: the controller records
            return
        recorded = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
        recorded.update({name: round(seconds, 1) for name, seconds in self.seconds.items()})
        DURATIONS.write_text(json.dumps(dict(sorted(recorded.items())), indent=1) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("record_durations"):
        config.pluginmanager.register(_DurationRecorder(), "batchwire-durations")


def _longest_files_first(items: list[pytest.Item]) -> None:
    """Sorts ``items`` by their file's recorded seconds, longest first (a file missing from the
    record counts the median); each file's tests keep their order and stay together."""
    recorded: dict[str, float] = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    unknown = statistics.median(recorded.values()) if recorded else 0.0
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(_file_of(item.nodeid), len(first_seen))

    def cost(item: pytest.Item) -> tuple[float, int]:
        name = _file_of(item.nodeid)
        return -recorded.get(name, unknown), first_seen[name]

    items.sort(key=cost)


SERVER_FIXTURES = {
    "infra",
    "redis_url",
    "kafka_bootstrap",
    "local_stack",
    "redis_cluster",
    "replicated_cluster",
    "redis_sentinel",
}
"""Fixtures that hand a test real servers: a test that takes one is marked ``kafka``."""
HF_TESTS = Path(__file__).parent / "backends"
"""The tests that import torch (the hf extra) as they are collected: the Makefile's tiers ignore the
folder where they do not run it, so that no other tier pays for importing torch."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks ``kafka`` every test that takes real servers or runs in the Kafka or Redis mode, and
    ``hf`` every test of ``HF_TESTS``; then puts the longest files first."""
    _longest_files_first(items)
    for item in items:
        if HF_TESTS in item.path.parents:
            item.add_marker(pytest.mark.hf)
        callspec = getattr(item, "callspec", None)
        modes = {str(value) for value in callspec.params.values()} if callspec is not None else set()
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())) or modes & {"kafka", "redis"}:
            item.add_marker(pytest.mark.kafka)


@pytest.fixture(scope="session")
def infra(request: pytest.FixtureRequest) -> Iterator[Any]:
    if request.config.getoption("no_servers"):
        pytest.fail("this test uses Kafka and Redis, which the check tier (--no-servers) has not: mark it kafka")
    from infra.select import provide_infra

    with provide_infra() as provided:
        yield provided


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[str]:
    """A Redis Cluster of three primaries for the whole test run (one per xdist worker that asks): its
    ``redis+cluster://`` URL."""
    if request.config.getoption("no_servers"):
        pytest.fail("this test uses a Redis Cluster, which the check tier (--no-servers) has not: mark it kafka")
    from infra.redis_cluster import LocalRedisCluster

    with LocalRedisCluster(Path(tmp_path_factory.mktemp("redis-cluster"))) as cluster:
        yield cluster.url


@pytest.fixture(scope="session")
def replicated_cluster(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A Redis Cluster of three primaries, each with a replica, for the whole test run (one per xdist
    worker that asks): the ``LocalRedisCluster``. Tests that stop a node run a cluster of their own."""
    if request.config.getoption("no_servers"):
        pytest.fail("this test uses a Redis Cluster, which the check tier (--no-servers) has not: mark it kafka")
    from infra.redis_cluster import LocalRedisCluster

    with LocalRedisCluster(Path(tmp_path_factory.mktemp("replicated-cluster")), replicas=1) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def redis_sentinel(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[str]:
    """A ``redis+sentinel://`` URL: a primary watched by one Sentinel, for the whole test run (one per
    xdist worker that asks). Failover tests run Sentinels of their own."""
    if request.config.getoption("no_servers"):
        pytest.fail("this test uses Redis Sentinel, which the check tier (--no-servers) has not: mark it kafka")
    from tests.support.sentinels import SentinelCluster

    servers = SentinelCluster(Path(tmp_path_factory.mktemp("sentinel")), replicas=0, sentinels=1)
    try:
        servers.start()
        yield servers.url
    finally:
        servers.stop()


KEYED_CLUSTER = "cluster"
KEYED_SENTINEL = "sentinel"


@pytest.fixture(
    params=[
        "memory",
        pytest.param(REAL, marks=pytest.mark.kafka),
        pytest.param(KEYED_CLUSTER, marks=pytest.mark.kafka),
        pytest.param(KEYED_SENTINEL, marks=pytest.mark.kafka),
    ]
)
def keyed_kind(request: pytest.FixtureRequest) -> str:
    """For the Redis transports, which run on a Redis Cluster and behind Sentinel too (the task store,
    the credit pool, the delivery log, the rate limits, the fleet, the answer cache): ``memory``,
    ``real`` (the session's Redis), ``cluster`` (``redis_cluster``) or ``sentinel`` (``redis_sentinel``)."""
    return str(request.param)


@pytest.fixture
def keyed_url(keyed_kind: str, request: pytest.FixtureRequest) -> str | None:
    """The Redis URL of ``keyed_kind``; None in memory."""
    if keyed_kind == KEYED_CLUSTER:
        return str(request.getfixturevalue("redis_cluster"))
    if keyed_kind == KEYED_SENTINEL:
        return str(request.getfixturevalue("redis_sentinel"))
    if keyed_kind == REAL:
        return str(request.getfixturevalue("infra").redis_url)
    return None


@pytest.fixture
def names() -> Names:
    """A fresh namespace: unique topic names and Redis key prefixes for one test."""
    return Names(namespace=f"t{uuid.uuid4().hex[:10]}")


@pytest.fixture
def silent_server() -> Iterator[socket.socket]:
    """A listening loopback socket that takes connections (into the kernel's accept queue) and never
    answers, as a host behind a firewall that drops, or a server that waits for its own protocol."""
    with socket.create_server(("127.0.0.1", 0), backlog=64) as server:
        yield server


@pytest.fixture
def silent_port(silent_server: socket.socket) -> int:
    """``silent_server``'s port."""
    return int(silent_server.getsockname()[1])


@pytest.fixture
def refusing_port() -> Iterator[int]:
    """A loopback port that refuses connections and that no other process can take meanwhile: bound and
    held, never listening (a port found free and let go may be taken by a parallel test's server)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield int(held.getsockname()[1])
