"""``batchwire topics grow`` over a real broker: what it prints as the next step is what the docs ask for."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from batchwire.cli import main
from batchwire.operations import ensure_role_topics
from batchwire.settings import SettingsError, SharedSettings
from infra.topic_checks import Durability
from schemas.wire import Names


@pytest.mark.timeout(120)
def test_growing_the_request_topic_says_every_gateway_and_batcher_takes_the_new_count(
    infra: Any, names: Names, capsys: pytest.CaptureFixture[str]
) -> None:
    """No batcher runs, so the grow goes through; running gateways cannot be seen from Kafka, and one left on the
    old count routes models to the old ranges: the next step names them, as docs/operations.md does."""
    shared = SharedSettings(namespace=names.namespace, kafka_bootstrap=infra.kafka_bootstrap)
    asyncio.run(ensure_role_topics(shared, Durability(1, 1), True, shared.models))
    argv = ["topics", "grow", "--namespace", names.namespace, "--kafka-bootstrap", infra.kafka_bootstrap]
    assert main([*argv, "--request-partitions", "16"]) == 0
    out = capsys.readouterr().out
    assert f"{names.request_topic}: 12 -> 16 partitions" in out, out
    assert "restart every gateway and batcher with --request-partitions 16" in out, out
    assert "running ones keep working" not in out, out

    assert main([*argv, "--batch-partitions", "10"]) == 0
    out = capsys.readouterr().out
    assert "start new roles with --batch-partitions 10; running ones keep working" in out, out


@pytest.mark.timeout(120)
def test_a_partition_count_past_the_bound_is_refused_and_leaves_the_topic_as_it_was(
    infra: Any, names: Names, capsys: pytest.CaptureFixture[str]
) -> None:
    """Asked for 1,000,000, Kafka added 10,000 partitions (which no command can take back) and the command
    reported only an UnknownError and exit 2, as if nothing had changed."""
    shared = SharedSettings(namespace=names.namespace, kafka_bootstrap=infra.kafka_bootstrap)
    asyncio.run(ensure_role_topics(shared, Durability(1, 1), False, shared.models))
    argv = ["topics", "grow", "--namespace", names.namespace, "--kafka-bootstrap", infra.kafka_bootstrap]
    assert main([*argv, "--batch-partitions", "1000000"]) == 2
    err = capsys.readouterr().err
    assert "--batch-partitions is 1000000; it must be from 1 to 10,000" in err, err

    assert main([*argv, "--batch-partitions", str(shared.batch_partitions)]) == 0
    out = capsys.readouterr().out
    assert f"{names.batch_topic('sim')}: {shared.batch_partitions} partitions" in out, out


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--batch-partitions", "0"], "--batch-partitions is 0; it must be from 1 to 10,000"),
        (["--batch-partitions", "-3"], "--batch-partitions is -3; it must be from 1 to 10,000"),
        (["--request-partitions", "1", "--models", "a,b"], "--request-partitions is 1; it must be from 2 to 10,000"),
    ],
)
def test_a_count_no_topic_can_have_is_refused_naming_its_flag_before_kafka_is_asked(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """They reached the broker, which answered "has 8 partitions, more than the -3 asked", naming no flag;
    a request count below the models was then advised as the count to restart the roles with."""
    assert main(["topics", "grow", "--kafka-bootstrap", "127.0.0.1:1", *argv]) == 2
    err = capsys.readouterr().err
    assert said in err and "no Kafka broker answered" not in err, err


@pytest.mark.timeout(120)
def test_a_gateway_or_batcher_on_fewer_request_partitions_than_the_topic_has_stops_naming_both_counts(
    infra: Any, names: Names, capsys: pytest.CaptureFixture[str]
) -> None:
    """The models' ranges of the request topic follow from --request-partitions: a gateway or batcher left on
    12 after `topics grow --request-partitions 16` sent each model to partitions that roles on 16 count as
    another model's (their backlogs and a batcher's spacing read the wrong model), and it started without a
    word. Both call this check before they take a request; a worker does not use the request topic."""
    shared = SharedSettings(namespace=names.namespace, kafka_bootstrap=infra.kafka_bootstrap, models=("a", "b"))
    asyncio.run(ensure_role_topics(shared, Durability(1, 1), True, shared.models))
    argv = ["topics", "grow", "--namespace", names.namespace, "--kafka-bootstrap", infra.kafka_bootstrap]
    assert main([*argv, "--models", "a,b", "--request-partitions", "16"]) == 0
    with pytest.raises(SettingsError) as refused:
        asyncio.run(ensure_role_topics(shared, Durability(1, 1), True, shared.models))
    said = str(refused.value)
    assert f"{names.request_topic!r} has 16 partitions" in said, said
    assert "--request-partitions (BATCHWIRE_REQUEST_PARTITIONS) is 12" in said, said
    assert "start this role with --request-partitions 16" in said, said

    asyncio.run(ensure_role_topics(shared, Durability(1, 1), False, shared.models))  # a worker's topics: fine
    grown = SharedSettings(
        namespace=names.namespace, kafka_bootstrap=infra.kafka_bootstrap, models=("a", "b"), request_partitions=16
    )
    asyncio.run(ensure_role_topics(grown, Durability(1, 1), True, grown.models))


@pytest.mark.timeout(120)
def test_a_role_asking_more_partitions_than_a_topic_has_is_told_which_flag_and_both_fixes(
    infra: Any, names: Names
) -> None:
    """A worker on 8 batch partitions beside a topic of 4 was told "wanted 8 (`batchwire topics grow` adds
    partitions; or configure 4)": neither the flag to change nor the grow command's flag."""
    small = SharedSettings(namespace=names.namespace, kafka_bootstrap=infra.kafka_bootstrap, batch_partitions=4)
    asyncio.run(ensure_role_topics(small, Durability(1, 1), True, small.models))
    wider = dataclasses.replace(small, batch_partitions=8, request_partitions=16)

    with pytest.raises(SettingsError) as refused:
        asyncio.run(ensure_role_topics(wider, Durability(1, 1), True, wider.models))

    said = str(refused.value)
    batches, requests = f"{names.batch_topic('sim')!r} exists with 4", f"{names.request_topic!r} exists with 12"
    assert batches in said and requests in said, said
    assert "--batch-partitions (BATCHWIRE_BATCH_PARTITIONS) is 8" in said, said
    assert "`batchwire topics grow --batch-partitions 8` adds partitions" in said, said
    assert "or start this role with --batch-partitions 4" in said, said
    assert "--request-partitions (BATCHWIRE_REQUEST_PARTITIONS) is 16" in said, said
    assert "or start this role with --request-partitions 12" in said, said
