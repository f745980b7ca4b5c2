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
    """The batcher knows it owns every partition of the in-memory request log, so it spaces its busy
    workers' calls (``Spacing``); with another partition count in its settings than the log's it would
    think another batcher shares the workers."""
    args = build_parser().parse_args(["up", "--models", "a,b", "--workers", "1"])
    runtime = EmbeddedRuntime(embedded_settings(args, rs.shared_settings(args)), lambda model, index: SimBackend(1.0))
    await runtime.start()
    try:
        alone = {model: runtime.batcher.dispatcher.alone(model) for model in ("a", "b")}
        assert alone == {"a": True, "b": True}, f"the one batcher serves every model alone: {alone}"
    finally:
        await runtime.close()
