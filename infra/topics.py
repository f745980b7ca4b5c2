"""Create Kafka topics up front (the broker does not auto-create them) and wait until usable."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

from aiokafka.admin import AIOKafkaAdminClient, NewTopic  # type: ignore[import-untyped, unused-ignore]
from aiokafka.errors import (  # type: ignore[import-untyped, unused-ignore]
    KafkaError,
    TopicAlreadyExistsError,
    for_code,
)

from infra.errors import InfraError

_POLL_INTERVAL_S = 0.05


class TopicError(InfraError):
    """A topic could not be created, or exists with another partition count."""


async def ensure_topics(
    bootstrap: str,
    topics: Mapping[str, int],
    *,
    timeout_s: float = 30.0,
) -> None:
    """Make each topic exist with the given partition count (replication factor 1).

    Idempotent: existing topics with the right count are left alone; one with a different
    count is an error, since silently using it would break partition-based assumptions.
    Returns once metadata shows every partition of every topic with a leader, so a producer
    started right after does not meet "unknown topic" or "leader not available".
    """
    if not topics:
        return
    deadline = time.monotonic() + timeout_s
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, client_id="batchwire-infra-topics")
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [
            NewTopic(name, num_partitions=count, replication_factor=1)
            for name, count in topics.items()
            if name not in existing
        ]
        if missing:
            response = await admin.create_topics(missing)
            _raise_for_create_errors(response.topic_errors)
        await _wait_until_led(admin, topics, deadline)
    finally:
        await admin.close()


def _raise_for_create_errors(topic_errors: list[tuple[object, ...]]) -> None:
    for entry in topic_errors:
        name, code = entry[0], entry[1]
        if not isinstance(code, int) or code == 0:
            continue
        error_type = for_code(code)
        if error_type is TopicAlreadyExistsError:
            # Created concurrently by another process: fine, the count is checked below.
            continue
        detail = entry[2] if len(entry) > 2 and entry[2] else error_type.__name__
        raise TopicError(f"could not create topic {name!r}: {detail}")


async def _wait_until_led(admin: AIOKafkaAdminClient, topics: Mapping[str, int], deadline: float) -> None:
    pending = dict(topics)
    while True:
        try:
            described = await admin.describe_topics(list(pending))
        except KafkaError:
            described = []
        for topic in described:
            name = topic.get("topic")
            if name not in pending or topic.get("error_code") != 0:
                continue
            partitions = topic.get("partitions") or []
            if len(partitions) != pending[name] and partitions:
                raise TopicError(
                    f"topic {name!r} exists with {len(partitions)} partitions; wanted "
                    f"{pending[name]} (delete it or use the existing count)"
                )
            if len(partitions) == pending[name] and all(
                part.get("error_code") == 0 and part.get("leader", -1) >= 0 for part in partitions
            ):
                del pending[name]
        if not pending:
            return
        if time.monotonic() >= deadline:
            raise TopicError(f"topics without leaders after the deadline: {sorted(pending)}")
        await asyncio.sleep(_POLL_INTERVAL_S)
