"""Settings every role shares: where Kafka and Redis are, the namespace, the served models."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from schemas.wire import DEFAULT_BATCH_PARTITIONS, DEFAULT_NAMESPACE, DEFAULT_REQUEST_PARTITIONS, Names
from transport.redis.pools import CLUSTER_SCHEME, redacted, unanswered
from transport.redis.sentinel import FORM, SentinelError, check_sentinels, is_sentinel_url

STACK_ENV = Path(".batchwire") / "stack.env"
MAX_PARTITIONS = 10_000
"""The most partitions a topic is given (by a role, or ``topics grow``): Kafka adds no more than this in one
request; asked for more, it adds some, which nothing can take back, and answers with an error. A worker owns
at least one batch partition, and ``batchwire plan`` sizes at most this many workers of a model."""


class SettingsError(ValueError):
    """A setting is missing or wrong; the message names the flag and the variable."""


@dataclass(frozen=True, slots=True)
class SharedSettings:
    namespace: str = DEFAULT_NAMESPACE
    models: tuple[str, ...] = ("sim",)
    request_partitions: int = DEFAULT_REQUEST_PARTITIONS
    batch_partitions: int = DEFAULT_BATCH_PARTITIONS
    result_ttl_s: float = 3600.0
    kafka_bootstrap: str | None = None
    redis_url: str | None = None

    def __post_init__(self) -> None:
        if not _wire_name(self.namespace):
            raise SettingsError(
                f"namespace {self.namespace!r} must be one or more letters, digits, -, _ and . (it begins every "
                "Kafka topic's name and every Redis key) (--namespace / BATCHWIRE_NAMESPACE)"
            )
        if not self.models:
            raise SettingsError("at least one model must be served (--models / BATCHWIRE_MODELS)")
        for model in self.models:
            if not _wire_name(model):
                raise SettingsError(
                    f"model name {model!r} may hold only letters, digits, -, _ and . (--models / BATCHWIRE_MODELS)"
                )
        if len(set(self.models)) != len(self.models):
            # As the gateway refuses it: a batcher that split the request topic over a repeated model
            # would count another range of partitions as its model's than the gateways send it to.
            raise SettingsError(
                f"models (BATCHWIRE_MODELS) lists a model twice: {', '.join(self.models)}; name each once (--models)"
            )
        if self.request_partitions < len(self.models):
            raise SettingsError(
                f"request_partitions ({self.request_partitions}) must be at least the number of models "
                f"({len(self.models)}) so each model has partitions of its own (BATCHWIRE_REQUEST_PARTITIONS)"
            )
        if self.batch_partitions < 1:
            raise SettingsError(
                f"batch_partitions must be at least 1 (one per worker of a model), got {self.batch_partitions} "
                "(BATCHWIRE_BATCH_PARTITIONS)"
            )
        for flag, count, least in (
            ("--request-partitions (BATCHWIRE_REQUEST_PARTITIONS)", self.request_partitions, len(self.models)),
            ("--batch-partitions (BATCHWIRE_BATCH_PARTITIONS)", self.batch_partitions, 1),
        ):
            if count > MAX_PARTITIONS:
                raise SettingsError(
                    f"{flag} is {count}; it must be from {least} to {MAX_PARTITIONS:,}: Kafka creates no more "
                    "partitions than that in one request"
                )
        if not self.result_ttl_s > 0:
            raise SettingsError(f"result_ttl_s must be positive, got {self.result_ttl_s} (BATCHWIRE_RESULT_TTL_S)")

    @property
    def names(self) -> Names:
        return Names(self.namespace)

    def require_kafka(self) -> str:
        if not self.kafka_bootstrap:
            raise SettingsError(
                "Kafka is not configured: pass --kafka-bootstrap HOST:PORT or set BATCHWIRE_KAFKA_BOOTSTRAP "
                f"(`batchwire stack up` starts a local broker and writes .batchwire/stack.env; {_stack_file_read()})"
            )
        check_kafka_bootstrap(self.kafka_bootstrap)
        return self.kafka_bootstrap

    def require_redis(self) -> str:
        if not self.redis_url:
            raise SettingsError(
                "Redis is not configured: pass --redis-url redis://HOST:PORT/0 or set BATCHWIRE_REDIS_URL "
                f"(`batchwire stack up` starts a local server and writes .batchwire/stack.env; {_stack_file_read()})"
            )
        check_redis_url(self.redis_url)
        return self.redis_url


def _wire_name(text: str) -> bool:
    """Whether ``text`` may go into Kafka topic names (ASCII letters, digits, ``-``, ``_``, ``.``)."""
    return bool(text) and all((c.isascii() and c.isalnum()) or c in "-_." for c in text)


REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", CLUSTER_SCHEME)
CLUSTER_FORM = f"{CLUSTER_SCHEME}://HOST:PORT[,HOST:PORT...]"


def check_kafka_bootstrap(bootstrap: str) -> None:
    """Stops a role when an address of ``bootstrap`` has a port that is no port: aiokafka would raise
    a bare ValueError from deep in its connection code. A host without a port is Kafka's 9092."""
    for address in bootstrap.split(","):
        host, colon, port = address.strip().rpartition(":")
        if ":" in host and not host.endswith("]"):
            continue  # an IPv6 address without brackets, so without a port
        if colon and not (host and port.isdigit() and 0 < int(port) <= 65535):
            raise SettingsError(
                f"Kafka bootstrap address {address.strip()!r} is not HOST:PORT with a port from 1 to 65535; "
                "the form is HOST:PORT[,HOST:PORT...] (--kafka-bootstrap / BATCHWIRE_KAFKA_BOOTSTRAP)"
            )


def _check_server_url(url: str) -> None:
    """The port and DB of a ``redis://`` or ``rediss://`` URL: redis-py raises a bare ValueError on a
    port that is no number, and reads a DB that is no number as DB 0."""
    parts = urlsplit(url)
    form = "the form is redis://HOST:PORT/DB (--redis-url / BATCHWIRE_REDIS_URL)"
    try:
        port = parts.port
    except ValueError:  # not a number, or out of range
        port = 0
    if port == 0:
        raise SettingsError(f"Redis URL {redacted(url)!r}: the port must be a number from 1 to 65535; {form}")
    db = parts.path.removeprefix("/")
    if db and not db.isdigit():
        raise SettingsError(f"Redis URL {redacted(url)!r}: the DB {db!r} must be a number; {form}")


def check_redis_url(url: str) -> None:
    """Stops a role at start, before it creates anything, when ``url`` cannot work: a scheme Redis
    clients do not take, a server (or no node of a Redis Cluster) that does not answer, or a Sentinel
    URL that is malformed or names Sentinels or a master that are not there (asked once)."""
    scheme = url.partition("://")[0].lower()
    if scheme not in REDIS_SCHEMES:
        raise SettingsError(
            f"Redis URL {redacted(url)!r}: the scheme must be one of {', '.join(s + '://' for s in REDIS_SCHEMES)}; "
            f"the forms are redis://HOST:PORT/DB, {FORM} and {CLUSTER_FORM} (--redis-url / BATCHWIRE_REDIS_URL)"
        )
    if scheme in ("redis", "rediss"):
        _check_server_url(url)
    if is_sentinel_url(url):
        try:
            check_sentinels(url)
        except SentinelError as err:
            named = "BATCHWIRE_REDIS_URL" in str(err)
            raise SettingsError(str(err) if named else f"{err} (--redis-url / BATCHWIRE_REDIS_URL)") from err
    elif (reason := unanswered(url)) is not None:
        raise SettingsError(
            f"Redis at {redacted(url)} did not answer ({reason}): check --redis-url / BATCHWIRE_REDIS_URL, and that "
            "the server runs (`batchwire stack up` starts a local one)"
        )


def number(text: str) -> float:
    """A float setting's value: NaN and the infinities are refused, since NaN passes no bound check
    (every comparison with it is false) and no duration or rate means infinity."""
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def stack_env_path() -> Path:
    """The stack file the roles read: ``BATCHWIRE_STACK_ENV``, else ``.batchwire/stack.env``."""
    return Path(os.environ.get("BATCHWIRE_STACK_ENV", str(STACK_ENV)))


def _stack_file_read() -> str:
    """Which stack file a role read for an address it lacks: it is relative to the directory the role starts in."""
    path = stack_env_path()
    if "BATCHWIRE_STACK_ENV" in os.environ:
        where = f"{path.absolute()} (BATCHWIRE_STACK_ENV)"
    else:
        where = f"{path.absolute()}: start the role where `stack up` ran, or set BATCHWIRE_STACK_ENV to its stack.env"
    return f"{path.absolute()} names none" if path.is_file() else f"no stack file at {where}"


def stack_env(path: Path | None = None) -> dict[str, str]:
    """``BATCHWIRE_*`` values from ``.batchwire/stack.env`` (written by ``batchwire stack up``)."""
    path = path or stack_env_path()
    values: dict[str, str] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            key, sep, value = line.partition("=")
            if sep and key.strip().startswith("BATCHWIRE_"):
                values[key.strip()] = value.strip()
    return values


def env(name: str, default: str | None = None) -> str | None:
    """A ``BATCHWIRE_*`` variable, else the stack file's value, else ``default``."""
    value = os.environ.get(name)
    if value is not None:
        return value
    return stack_env().get(name, default)
