"""``GET /v1/result/{task_id}/events``: a task's status changes as server-sent events."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request

from gateway.edge.callers import client_of, request_owner
from gateway.edge.events import EventStream, TaskEvents
from gateway.edge.models import error_responses
from gateway.edge.routes.deployment import deployment_of
from gateway.edge.routes.tasks import READ_ERRORS, RESULT_PATH, TaskId

EVENTS_PATH = f"{RESULT_PATH}/events"


async def events(request: Request, task_id: TaskId) -> EventStream:
    deployment = deployment_of(request)
    gateway = deployment.gateway
    client = client_of(request, gateway.settings.trust_client_id)
    stream = gateway.events(task_id, owner=request_owner(request), client=client)
    try:
        first = await anext(stream)  # unknown id or overload: a JSON error before the stream starts
    except BaseException:
        await stream.aclose()
        raise
    return EventStream(TaskEvents(first, stream), ping_s=gateway.settings.sse_ping_s, end=deployment.streams_end)


def add_routes(routes: APIRouter) -> None:
    """The event stream's route."""
    routes.add_api_route(
        EVENTS_PATH,
        events,
        methods=["GET"],
        response_class=EventStream,
        responses={
            200: {
                "description": "Server-sent events: the current state first, then each change; `event` is the "
                "status, `data` the task's JSON (as from /v1/result), `id` the status rank. The stream "
                'closes after the terminal event. An `error` event carries `{"error": {...}}` if the '
                "store fails mid-stream.",
                "content": {
                    "text/event-stream": {
                        "schema": {"type": "string"},
                        "example": 'event: queued\r\ndata: {"task_id":"q3bY0h2mXw1kL9aF5cZr6Q","status":"queued",'
                        '"model":"sim"}\r\nid: 0\r\n\r\n',
                    }
                },
            },
            **error_responses(*READ_ERRORS),
        },
        summary="Stream a task's status changes",
    )
