"""``batchwire up``'s composition (``batchwire/roles.py``)."""

from __future__ import annotations

import pytest

from batchwire import role_settings as rs
from batchwire.cli import build_parser
from batchwire.embedded import EmbeddedRuntime
from batchwire.roles import embedded_settings
from batchwire.supervise import graceful_shutdown_s
from gateway.settings import GatewaySettings
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


def test_a_shutdown_waits_for_requests_in_hand_past_the_longest_deadline() -> None:
    """uvicorn cancels what is still running when its wait runs out: a plain 500 to a caller whose
    request, given a longer timeout, would have been answered."""
    for max_timeout_ms in (30_000, 120_000):
        settings = GatewaySettings(models=("sim",), max_timeout_ms=max_timeout_ms, default_timeout_ms=30_000)
        assert graceful_shutdown_s(settings) > max_timeout_ms / 1000
