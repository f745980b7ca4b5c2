"""Create Kafka topics up front (the broker does not auto-create them), grow them, and wait until usable."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient, NewPartitions, NewTopic  # type: ignore[import-untyped, unused-ignore]
from aiokafka.admin.config_resource import (  # type: ignore[import-untyped, unused-ignore]
    ConfigResource,
    ConfigResourceType,
)
from aiokafka.errors import (  # type: ignore[import-untyped, unused-ignore]
    KafkaError,
    TopicAlreadyExistsError,
    for_code,
)

from infra.topic_checks import Durability, ExistingTopic, Replication, TopicConfigError, TopicError

_POLL_INTERVAL_S = 0.05
BOOTSTRAP_TIMEOUT_S = 10.0
"""How long the admin client waits for each broker address, and for each answer after: Kafka's own clients
give a connection that long to set up (``socket.connection.setup.timeout.ms``); aiokafka's default request
timeout (40 s) would hold a role's start that long at an address that takes connections and never answers.
A request timeout, not a limit on the whole start: the bootstrap tries its addresses one after another, so a
silent one costs that wait and the next is asked."""
BOOTSTRAP_WAIT = f"each address is given {BOOTSTRAP_TIMEOUT_S:.0f} s to answer"
MIN_ISR = "min.insync.replicas"


async def ensure_topics(
    bootstrap: str,
    topics: Mapping[str, int],
    *,
    durability: Durability | None = None,
    exact: Mapping[str, Callable[[int], str]] | None = None,
    settings: Mapping[str, tuple[str, str]] | None = None,
    timeout_s: float = 30.0,
) -> Replication:
    """Make each topic exist with at least the given partition count and the asked replication.

    Every existing topic is checked before any missing one is created: one with fewer partitions,
    a lower replication factor or a lower ``min.insync.replicas`` than asked is a
    ``TopicConfigError`` naming the fix, and nothing is created. A topic named in ``exact`` must also
    have no more partitions than asked (its partitions carry a meaning that follows from the count):
    its function says why, given the count found. ``settings`` names the flag and variable each topic's
    count came from, for the messages. Returns, with the replication
    used, once metadata shows every partition with a leader, so a producer started right after
    does not meet "unknown topic" or "leader not available".
    """
    admin = await _connected(bootstrap)
    try:
        cluster = await admin.describe_cluster()
        asked = (durability or Durability()).resolve(len(cluster.get("brokers") or []), bootstrap)
        if not topics:
            return asked
        deadline = time.monotonic() + timeout_s
        existing = await _describe_existing(admin, list(topics))
        named = settings or {}
        problems = [
            p
            for topic in existing.values()
            for p in topic.problems(topics[topic.name], asked, bootstrap, named.get(topic.name))
        ]
        problems += [
            explain(topic.partitions)
            for name, explain in (exact or {}).items()
            if (topic := existing.get(name)) is not None and topic.partitions > topics[name]
        ]
        if problems:
            raise TopicConfigError("; ".join(problems))
        missing = [
            NewTopic(
                name,
                num_partitions=count,
                replication_factor=asked.replication_factor,
                topic_configs={MIN_ISR: str(asked.min_insync_replicas)},
            )
            for name, count in topics.items()
            if name not in existing
        ]
        if missing:
            response = await admin.create_topics(missing)
            _raise_for_create_errors(response.topic_errors)
        await _wait_until_led(admin, topics, deadline)
        return asked
    finally:
        await admin.close()


async def grow_topics(bootstrap: str, topics: Mapping[str, int], *, timeout_s: float = 30.0) -> dict[str, int]:
    """Adds partitions so each topic has the given count; returns each topic's count before.

    Records already in a topic stay where they are (Kafka only appends partitions). A topic that
    does not exist, or has more partitions than asked (Kafka cannot remove them), is an error,
    found before any topic is grown.
    """
    deadline = time.monotonic() + timeout_s
    admin = await _connected(bootstrap)
    try:
        existing = await _describe_existing(admin, list(topics))
        problems = []
        for name, count in topics.items():
            topic = existing.get(name)
            if topic is None:
                problems.append(
                    f"topic {name!r} does not exist on {bootstrap} (a role or `batchwire stack up` creates it)"
                )
            elif topic.partitions > count:
                problems.append(
                    f"topic {name!r} has {topic.partitions} partitions, more than the {count} asked; Kafka cannot "
                    "remove partitions"
                )
        if problems:
            raise TopicConfigError("; ".join(problems))
        grow = {
            name: NewPartitions(total_count=count)
            for name, count in topics.items()
            if existing[name].partitions < count
        }
        if grow:
            try:
                await admin.create_partitions(grow)
            except KafkaError as err:
                raise TopicError(f"could not add partitions to {sorted(grow)}: {err}") from err
        await _wait_until_led(admin, topics, deadline)
        return {name: existing[name].partitions for name in topics}
    finally:
        await admin.close()


async def group_members(bootstrap: str, group: str, *, timeout_s: float = 30.0) -> int:
    """How many members the consumer group has now (0 when it is empty or unknown).

    A broker on which no group has committed yet answers "coordinator not available" while it creates
    ``__consumer_offsets`` for the question: asked again, it answers.
    """
    deadline = time.monotonic() + timeout_s
    admin = await _connected(bootstrap)
    try:
        while True:
            try:
                described = await admin.describe_consumer_groups([group])
                break
            except KafkaError as err:
                if not err.retriable or time.monotonic() >= deadline:
                    raise TopicError(f"could not read the members of consumer group {group!r}: {err}") from err
            await asyncio.sleep(_POLL_INTERVAL_S)
        groups = [g for response in described for g in response.to_object().get("groups", [])]
        return sum(len(g.get("members") or []) for g in groups if g.get("group") == group)
    finally:
        await admin.close()


async def _connected(bootstrap: str) -> AIOKafkaAdminClient:
    """An admin client connected to ``bootstrap``; a ``TopicError`` that says what to check when no
    broker answers (aiokafka's own error would end the role in a traceback)."""
    admin = admin_client(bootstrap, "batchwire-infra-topics")
    try:
        await admin.start()
    except KafkaError as err:
        await admin.close()
        raise TopicError(
            f"no Kafka broker answered at {bootstrap} ({err}; {BOOTSTRAP_WAIT}): check --kafka-bootstrap / "
            "BATCHWIRE_KAFKA_BOOTSTRAP, and that the brokers run (`batchwire stack up` starts a local one)"
        ) from err
    return admin


def admin_client(bootstrap: str, client_id: str) -> AIOKafkaAdminClient:
    """An admin client of ``bootstrap`` that waits ``BOOTSTRAP_TIMEOUT_S`` for each address and answer."""
    return AIOKafkaAdminClient(
        bootstrap_servers=bootstrap, client_id=client_id, request_timeout_ms=int(BOOTSTRAP_TIMEOUT_S * 1000)
    )


async def _describe_existing(admin: AIOKafkaAdminClient, names: list[str]) -> dict[str, ExistingTopic]:
    present = set(await admin.list_topics())
    wanted = [name for name in names if name in present]
    if not wanted:
        return {}
    min_isr = await _min_insync_replicas(admin, wanted)
    found: dict[str, ExistingTopic] = {}
    for topic in await admin.describe_topics(wanted):
        name = topic.get("topic")
        partitions = topic.get("partitions") or []
        if name not in wanted or topic.get("error_code") != 0 or not partitions:
            continue  # being created by another process right now: creating it too is harmless
        found[name] = ExistingTopic(
            name=name,
            partitions=len(partitions),
            replication_factor=min((len(p.get("replicas") or []) for p in partitions), default=0),
            min_insync_replicas=min_isr.get(name),
        )
    return found


async def _min_insync_replicas(admin: AIOKafkaAdminClient, names: list[str]) -> dict[str, int]:
    resources = [ConfigResource(ConfigResourceType.TOPIC, name, {MIN_ISR: None}) for name in names]
    values: dict[str, int] = {}
    for response in await admin.describe_configs(resources):
        for resource in response.to_object().get("resources", []):
            entries: list[dict[str, Any]] = resource.get("config_entries") or []
            for entry in entries:
                if entry.get("config_names") == MIN_ISR and entry.get("config_value"):
                    values[resource["resource_name"]] = int(entry["config_value"])
    return values


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
            # Fewer than asked: metadata from a broker the change has not reached yet.
            if len(partitions) >= pending[name] and all(
                part.get("error_code") == 0 and part.get("leader", -1) >= 0 for part in partitions
            ):
                del pending[name]
        if not pending:
            return
        if time.monotonic() >= deadline:
            raise TopicError(f"topics without all their partitions led after the deadline: {pending}")
        await asyncio.sleep(_POLL_INTERVAL_S)
