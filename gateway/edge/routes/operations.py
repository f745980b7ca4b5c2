"""``/healthz``, ``/readyz`` and ``/metrics``: what a process supervisor and Prometheus read."""

from __future__ import annotations

from collections.abc import Mapping

from fastapi import APIRouter
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import Response

from gateway.edge.handlers import json_response
from gateway.edge.models import Health, NotReadyResponse, Readiness, error_responses
from gateway.edge.routes.deployment import Deployment, Lifecycle, deployment_of
from gateway.errors import error_body
from gateway.health import Down, Ready, not_ready, probe
from gateway.settings import GatewaySettings
from telemetry.metrics import show_readiness


async def healthz() -> Response:
    return json_response(200, {"status": "ok"})


async def readyz(request: Request) -> Response:
    deployment = deployment_of(request)
    settings = deployment.gateway.settings
    models = deployment.gateway.models()
    checks = await _readiness(deployment, models)
    down = not_ready(checks)
    ok = {part: check is True for part, check in checks.items()}
    if not down:
        return json_response(200, {"status": "ready", "checks": ok, "models": models})
    named = ", ".join(
        part if checks[part] is False else f"{part} ({down[part].state}: {down[part].reason})" for part in sorted(down)
    )
    doc = {
        **error_body("not_ready", f"not ready: {named}"),
        "checks": ok,
        "down": {part: {"state": why.state, "reason": why.reason} for part, why in sorted(down.items())},
        "models": models,
    }
    return json_response(503, doc, {"Retry-After": str(settings.retry_after_s)})


async def metrics(request: Request) -> Response:
    """The metrics of the roles this process runs (``Deployment.metrics``), in Prometheus's text format;
    ``batchwire_ready`` as /readyz's checks find it now (within ``ready_timeout_s``), not as the last /readyz
    found it, which may be long ago."""
    deployment = deployment_of(request)
    await _readiness(deployment, deployment.gateway.models())
    return Response(generate_latest(deployment.metrics), media_type=CONTENT_TYPE_LATEST)


def add_routes(routes: APIRouter, settings: GatewaySettings) -> None:
    """The three routes; ``/metrics`` documents its 403 when API keys are on."""
    routes.add_api_route(
        "/healthz", healthz, methods=["GET"], response_model=Health, summary="Liveness: 200 while the process runs"
    )
    routes.add_api_route(
        "/readyz",
        readyz,
        methods=["GET"],
        response_model=Readiness,
        responses={
            503: {"model": NotReadyResponse, "description": "`not_ready`: a part is down; `checks` says which."}
        },
        summary="Readiness: 200 when the transports, the gateway and every embedded part are ready",
    )
    routes.add_api_route(
        "/metrics",
        metrics,
        methods=["GET"],
        response_class=Response,
        responses={
            200: {
                "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}},
                "description": "Prometheus text exposition of the batchwire metrics of the roles this process runs "
                "(all of them embedded, the gateway's own beside separate batchers and workers); "
                "`batchwire_ready{check}` is /readyz's checks, run for this scrape (1 passes, 0 not).",
            },
            **(error_responses("forbidden") if settings.api_keys else {}),
        },
        summary="Prometheus metrics",
        description="With API keys on, only an operator key reads it (a tenant key gets 403 `forbidden`): "
        "it shows every tenant's traffic.",
    )


async def _readiness(deployment: Deployment, models: Mapping[str, str]) -> dict[str, Ready]:
    """/readyz's checks, within ``ready_timeout_s``, also shown as ``batchwire_ready``: the transports and
    embedded parts, the gateway's own part, and ``models`` (given) when none of them can be admitted."""
    gateway = deployment.gateway
    checks = await _lifecycle_checks(deployment.lifecycle, gateway.settings.ready_timeout_s)
    checks.update(gateway.ready())
    # One stalled model must not turn the others away; with every model stalled, this gateway only refuses.
    if models and all(state == "stalled" for state in models.values()):
        checks["models"] = Down(
            "down", f"no model can be admitted: {', '.join(sorted(models))} stalled (requests wait, no batch is taken)"
        )
    show_readiness({part: check is True for part, check in checks.items()})
    return checks


async def _lifecycle_checks(lifecycle: Lifecycle, timeout_s: float) -> dict[str, Ready]:
    checks: dict[str, Ready] = {}

    async def collect() -> bool:
        checks.update(await lifecycle.ready())
        return True

    if not await probe(collect(), timeout_s, "lifecycle"):
        checks["lifecycle"] = False
    return checks
