"""What a process's metrics read: before anything writes them, and the queue an embedded gateway reads."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import threading

import httpx
import pytest

from batchwire.embedded import EmbeddedRuntime, EmbeddedSettings
from batchwire.settings import SharedSettings
from gateway.edge.app import create_app
from gateway.service import Gateway
from gateway.settings import GatewaySettings
from gpu_worker.backends.sim import SimBackend
from telemetry.metrics import REQUEST_LAG
from tests.support.eventually import eventually


def test_the_request_topic_lag_reads_nan_until_a_reader_sets_it() -> None:
    """A gateway without the queue-depth reader (``--max-queue-depth 0``, admit-by-wait off) never sets it:
    0 there would read as an empty queue. A fresh interpreter: this one's tests may have set it."""
    shown = subprocess.run(
        [
            sys.executable,
            "-c",
            "from telemetry.metrics import REGISTRY; print(REGISTRY.get_sample_value('batchwire_request_topic_lag'))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert shown.stdout.strip() == "nan", shown


class _HeldSim(SimBackend):
    """The sim backend, its calls held until ``go`` is set: the worker stays busy and requests queue."""

    def __init__(self) -> None:
        super().__init__(latency_ms=0)
        self.entered = threading.Event()
        self.go = threading.Event()

    def batchstring(self, inputs: list[str]) -> list[str]:
        self.entered.set()
        assert self.go.wait(30), "the test never let the backend go"
        return super().batchstring(inputs)


def _scraped_lag(text: str) -> float:
    found = re.search(r"^batchwire_request_topic_lag (\S+)$", text, flags=re.MULTILINE)
    assert found is not None, text
    return float(found.group(1))


@pytest.mark.timeout(60)
async def test_the_embedded_gateway_exports_its_queue_as_the_request_topic_lag() -> None:
    """``batchwire up`` reads its model's queue from the in-memory bus at every submit; /metrics shows it as
    the lag, as a Kafka gateway shows its reader's figure, not NaN as if nothing read it."""
    REQUEST_LAG.set(math.nan)  # what an earlier test in this process left is not this gateway's figure
    backend = _HeldSim()
    runtime = EmbeddedRuntime(
        EmbeddedSettings(shared=SharedSettings(models=("sim",)), workers_per_model=1), lambda model, index: backend
    )
    gateway = Gateway(
        GatewaySettings(models=("sim",)),
        runtime.producer,
        runtime.store,
        queue_depth=runtime.queue_depth,
        credits=runtime.credits,
    )
    app = create_app(gateway, runtime)
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        try:
            assert (await client.post("/v1/tasks", json={"input": "q0"})).status_code == 202
            await eventually(backend.entered.is_set, "the first request's call to hold the one worker")
            for index in range(1, 4):  # these wait while the backend is held
                assert (await client.post("/v1/tasks", json={"input": f"q{index}"})).status_code == 202
            await eventually(lambda: runtime.requests.lag() == 3, "three requests waiting for the busy worker")
            scraped = _scraped_lag((await client.get("/metrics")).text)
            assert runtime.requests.lag() == 3, "the queue moved while the backend was held"
            assert scraped == 3, f"the lag gauge reads {scraped} while 3 requests wait for a worker"
        finally:
            backend.go.set()
        await eventually(lambda: runtime.requests.lag() == 0, "every request handed to the worker")
        scraped = _scraped_lag((await client.get("/metrics")).text)
        assert scraped == 0, f"the lag gauge reads {scraped} once every request was handed over"
