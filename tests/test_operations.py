"""``batchwire topics grow`` over a real broker: what it prints as the next step is what the docs ask for."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from batchwire.cli import main
from batchwire.operations import ensure_role_topics
from batchwire.settings import SharedSettings
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
