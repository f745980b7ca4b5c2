"""Kafka topics: the set-up every Kafka role runs before it starts, and the operators' ``topics grow``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from batchwire.settings import MAX_PARTITIONS, SettingsError, SharedSettings
from infra.topic_checks import Durability, TopicError
from infra.topics import ensure_topics, group_members, grow_topics
from transport.ports import TransportError
from transport.redis.fleet import RedisFleet

log = logging.getLogger(__name__)


def durability(args: argparse.Namespace) -> Durability:
    return Durability(args.replication_factor, args.min_insync_replicas)


async def ensure_role_topics(
    shared: SharedSettings,
    wanted: Durability,
    request_topic: bool,
    models: tuple[str, ...],
    *,
    dead_letters: bool = False,
) -> None:
    """Creates the role's topics with the asked replication, after checking them all (exit 2 if one falls
    short, or no broker answers)."""
    names = shared.names
    topics: dict[str, int] = {}
    settings: dict[str, tuple[str, str]] = {}
    if request_topic:
        topics[names.request_topic] = shared.request_partitions
        settings[names.request_topic] = ("--request-partitions", "BATCHWIRE_REQUEST_PARTITIONS")
    for model in models:
        topics[names.batch_topic(model)] = shared.batch_partitions
        settings[names.batch_topic(model)] = ("--batch-partitions", "BATCHWIRE_BATCH_PARTITIONS")
    if dead_letters:
        topics[names.dead_letter_topic] = 1
    exact = {names.request_topic: _request_count_check(shared)} if request_topic else {}
    try:
        await ensure_topics(shared.require_kafka(), topics, durability=wanted, exact=exact, settings=settings)
    except TopicError as err:
        raise SettingsError(str(err)) from err


def _request_count_check(shared: SharedSettings) -> Callable[[int], str]:
    """Why a request topic with more partitions than ``--request-partitions`` stops a gateway or batcher:
    the models' ranges follow from the count, so one on another count than the topic's (the others'
    after `topics grow`) sends a model's requests to, or reads them from, another model's partitions."""

    def explain(found: int) -> str:
        return (
            f"topic {shared.names.request_topic!r} has {found} partitions, and --request-partitions "
            f"(BATCHWIRE_REQUEST_PARTITIONS) is {shared.request_partitions}: each model's range of partitions "
            "follows from the count, so every gateway and batcher uses the topic's; start this role with "
            f"--request-partitions {found}"
        )

    return explain


async def check_settings_agree(shared: SharedSettings, role: str, member_id: str) -> None:
    """Checks a starting role's settings that must agree across its namespace against the live roles'.

    ``--models``, for a gateway or batcher against the others, stops the role (exit 2): the request topic's
    partitions are split among the models in list order, so the two would send a model's requests to, or
    count and read them as, another model's. ``--result-ttl-s``, for every role, is logged as a warning:
    each role sets the expiry of the task states it writes (a worker last, at a task's end), so a shorter
    TTL anywhere drops results before the time the gateways promise; refusing it would leave no rolling
    way to change the TTL. A Redis that does not answer skips the check: the role meets it again at its
    start, and reports it there."""
    fleet = RedisFleet(shared.require_redis(), shared.names)
    members = []
    with contextlib.suppress(TransportError):
        await fleet.start()
        members = await fleet.members()
    await fleet.close()
    now_ms = int(time.time() * 1000)
    others = [b for b in members if (b.role, b.id) != (role, member_id) and b.live(now_ms)]  # not its own restart
    for beat in others:
        if role != "worker" and beat.role in ("gateway", "batcher") and beat.models != shared.models:
            raise SettingsError(
                f"--models (BATCHWIRE_MODELS) is {','.join(shared.models)}, and {beat.role} {beat.id} on "
                f"{beat.host} serves {','.join(beat.models)}: the request topic's partitions are split among the "
                f"models in list order, so every gateway and batcher of namespace {shared.namespace!r} lists the "
                f"same models in the same order; start this role with --models {','.join(beat.models)}, or stop "
                "the others and start every gateway and batcher with the new list"
            )
    ttls = {f"{beat.role} {beat.id} on {beat.host}": beat.result_ttl_s for beat in others if beat.result_ttl_s}
    if differ := {member: ttl for member, ttl in ttls.items() if ttl != shared.result_ttl_s}:
        log.warning(
            "--result-ttl-s (BATCHWIRE_RESULT_TTL_S) is %g s, and live roles of namespace %r keep task states "
            "another time: %s. Each role sets the expiry of the states it writes (a worker last, at a task's "
            "end), so results are kept the time of whichever wrote last; while changing the TTL, restart "
            "every gateway, batcher and worker with the new one",
            shared.result_ttl_s,
            shared.namespace,
            ", ".join(f"{member} {ttl:g} s" for member, ttl in sorted(differ.items())),
        )


async def _grow(
    bootstrap: str, request_topic: str, batcher_group: str, topics: dict[str, int], request: int | None
) -> dict[str, int]:
    try:
        return await _grow_checked(bootstrap, request_topic, batcher_group, topics, request)
    except TopicError as err:
        raise SettingsError(str(err)) from err


async def _grow_checked(
    bootstrap: str, request_topic: str, batcher_group: str, topics: dict[str, int], request: int | None
) -> dict[str, int]:
    if request is not None:
        batchers = await group_members(bootstrap, batcher_group)
        if batchers:
            raise SettingsError(
                f"not growing {request_topic}: {batchers} batcher(s) are running. Its partitions are split "
                "among the models by their count, so a new count moves partitions from one model to another, "
                "and every gateway and batcher must use it together (a batcher reads a new partition only after "
                "its metadata refresh, minutes later). Stop the gateways and batchers, run this again, then start "
                f"them with --request-partitions {request} (workers may keep running)"
            )
    return await grow_topics(bootstrap, topics)


def _check_count(flag: str, count: int | None, least: int) -> None:
    """Refuses a count no topic can have before Kafka is asked, naming the flag."""
    if count is not None and not least <= count <= MAX_PARTITIONS:
        raise SettingsError(f"{flag} is {count}; it must be from {least} to {MAX_PARTITIONS:,}")


def run_topics(args: argparse.Namespace) -> int:
    """``topics grow``: adds partitions to the batch topics (safe live) and the request topic (only with no batcher)."""
    names = SharedSettings(namespace=args.namespace, models=tuple(args.models)).names
    _check_count("--batch-partitions", args.batch_partitions, 1)
    # each model has request partitions of its own
    _check_count("--request-partitions", args.request_partitions, len(args.models))
    bootstrap = SharedSettings(kafka_bootstrap=args.kafka_bootstrap).require_kafka()
    topics = {names.batch_topic(m): args.batch_partitions for m in args.models if args.batch_partitions is not None}
    if args.request_partitions is not None:
        topics[names.request_topic] = args.request_partitions
    if not topics:
        raise SettingsError("topics grow: name a count, --batch-partitions N and/or --request-partitions N")
    before = asyncio.run(_grow(bootstrap, names.request_topic, names.batcher_group, topics, args.request_partitions))
    for name, count in topics.items():
        print(
            f"{name}: {before[name]} -> {count} partitions" if before[name] < count else f"{name}: {count} partitions"
        )
    if args.batch_partitions is not None:
        print(f"start new roles with --batch-partitions {args.batch_partitions}; running ones keep working")
    if args.request_partitions is not None:
        # Gateways are in no consumer group, so the check before the grow could not see them running.
        print(
            f"restart every gateway and batcher with --request-partitions {args.request_partitions}: one left on "
            "the old count routes a model's requests to the old ranges"
        )
    return 0
