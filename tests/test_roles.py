"""``batchwire up``'s composition (``batchwire/roles.py``)."""

from __future__ import annotations

import pytest

from batchwire import role_settings as rs
from batchwire.cli import build_parser
from batchwire.embedded import EmbeddedRuntime
from batchwire.roles import embedded_settings
from gpu_worker.backends.sim import SimBackend

pytestmark = pytest.mark.timeout(60)


async def test_the_embedded_batcher_serves_each_model_alone() -> None:
    """The in-memory request log has one partition per model, and the batcher knows it owns them all,
    so it spaces its busy workers' calls (``Spacing``); with the Kafka topic's 12 partitions in its
    settings it would think another batcher shares the workers."""
    args = build_parser().parse_args(["up", "--models", "a,b", "--workers", "1"])
    runtime = EmbeddedRuntime(embedded_settings(args, rs.shared_settings(args)), lambda model, index: SimBackend(1.0))
    await runtime.start()
    try:
        assert runtime.partitioner.partitions == 2, "one in-memory partition per model"
        alone = {model: runtime.batcher.dispatcher.alone(model) for model in ("a", "b")}
        assert alone == {"a": True, "b": True}, f"the one batcher serves every model alone: {alone}"
    finally:
        await runtime.close()
