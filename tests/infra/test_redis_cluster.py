"""A `LocalRedisCluster` that fails to start stops the nodes it started."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from infra.errors import ToolMissingError
from infra.redis_cluster import LocalRedisCluster
from infra.redis_server import redis_pings

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(60)]


def test_a_cluster_that_cannot_be_joined_stops_its_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    found = shutil.which("redis-server")
    assert found is not None, "the test needs redis-server"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "redis-server").symlink_to(found)
    monkeypatch.setenv("PATH", str(bin_dir))  # redis-server without redis-cli: the join fails
    cluster = LocalRedisCluster(tmp_path / "cluster")

    with pytest.raises(ToolMissingError, match="redis-cli not found"), cluster:
        pass

    assert all(not node.is_running() for node in cluster.nodes)
    assert not any(redis_pings(node.port) for node in cluster.nodes), "a node started before the join still runs"
