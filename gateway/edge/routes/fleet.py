"""``/v1/fleet``, ``/dashboard`` and ``/dashboard/events``: the deployment's heartbeats, for operators.

``/v1/fleet`` is the JSON that ``batchwire status`` prints; ``/dashboard`` is one page (HTML, CSS and
script in ``dashboard.html``, nothing fetched from elsewhere) that reads the same document once a
second from ``/dashboard/events``. Each view sums the members' figures into fleet-wide totals and
per-model rows. Latency quantiles of several gateways do not add up: the fleet's p50 is their mean
weighted by answers, its p99 the highest of theirs.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from contextlib import ExitStack
from importlib import resources
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from gateway.edge.callers import client_of
from gateway.edge.events import RETRY, EventStream, StreamsEnd, error_event
from gateway.edge.handlers import json_response
from gateway.edge.models import error_responses
from gateway.edge.routes.deployment import deployment_of
from gateway.errors import GatewayError, Unavailable
from gateway.settings import GatewaySettings
from schemas.heartbeat import ROLES, Beat
from transport.ports import Fleet, TransportError

FLEET_PATH = "/v1/fleet"
DASHBOARD_PATH = "/dashboard"
DASHBOARD_EVENTS_PATH = "/dashboard/events"
REFRESH_S = 1.0
"""How often the dashboard's stream sends the fleet: each member beats once a second."""


def fleet_view(members: list[Beat], models: tuple[str, ...], now_ms: int) -> dict[str, Any]:
    """The fleet as ``/v1/fleet`` shows it: each member, the totals, and a row per model."""
    live = [beat for beat in members if beat.live(now_ms)]
    gateways = [beat for beat in live if beat.role == "gateway"]
    batchers = [beat for beat in live if beat.role == "batcher"]
    # a batcher still joining its group batches nothing yet, nor does a failed one
    batching = [beat for beat in batchers if beat.state not in ("failed", "starting")]
    # a failed worker serves none, nor one still starting (loading its model)
    workers = [beat for beat in live if beat.role == "worker" and beat.state not in ("failed", "starting")]
    totals = _served(gateways, None)
    totals.update(_batched(workers))
    totals["queue_depth"] = sum(beat.figures.get("queue_depth", 0.0) for beat in batchers)
    totals["refusals_per_s"] = _summed(gateways, "refusals_per_s")
    totals["flushes_per_s"] = _summed(batchers, "flushes_per_s")
    rows = {}
    for model in sorted({*models, *(m for beat in members for m in beat.models)}):
        serving = [beat for beat in workers if model in beat.models]
        row = _served(gateways, model)
        row.update(_batched(serving))
        row["queue_depth"] = sum(beat.per_model.get(model, {}).get("queue_depth", 0.0) for beat in batchers)
        row["batchers_live"] = sum(model in beat.models for beat in batching)
        row["workers_live"] = len(serving)
        row["workers_busy"] = sum(beat.state == "busy" for beat in serving)
        row["workers_hung"] = sum(beat.state == "hung" for beat in serving)
        rows[model] = row
    ordered = sorted(
        members,
        key=lambda beat: (ROLES.index(beat.role) if beat.role in ROLES else len(ROLES), beat.id, beat.host, beat.pid),
    )
    return {
        "at_ms": now_ms,
        "members": [beat.to_public(now_ms) for beat in ordered],
        "totals": totals,
        "models": rows,
        "shared_ids": _shared_ids(live),
    }


def _shared_ids(live: list[Beat]) -> list[dict[str, Any]]:
    """Each role and id that more than one live process beats as (a copied ``--worker-id``), with those
    processes as ``host:pid``: both serve, and logs and metrics labelled by that id mix the two."""
    processes: dict[tuple[str, str], list[str]] = {}
    for beat in live:
        processes.setdefault((beat.role, beat.id), []).append(f"{beat.host}:{beat.pid}")
    return [
        {"role": role, "id": member_id, "processes": sorted(found)}
        for (role, member_id), found in sorted(processes.items())
        if len(found) > 1
    ]


def _served(gateways: list[Beat], model: str | None) -> dict[str, Any]:
    rows = [beat.figures if model is None else beat.per_model.get(model, {}) for beat in gateways]
    served: dict[str, Any] = {
        name: sum(row.get(name, 0.0) for row in rows) for name in ("answered_per_s", "refused_per_s")
    }
    if model is None:  # a gateway counts requests per route, not per model
        served["requests_per_s"] = sum(row.get("requests_per_s", 0.0) for row in rows)
    timed = [row for row in rows if "p50_ms" in row]
    if timed:
        weights = [row.get("answered_per_s", 0.0) or 1.0 for row in timed]
        served["p50_ms"] = sum(row["p50_ms"] * w for row, w in zip(timed, weights, strict=True)) / sum(weights)
        served["p99_ms"] = max(row["p99_ms"] for row in timed)
    return served


def _batched(workers: list[Beat]) -> dict[str, float]:
    batches = sum(beat.figures.get("batches_per_s", 0.0) for beat in workers)
    items = sum(beat.figures.get("batches_per_s", 0.0) * beat.figures.get("mean_batch_size", 0.0) for beat in workers)
    batched = {"batches_per_s": batches, "busy_fraction": 0.0}
    if workers:
        batched["busy_fraction"] = sum(beat.figures.get("busy_fraction", 0.0) for beat in workers) / len(workers)
    if batches > 0:
        batched["mean_batch_size"] = items / batches
    return batched


def _summed(members: list[Beat], breakdown: str) -> dict[str, float]:
    summed: dict[str, float] = {}
    for beat in members:
        for key, rate in beat.breakdowns.get(breakdown, {}).items():
            summed[key] = summed.get(key, 0.0) + rate
    return summed


async def _view(fleet: Fleet, models: tuple[str, ...]) -> dict[str, Any]:
    try:
        members = await fleet.members()
    except TransportError as err:
        raise Unavailable(f"the fleet's heartbeats cannot be read from the store now: {err}") from err
    return fleet_view(members, models, int(time.time() * 1000))


def _fleet_of(request: Request) -> tuple[Fleet, tuple[str, ...]]:
    deployment = deployment_of(request)
    if deployment.fleet is None:
        raise Unavailable("this gateway was started without a fleet store; heartbeats are not read here")
    return deployment.fleet, deployment.gateway.settings.models


async def fleet(request: Request) -> Response:
    """Every member's last heartbeat, the fleet's totals and a row per model."""
    store, models = _fleet_of(request)
    return json_response(200, await _view(store, models))


async def dashboard() -> HTMLResponse:
    page = resources.files("gateway.edge").joinpath("dashboard.html").read_text(encoding="utf-8")
    return HTMLResponse(page, headers={"Cache-Control": "no-store"})


class FleetEvents:
    """The fleet as an ``event: fleet`` each ``REFRESH_S``, for ``max_s``; each event's ``id`` is its time
    (Unix ms), so a client that resumes with ``Last-Event-ID`` gets only later views. A store that cannot
    be read sends an ``error`` event and the stream goes on. ``aclose`` leaves ``held`` (the stream's
    place among the gateway's watchers)."""

    def __init__(
        self,
        store: Fleet,
        models: tuple[str, ...],
        after_ms: int,
        *,
        max_s: float = math.inf,
        held: ExitStack | None = None,
    ) -> None:
        self._store = store
        self._models = models
        self._after_ms = after_ms
        self._opening = RETRY
        self._next = time.monotonic()
        self._until = self._next + max_s
        self._held = held

    def __aiter__(self) -> FleetEvents:
        return self

    async def __anext__(self) -> bytes:
        if self._next >= self._until:
            raise StopAsyncIteration  # its client resumes it (``retry``), as a task's stream past sse_max_s
        await asyncio.sleep(max(0.0, self._next - time.monotonic()))  # the refresh period, a timer
        self._next = time.monotonic() + REFRESH_S
        now_ms = max(int(time.time() * 1000), self._after_ms + 1)  # ids rise even if the wall clock steps back
        self._after_ms = now_ms
        opening, self._opening = self._opening, b""
        try:
            view = await _view(self._store, self._models)
        except GatewayError as err:
            return opening + error_event(err.error_code, err.message)
        data = json.dumps(view, separators=(",", ":"))
        return opening + f"event: fleet\r\ndata: {data}\r\nid: {now_ms}\r\n\r\n".encode()

    async def aclose(self) -> None:
        if self._held is not None:
            self._held.close()


async def dashboard_events(request: Request) -> EventStream:
    """The fleet's stream. It counts as a watcher (``--max-watchers`` and the client's share) and ends
    after ``sse_max_s``, as a task's stream does: each holds its connection's place at the cap and a
    fleet view a second, and with keys off anyone may open them."""
    store, models = _fleet_of(request)
    raw = request.headers.get("last-event-id", "")
    after_ms = int(raw) if raw.isascii() and raw.isdigit() and len(raw) < 16 else 0  # a stale id only skips time
    deployment = deployment_of(request)
    settings = deployment.gateway.settings
    held = ExitStack()
    held.enter_context(deployment.gateway.watching(client_of(request, settings.trust_client_id)))  # or 503
    events = FleetEvents(store, models, after_ms, max_s=settings.sse_max_s, held=held)
    end: StreamsEnd | None = deployment.streams_end
    return EventStream(events, ping_s=settings.sse_ping_s, end=end)


def add_routes(routes: APIRouter, settings: GatewaySettings) -> None:
    """The fleet's three views; with API keys on, only an operator key reads the fleet (``OPERATOR_PATHS``)."""
    routes.add_api_route(
        FLEET_PATH,
        fleet,
        methods=["GET"],
        response_class=Response,
        responses={
            200: {
                "description": "`members` (each process's last beat: role, id, state, figures), `totals` and "
                "`models` (a row per model: live batchers, live, busy and hung workers, rates, latency, "
                "queue depth), "
                "`shared_ids` (each role and id that several live processes beat as, with their `host:pid`).",
                "content": {"application/json": {"schema": {"type": "object"}}},
            },
            **error_responses("unavailable", *(("forbidden",) if settings.api_keys else ())),
        },
        summary="The fleet: every process's last heartbeat, totals and a row per model",
        description="A member that stopped sent a last beat (`final: true`) and shows the state it stopped "
        "in (`stopped`, `hung` or `failed`); one whose last beat is otherwise over 3 beats old shows "
        "`state: gone` (it died). Neither is live; 60 s after its last beat a member is dropped. "
        "`batchwire status` prints this document. With API keys on, only an operator key reads it.",
    )
    routes.add_api_route(
        DASHBOARD_PATH,
        dashboard,
        methods=["GET"],
        response_class=HTMLResponse,
        include_in_schema=False,  # a page for people, like /docs
    )
    routes.add_api_route(
        DASHBOARD_EVENTS_PATH,
        dashboard_events,
        methods=["GET"],
        response_class=EventStream,
        include_in_schema=False,  # the dashboard's own feed: /v1/fleet is the API
    )
