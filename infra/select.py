"""Which Kafka and Redis the integration tests use, chosen once per session.

Order: external addresses from the environment, else Docker through testcontainers when a
Docker engine answers, else the local stack (jars + redis-server). `BATCHWIRE_TEST_INFRA`
forces one of `local`, `docker`, `external`.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from infra.errors import InfraError, NotSupportedError
from infra.local_stack import LocalStack

InfraKind = Literal["local", "docker", "external"]
KINDS: tuple[InfraKind, ...] = ("local", "docker", "external")

FORCE_ENV = "BATCHWIRE_TEST_INFRA"
EXTERNAL_KAFKA_ENV = "BATCHWIRE_TEST_KAFKA_BOOTSTRAP"
EXTERNAL_REDIS_ENV = "BATCHWIRE_TEST_REDIS_URL"
_DEFAULT_DOCKER_SOCKET = "/var/run/docker.sock"


class ServiceControls(Protocol):
    """Stop/start of each service in place (same addresses), as crash tests need."""

    def start_kafka(self) -> None: ...

    def stop_kafka(self) -> None: ...

    def start_redis(self) -> None: ...

    def stop_redis(self) -> None: ...


@dataclass(frozen=True)
class ProvidedInfra:
    """Addresses for tests, plus restart controls when the infrastructure is ours.

    Blocking methods: from async tests call them through `asyncio.to_thread`.
    """

    kind: InfraKind
    kafka_bootstrap: str
    redis_url: str
    controls: ServiceControls | None = None

    @property
    def can_restart(self) -> bool:
        return self.controls is not None

    def stop_kafka(self) -> None:
        self._controls("stop Kafka").stop_kafka()

    def start_kafka(self) -> None:
        self._controls("start Kafka").start_kafka()

    def restart_kafka(self) -> None:
        controls = self._controls("restart Kafka")
        controls.stop_kafka()
        controls.start_kafka()

    def stop_redis(self) -> None:
        self._controls("stop Redis").stop_redis()

    def start_redis(self) -> None:
        self._controls("start Redis").start_redis()

    def restart_redis(self) -> None:
        controls = self._controls("restart Redis")
        controls.stop_redis()
        controls.start_redis()

    def _controls(self, action: str) -> ServiceControls:
        if self.controls is None:
            raise NotSupportedError(
                f"cannot {action}: infrastructure is {self.kind!r}; skip tests that need "
                f"restarts when `can_restart` is False"
            )
        return self.controls


def choose_infra_kind(env: Mapping[str, str] | None = None) -> InfraKind:
    """Apply the selection order (see module doc) to `env` (default: os.environ)."""
    environ = os.environ if env is None else env
    forced = _parse_kind(environ.get(FORCE_ENV, ""))
    if forced is not None:
        if forced == "external":
            missing = [name for name in (EXTERNAL_KAFKA_ENV, EXTERNAL_REDIS_ENV) if not environ.get(name)]
            if missing:
                raise InfraError(f"{FORCE_ENV}=external needs {' and '.join(missing)} to be set")
        if forced == "docker" and not docker_available():
            raise InfraError(f"{FORCE_ENV}=docker but no Docker engine answers (or testcontainers is missing)")
        return forced
    if environ.get(EXTERNAL_KAFKA_ENV) and environ.get(EXTERNAL_REDIS_ENV):
        return "external"
    if docker_available():
        return "docker"
    return "local"


def _parse_kind(value: str) -> InfraKind | None:
    wanted = value.strip().lower()
    if not wanted:
        return None
    for kind in KINDS:
        if kind == wanted:
            return kind
    raise InfraError(f"{FORCE_ENV}={value!r}; expected one of {', '.join(KINDS)}")


def docker_available() -> bool:
    """testcontainers importable and `docker.from_env().ping()` succeeds."""
    if importlib.util.find_spec("testcontainers") is None or importlib.util.find_spec("docker") is None:
        return False
    if not os.environ.get("DOCKER_HOST") and not Path(_DEFAULT_DOCKER_SOCKET).exists():
        # What docker.from_env() would try; no socket, no engine: skip importing the SDK.
        return False
    with warnings.catch_warnings():
        # A failed connect leaves docker-py's socket unclosed; its ResourceWarning would turn
        # into an error under `filterwarnings = error`, so collect it here, silenced.
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            return _docker_pings()
        finally:
            gc.collect()


def _docker_pings() -> bool:
    import docker
    from docker.errors import DockerException

    try:
        client = docker.from_env(timeout=5)
    except DockerException:
        return False
    try:
        return bool(client.ping())
    # requests' errors derive from OSError (IOError); DockerException covers API errors.
    except (DockerException, OSError):
        return False
    finally:
        client.close()


@contextlib.contextmanager
def provide_infra(
    kind: InfraKind | None = None,
    *,
    work_dir: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> Iterator[ProvidedInfra]:
    """Yield running infrastructure for the session; stop what was started on exit."""
    environ = os.environ if env is None else env
    chosen = kind if kind is not None else choose_infra_kind(environ)
    if chosen == "external":
        yield ProvidedInfra(
            kind="external",
            kafka_bootstrap=environ[EXTERNAL_KAFKA_ENV],
            redis_url=environ[EXTERNAL_REDIS_ENV],
        )
    elif chosen == "docker":
        from infra.docker_stack import DockerStack

        with DockerStack() as docker_stack:
            yield ProvidedInfra(
                kind="docker",
                kafka_bootstrap=docker_stack.kafka_bootstrap,
                redis_url=docker_stack.redis_url,
                controls=docker_stack,
            )
    else:
        with LocalStack(work_dir) as local:
            yield ProvidedInfra(
                kind="local",
                kafka_bootstrap=local.kafka_bootstrap,
                redis_url=local.redis_url,
                controls=local,
            )
