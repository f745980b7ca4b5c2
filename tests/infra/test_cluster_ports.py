"""A fresh Kafka cluster one of whose drawn ports another process binds first starts on new ports.

``stack up --brokers N`` draws every node's ports before the JVMs bind them; another process may take
one in between (the test suite starts servers on many workers at once). Every node knows every
controller's address, so the whole cluster starts again on ports drawn anew.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra import cluster_stack
from infra.cluster_stack import Shape, cluster_up
from infra.kafka_probe import wait_for_kafka
from infra.stack import KAFKA_ENV
from tests.support.stack_cli import discard_stack

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port another process's listener holds."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen(1)
        yield squatter.getsockname()[1]


def test_a_kafka_port_taken_before_its_node_binds_it_starts_the_cluster_on_new_ports(
    tmp_path: Path, taken_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    state_dir = tmp_path / "state"
    draw = cluster_stack._fresh_ports
    kafka_draws: list[list[int]] = []

    def first_draw_taken(count: int, taken: set[int]) -> list[int]:
        ports = draw(count, taken)
        if count == 6:  # the Kafka nodes' broker and controller ports (3 nodes)
            if not kafka_draws:
                ports[0] = taken_port  # the first node's broker port, bound by another process meanwhile
            kafka_draws.append(ports)
        return ports

    monkeypatch.setattr(cluster_stack, "_fresh_ports", first_draw_taken)
    try:
        env, actions = cluster_up(state_dir, Shape(brokers=3, redis_replicas=0), redis_maxmemory="64mb", timeout_s=150)
        assert len(kafka_draws) == 2, f"one start on the taken port, one on new ports: {kafka_draws}"
        bootstrap = env[KAFKA_ENV]
        assert str(taken_port) not in bootstrap, f"the taken port {taken_port} is not the cluster's: {bootstrap}"
        for address in bootstrap.split(","):
            assert wait_for_kafka(address, timeout_s=30), f"node {address} serves"
        assert sum("kafka" in action and "started empty" in action for action in actions) == 3, actions
    finally:
        discard_stack(state_dir)
