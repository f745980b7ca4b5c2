"""The replication a role asks for, from the cluster's size, and what an existing topic lacks (no Kafka)."""

from __future__ import annotations

import re

import pytest

from infra.topic_checks import Durability, ExistingTopic, Replication, TopicConfigError

BOOTSTRAP = "127.0.0.1:9092"


@pytest.mark.parametrize(("brokers", "expected"), [(1, (1, 1)), (2, (2, 1)), (3, (3, 2)), (5, (3, 2))])
def test_the_defaults_follow_the_brokers(brokers: int, expected: tuple[int, int]) -> None:
    assert Durability().resolve(brokers, BOOTSTRAP) == Replication(*expected)


def test_asked_values_win_over_the_defaults() -> None:
    assert Durability(replication_factor=2, min_insync_replicas=2).resolve(3, BOOTSTRAP) == Replication(2, 2)
    assert Durability(replication_factor=3, min_insync_replicas=1).resolve(3, BOOTSTRAP) == Replication(3, 1)


@pytest.mark.parametrize(
    ("durability", "brokers", "message"),
    [
        (Durability(replication_factor=4), 3, "replication factor 4 is larger than the 3 broker(s)"),
        (Durability(replication_factor=0), 3, "the replication factor must be at least 1, got 0"),
        (Durability(min_insync_replicas=0), 3, "min.insync.replicas must be at least 1, got 0"),
        (Durability(replication_factor=2, min_insync_replicas=3), 3, "min.insync.replicas 3 is larger than"),
        (Durability(), 0, "reports no brokers"),
    ],
)
def test_what_cannot_be_had_is_refused_naming_the_setting(durability: Durability, brokers: int, message: str) -> None:
    with pytest.raises(TopicConfigError, match=re.escape(message)) as caught:
        durability.resolve(brokers, BOOTSTRAP)
    assert "BATCHWIRE_" in str(caught.value) or brokers == 0, str(caught.value)


def test_an_existing_topic_with_less_gets_one_message_per_shortfall_with_its_fix() -> None:
    topic = ExistingTopic("ns.requests", partitions=6, replication_factor=1, min_insync_replicas=1)

    problems = topic.problems(12, Replication(3, 2), BOOTSTRAP)

    assert len(problems) == 3, problems
    partitions, rf, min_isr = problems
    assert "exists with 6 partitions; wanted 12" in partitions and "topics grow" in partitions
    assert "replication factor 1; 3 was asked" in rf and "kafka-reassign-partitions.sh" in rf
    assert "min.insync.replicas 1; 2 was asked" in min_isr
    assert "--entity-name ns.requests --add-config min.insync.replicas=2" in min_isr


def test_an_existing_topic_with_as_much_or_more_is_fine() -> None:
    topic = ExistingTopic("ns.batches.sim", partitions=12, replication_factor=3, min_insync_replicas=2)

    assert topic.problems(8, Replication(3, 2), BOOTSTRAP) == []
    assert topic.problems(12, Replication(2, 1), BOOTSTRAP) == []
