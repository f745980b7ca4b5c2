"""``GET /v1/result/{task_id}/events``: a task's status changes as server-sent events."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from gateway.edge.callers import client_of, request_owner
from gateway.edge.events import EventStream, TaskEvents
from gateway.edge.models import error_responses
from gateway.edge.routes.deployment import deployment_of
from gateway.edge.routes.tasks import READ_ERRORS, RESULT_PATH, TaskId
from gateway.errors import InvalidLastEventId
from gateway.settings import GatewaySettings
from schemas.records import TaskStatus

EVENTS_PATH = f"{RESULT_PATH}/events"
_LAST_RANK = max(status.rank for status in TaskStatus)


def last_event_id(request: Request) -> int:
    """The ``Last-Event-ID`` a reconnecting client sends: the rank of the last state it read; -1 without one."""
    raw = request.headers.get("last-event-id")
    if raw is None or raw == "":
        return -1
    if not (raw.isascii() and raw.isdigit()) or len(raw) > len(str(_LAST_RANK)) or int(raw) > _LAST_RANK:
        raise InvalidLastEventId(f"Last-Event-ID {raw[:16]!r} is not an event id of this stream (0 to {_LAST_RANK})")
    return int(raw)


async def events(request: Request, task_id: TaskId) -> Response:
    after = last_event_id(request)
    deployment = deployment_of(request)
    gateway = deployment.gateway
    client = client_of(request, gateway.settings.trust_client_id)
    stream = gateway.events(task_id, owner=request_owner(request), client=client)
    try:
        first = await anext(stream)  # unknown id or overload: a JSON error before the stream starts
    except BaseException:
        await stream.aclose()
        raise
    if first.status.terminal and first.status.rank <= after:  # the client read the end: 204 stops its retries
        await stream.aclose()
        return Response(status_code=204)
    return EventStream(
        TaskEvents(first, stream, after=after), ping_s=gateway.settings.sse_ping_s, end=deployment.streams_end
    )


def add_routes(routes: APIRouter, settings: GatewaySettings) -> None:
    """The event stream's route, documented with this deployment's keep-alive and longest stream."""
    routes.add_api_route(
        EVENTS_PATH,
        events,
        methods=["GET"],
        response_class=EventStream,
        openapi_extra={
            "parameters": [
                {
                    "name": "Last-Event-ID",
                    "in": "header",
                    "required": False,
                    "description": "The `id` of the last event read: the stream resumes after it (204 after the end). "
                    "Empty, it is none.",
                    "schema": {"type": "string", "pattern": f"^[0-{_LAST_RANK}]?$"},
                }
            ]
        },
        responses={
            200: {
                "description": "Server-sent events: `retry: 1000`, the current state, then each change; `event` "
                "is the status, `data` the task's JSON (as from /v1/result), `id` the status rank (0 queued, 1 "
                "batched, 2 running, 3 ended). The stream closes after the terminal event. An `error` event "
                'carries `{"error": {...}}` if the store fails mid-stream. A `Last-Event-ID` header resumes '
                "after that event: no status is sent twice. A keep-alive comment comes after "
                f"{settings.sse_ping_s:g} s of quiet (BATCHWIRE_SSE_PING_S). A stream still open after "
                f"{settings.sse_max_s:g} s (BATCHWIRE_SSE_MAX_S), or when the gateway shuts down, closes without "
                "the terminal event: resume it with `Last-Event-ID`.",
                "content": {
                    "text/event-stream": {
                        "schema": {"type": "string"},
                        "example": "retry: 1000\r\nevent: queued\r\n"
                        'data: {"task_id":"q3bY0h2mXw1kL9aF5cZr6Q","status":"queued","model":"sim"}\r\nid: 0\r\n\r\n',
                    }
                },
            },
            204: {"description": "`Last-Event-ID` names the terminal event: the stream has nothing left to send."},
            **error_responses(*READ_ERRORS, "invalid_last_event_id"),
        },
        summary="Stream a task's status changes",
    )
