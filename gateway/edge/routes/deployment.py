"""What the routes serve: the gateway, the parts the composition root runs, and how callers are told."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry
from starlette.requests import Request

from gateway.admission.gate import ANONYMOUS, Caller
from gateway.edge.body import BodyBudget, read_body
from gateway.edge.callers import CallerOf, client_of
from gateway.edge.events import StreamsEnd
from gateway.health import Ready
from gateway.service import Gateway
from telemetry.metrics import REGISTRY
from transport.ports import Fleet


class Lifecycle(Protocol):
    """What the composition root starts before the gateway and stops after it."""

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def ready(self) -> Mapping[str, Ready]:
        """Each part the composition root runs (transports, embedded batcher, ...) and whether it is
        ready; a ``Down`` says why not (``redis``: ``failing over``)."""
        ...


@dataclass(frozen=True, slots=True)
class Deployment:
    """One app's gateway and the parts around it, kept in ``app.state.deployment``."""

    gateway: Gateway
    lifecycle: Lifecycle
    caller_of: CallerOf
    streams_end: StreamsEnd | None = None
    """Once ended (the server began shutting down), ends every open event stream."""
    bodies: BodyBudget | None = None
    """What the bodies being read may hold together (``max_body_bytes_in_flight``)."""
    fleet: Fleet | None = None
    """Where every process's heartbeat lands: what ``/v1/fleet`` and ``/dashboard`` read."""
    metrics: CollectorRegistry = REGISTRY
    """What ``/metrics`` serves: the metrics of every role this process runs."""

    async def body_of(self, request: Request, caller: Caller) -> bytes:
        """The request's body, held against ``bodies`` and its client's share of them: the caller's
        client where it names one (with rate limits), else looked up (``client_of``)."""
        settings = self.gateway.settings
        client = caller.client if caller.client != ANONYMOUS.client else client_of(request, settings.trust_client_id)
        return await read_body(request, settings.max_body_bytes, self.bodies, client)


def deployment_of(request: Request) -> Deployment:
    """The deployment of the app serving ``request``."""
    deployment: Deployment = request.app.state.deployment
    return deployment
