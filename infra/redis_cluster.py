"""A Redis Cluster on loopback: primaries, each with replicas, from Debian's `redis-server`, joined
by `redis-cli --cluster create` (which spreads the 16,384 slots evenly over the primaries).

Its URL is `redis+cluster://127.0.0.1:P1,127.0.0.1:P2,...`, every node a startup node: a client
asks any of them for the slot map (`transport.redis.pools`).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from types import TracebackType

import redis

from infra.errors import ServiceStartError, ToolMissingError
from infra.ports import LOOPBACK
from infra.redis_sentinel import no_retry
from infra.redis_server import RedisServer

CLUSTER_SCHEME = "redis+cluster"
"""The scheme ``transport.redis.pools`` reads; written here too because infra sits below transport
(tests/contract/test_redis_pools.py checks that the two agree)."""
_POLL_INTERVAL_S = 0.05


def cluster_url(ports: list[int]) -> str:
    return f"{CLUSTER_SCHEME}://" + ",".join(f"{LOOPBACK}:{port}" for port in ports)


def _cluster_ok(port: int) -> bool:
    """Whether the node on ``port`` sees every slot served (``CLUSTER INFO``)."""
    client = redis.Redis(port=port, socket_timeout=1.0, socket_connect_timeout=1.0, retry=no_retry())
    try:
        info = client.cluster("INFO")
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()
    return bool(info.get("cluster_state") == "ok" and str(info.get("cluster_slots_ok")) == "16384")


def _online_replicas(port: int) -> int:
    """The replicas the node on ``port`` serves that have their first copy (0 for a replica node)."""
    client = redis.Redis(port=port, socket_timeout=1.0, socket_connect_timeout=1.0, retry=no_retry())
    try:
        info = client.info("replication")
    except (redis.RedisError, OSError):
        return 0
    finally:
        client.close()
    connected = (info.get(f"slave{index}") for index in range(int(info.get("connected_slaves", 0))))
    return sum(1 for replica in connected if isinstance(replica, dict) and replica.get("state") == "online")


def create(ports: list[int], replicas: int, deadline: float) -> None:
    """Joins the fresh nodes on ``ports`` into one cluster (``redis-cli --cluster create``), each
    primary with ``replicas`` replicas, the slots spread evenly over the primaries."""
    cli = shutil.which("redis-cli")
    if cli is None:
        raise ToolMissingError("redis-cli not found on PATH; install it (Debian: apt-get install redis-tools)")
    addresses = [f"{LOOPBACK}:{port}" for port in ports]
    created = subprocess.run(
        [cli, "--cluster", "create", *addresses, "--cluster-replicas", str(replicas), "--cluster-yes"],
        capture_output=True,
        text=True,
        timeout=max(1.0, deadline - time.monotonic()),
        check=False,
    )
    if created.returncode != 0:
        raise ServiceStartError(f"redis-cli --cluster create failed:\n{created.stdout}\n{created.stderr}")


def wait_whole(ports: list[int], replicas: int, deadline: float) -> None:
    """Returns once every node on ``ports`` sees every slot served and ``replicas`` replicas hold
    their first copy."""
    while not all(_cluster_ok(port) for port in ports):
        if time.monotonic() > deadline:
            raise ServiceStartError(f"the Redis Cluster on ports {ports} does not serve every slot")
        time.sleep(_POLL_INTERVAL_S)
    while sum(_online_replicas(port) for port in ports) < replicas:
        if time.monotonic() > deadline:
            raise ServiceStartError(f"the Redis Cluster's replicas on ports {ports} did not sync")
        time.sleep(_POLL_INTERVAL_S)


class LocalRedisCluster:
    """``primaries`` primaries and ``replicas`` replicas of each, in ``work_dir/node-N``; started
    and joined by ``start``, which returns once every slot is served and every replica holds its
    first copy; stopped by ``stop`` (or as a context manager)."""

    def __init__(self, work_dir: Path, *, primaries: int = 3, replicas: int = 0) -> None:
        if primaries < 3:
            raise ValueError(f"a Redis Cluster needs at least 3 primaries, got {primaries}")
        self.replicas = replicas
        self.nodes = [
            RedisServer(work_dir / f"node-{index}", cluster=True) for index in range(primaries * (1 + replicas))
        ]

    @property
    def url(self) -> str:
        return cluster_url([node.port for node in self.nodes])

    def primary_ports(self) -> list[int]:
        """The ports of the nodes that are primaries now (a failover moves the role)."""
        ports = []
        for node in self.nodes:
            with redis.Redis(port=node.port) as client:
                if client.info("replication")["role"] == "master":
                    ports.append(node.port)
        return ports

    def start(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        try:
            for node in self.nodes:
                node.start()
            ports = [node.port for node in self.nodes]
            create(ports, self.replicas, deadline)
            wait_whole(ports, len(self.nodes) - len(self.nodes) // (1 + self.replicas), deadline)
        except BaseException:
            self.stop()  # the nodes started so far; `__exit__` does not run when `__enter__` raises
            raise

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> LocalRedisCluster:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()
