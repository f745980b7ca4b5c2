"""Kafka (apache/kafka, KRaft) and Redis in Docker through testcontainers, for machines with Docker.

Imported only when a Docker engine answers (see `infra.select`). Host ports are fixed
(host port = container port for Kafka) so the advertised address stays right and survives a
container restart, which keeps crash tests possible here too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from types import TracebackType

from testcontainers.core.container import DockerContainer
from testcontainers.core.docker_client import DockerClient

from infra.errors import ServiceStartError
from infra.kafka_probe import wait_for_kafka
from infra.kafka_server import BROKER_PROPERTIES, DEFAULT_START_TIMEOUT_S, new_cluster_id
from infra.ports import free_port
from infra.redis_server import redis_pings

KAFKA_IMAGE = "apache/kafka:3.9.1"
REDIS_IMAGE = "redis:7.0"
_INTERNAL_BROKER_PORT = 19092
_CONTROLLER_PORT = 19093
_STOP_TIMEOUT_S = 20
_REDIS_START_TIMEOUT_S = 30.0
# Listener wiring is set per container below; the rest of the local broker's tuning carries over.
_LISTENER_KEYS = frozenset(
    {"inter.broker.listener.name", "controller.listener.names", "listener.security.protocol.map"}
)


def kafka_container_env(*, host: str, port: int, cluster_id: str) -> dict[str, str]:
    """Environment for the apache/kafka image: setting any KAFKA_* drops its defaults, so all of it.

    Three listeners: PLAINTEXT for clients on host:port, BROKER for the broker talking to
    itself inside the container, CONTROLLER for KRaft.
    """
    env = {_env_name(key): value for key, value in BROKER_PROPERTIES.items() if key not in _LISTENER_KEYS}
    env.update(
        {
            "CLUSTER_ID": cluster_id,
            "KAFKA_LISTENERS": (
                f"PLAINTEXT://0.0.0.0:{port},BROKER://0.0.0.0:{_INTERNAL_BROKER_PORT},"
                f"CONTROLLER://0.0.0.0:{_CONTROLLER_PORT}"
            ),
            "KAFKA_ADVERTISED_LISTENERS": (f"PLAINTEXT://{host}:{port},BROKER://localhost:{_INTERNAL_BROKER_PORT}"),
            "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": "PLAINTEXT:PLAINTEXT,BROKER:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "KAFKA_CONTROLLER_LISTENER_NAMES": "CONTROLLER",
            "KAFKA_INTER_BROKER_LISTENER_NAME": "BROKER",
            "KAFKA_CONTROLLER_QUORUM_VOTERS": f"1@localhost:{_CONTROLLER_PORT}",
        }
    )
    return env


def _env_name(key: str) -> str:
    # The image maps KAFKA_FOO_BAR to foo.bar ('_' in a key would be '___'; ours have none).
    return "KAFKA_" + key.replace(".", "_").upper()


class DockerStack:
    """Both containers; `stop_*`/`start_*` stop and start the same container (data kept)."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self._host = DockerClient().host()
        self._kafka_port = free_port()
        self._redis_port = free_port()
        self._kafka = (
            DockerContainer(KAFKA_IMAGE)
            .with_envs(**kafka_container_env(host=self._host, port=self._kafka_port, cluster_id=new_cluster_id()))
            .with_envs(**dict(env or {}))
            .with_bind_ports(self._kafka_port, self._kafka_port)
        )
        self._redis = (
            DockerContainer(REDIS_IMAGE)
            .with_command("redis-server --save '' --appendonly no")
            .with_bind_ports(6379, self._redis_port)
        )

    @property
    def kafka_bootstrap(self) -> str:
        return f"{self._host}:{self._kafka_port}"

    @property
    def redis_url(self) -> str:
        return f"redis://{self._host}:{self._redis_port}/0"

    def start(self) -> None:
        try:
            self._redis.start()
            self._wait_redis()
            self._kafka.start()
            self._wait_kafka()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Remove both containers."""
        try:
            self._kafka.stop()
        finally:
            self._redis.stop()

    def stop_kafka(self) -> None:
        self._kafka.get_wrapped_container().stop(timeout=_STOP_TIMEOUT_S)

    def start_kafka(self) -> None:
        self._kafka.get_wrapped_container().start()
        self._wait_kafka()

    def stop_redis(self) -> None:
        self._redis.get_wrapped_container().stop(timeout=_STOP_TIMEOUT_S)

    def start_redis(self) -> None:
        self._redis.get_wrapped_container().start()
        self._wait_redis()

    def _wait_kafka(self) -> None:
        if not wait_for_kafka(self.kafka_bootstrap, timeout_s=DEFAULT_START_TIMEOUT_S):
            logs = self._kafka.get_wrapped_container().logs(tail=40).decode(errors="replace")
            raise ServiceStartError(f"Kafka container at {self.kafka_bootstrap} did not serve:\n{logs}")

    def _wait_redis(self) -> None:
        if not _poll(lambda: redis_pings(self._redis_port, host=self._host), _REDIS_START_TIMEOUT_S):
            raise ServiceStartError(f"Redis container at {self.redis_url} did not answer PING")

    def __enter__(self) -> DockerStack:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _poll(check: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True
