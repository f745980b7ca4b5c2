"""Several KRaft nodes on loopback that form one cluster: their settings, and what they report.

Each node is a `KafkaServer` (combined controller and broker) with its own node id; all of them
vote in one controller quorum, format their storage with one cluster id, and keep the internal
topics replicated so that losing one node loses no committed offset.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence

from aiokafka.admin import AIOKafkaAdminClient  # type: ignore[import-untyped, unused-ignore]
from aiokafka.admin.config_resource import (  # type: ignore[import-untyped, unused-ignore]
    ConfigResource,
    ConfigResourceType,
)
from aiokafka.errors import KafkaError  # type: ignore[import-untyped, unused-ignore]

from infra.detached import StackCommands
from infra.errors import InfraError
from infra.kafka_server import DEFAULT_JVM_OPTS
from infra.ports import LOOPBACK

OFFSETS_TOPIC = "__consumer_offsets"
_ADMIN_TIMEOUT_S = 5.0
# The group that makes the broker create the offsets topic (a FindCoordinator request does).
_PROBE_GROUP = "batchwire-stack-probe"
_DYNAMIC_TOPIC_CONFIG = 1  # DescribeConfigs config_source: set on this topic
_POLL_INTERVAL_S = 0.1


def cluster_jvm_opts(opts: Sequence[str] = DEFAULT_JVM_OPTS) -> tuple[str, ...]:
    """`opts` with a smaller heap bound: several nodes share a dev box's memory."""
    return tuple("-Xmx256m" if opt.startswith("-Xmx") else opt for opt in opts)


def internal_replication(brokers: int) -> tuple[int, int]:
    """(replication factor, min in-sync replicas) of the internal topics on `brokers` nodes."""
    factor = min(3, brokers)
    return factor, max(1, factor - 1)


LEADER_REBALANCE_CHECK_S = 5
"""How often a cluster's controller moves leaders back to their preferred replicas."""


def node_properties(node_id: int, controller_ports: Mapping[int, int]) -> dict[str, str]:
    """What a cluster node's server.properties sets beyond a lone node's (`BROKER_PROPERTIES`).

    `controller_ports`: node id -> controller port, for every node (all are voters).
    `min.insync.replicas` stays 1 for the broker as a whole: topics are created with their own.
    """
    factor, min_isr = internal_replication(len(controller_ports))
    voters = ",".join(f"{node}@{LOOPBACK}:{port}" for node, port in sorted(controller_ports.items()))
    return {
        "node.id": str(node_id),
        "controller.quorum.voters": voters,
        "offsets.topic.replication.factor": str(factor),
        "transaction.state.log.replication.factor": str(factor),
        "transaction.state.log.min.isr": str(min_isr),
        # The preferred-leader election that gives a restarted broker its partitions back (and with
        # them the group coordinators of __consumer_offsets) runs every 300 s by default: sooner here,
        # so that what follows a broker restart in production happens within a test.
        "leader.imbalance.check.interval.seconds": str(LEADER_REBALANCE_CHECK_S),
        # ...and only for a broker that leads more than 10% fewer partitions than it prefers, by
        # default: the last few to come back could stay away for good. Any imbalance here.
        "leader.imbalance.per.broker.percentage": "0",
    }


async def harden_offsets_topic(
    bootstrap: str, brokers: int, *, commands: StackCommands, timeout_s: float = 30.0
) -> None:
    """Create the offsets topic now and give it `min.insync.replicas` = RF - 1 (idempotent).

    The broker creates it on the first group request, with the broker-wide minimum (1); a
    committed offset then could live on one node only. `commands` act on the stack the cluster is, for
    the error that says what to run.
    """
    _, min_isr = internal_replication(brokers)
    deadline = time.monotonic() + timeout_s
    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap,
        request_timeout_ms=int(_ADMIN_TIMEOUT_S * 1000),
        client_id="batchwire-stack",
    )
    try:
        await admin.start()
        while True:
            try:
                await admin.find_coordinator(_PROBE_GROUP)
                break
            except KafkaError:
                # Not available while the topic is being created and its leaders elected.
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(_POLL_INTERVAL_S)
        [described] = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, OFFSETS_TOPIC)])
        [resource] = described.resources
        entries = {entry[0]: (entry[1], entry[4]) for entry in resource[4]}
        if entries.get("min.insync.replicas", ("", 0))[0] == str(min_isr):
            return
        # AlterConfigs replaces every dynamic setting of the topic: the ones the broker set at
        # creation (compaction above all) go along unchanged.
        configs = {name: value for name, (value, source) in entries.items() if source == _DYNAMIC_TOPIC_CONFIG}
        configs["min.insync.replicas"] = str(min_isr)
        [altered] = await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, OFFSETS_TOPIC, configs)])
        for error in altered.resources:
            if error[0] != 0:
                raise InfraError(f"could not set min.insync.replicas on {OFFSETS_TOPIC}: {error[1] or error[0]}")
    except KafkaError as err:
        # `stack up` reports an InfraError in one line; a KafkaError would end it in a traceback.
        raise InfraError(
            f"could not create {OFFSETS_TOPIC} on the cluster at {bootstrap} and set its min.insync.replicas: {err!r}; "
            f"`{commands.status}` shows which node is down, `{commands.up}` tries again"
        ) from err
    finally:
        await admin.close()


async def partition_leaders(bootstrap: str, *, timeout_s: float = _ADMIN_TIMEOUT_S) -> dict[int, dict[str, list[int]]]:
    """node id -> topic -> the partitions it leads, from the cluster's metadata.

    Empty when the cluster does not answer within `timeout_s` (status must not hang on a dead one).
    """
    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap,
        request_timeout_ms=int(timeout_s * 1000),
        client_id="batchwire-stack-status",
    )
    try:
        async with asyncio.timeout(timeout_s):
            await admin.start()
            names = await admin.list_topics()
            described = await admin.describe_topics(sorted(names)) if names else []
    except (TimeoutError, KafkaError, OSError):
        return {}
    finally:
        await admin.close()
    leaders: dict[int, dict[str, list[int]]] = {}
    for topic in described:
        name = topic.get("topic")
        for part in topic.get("partitions") or []:
            leader = part.get("leader", -1)
            if isinstance(name, str) and isinstance(leader, int) and leader >= 0:
                leaders.setdefault(leader, {}).setdefault(name, []).append(int(part["partition"]))
    for topics in leaders.values():
        for partitions in topics.values():
            partitions.sort()
    return leaders
