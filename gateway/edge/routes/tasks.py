"""``GET /v1/result/{task_id}`` (poll or long-poll a task) and ``DELETE`` of it (cancel)."""

# No ``from __future__ import annotations``: FastAPI reads the route signatures at runtime, and the
# long-poll's ``Annotated`` metadata is this deployment's (a local of ``router``).
import asyncio
from collections.abc import Awaitable
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query
from starlette.requests import Request
from starlette.responses import Response

from gateway.answers.reads import TASK_ID_PATTERN
from gateway.edge.callers import client_of, request_owner, unless_gone
from gateway.edge.events import StreamsEnd
from gateway.edge.handlers import json_response
from gateway.edge.models import TaskResult, error_responses
from gateway.edge.routes.deployment import deployment_of
from gateway.settings import GatewaySettings
from schemas.records import TaskState
from transport.cancelling import cancel_and_wait

RESULT_PATH = "/v1/result/{task_id}"

TaskId = Annotated[
    str,
    Path(description="The task_id a submit returned.", json_schema_extra={"pattern": f"^{TASK_ID_PATTERN.pattern}$"}),
]

READ_ERRORS = ("invalid_task_id", "task_not_found", "validation_error", "overloaded", "unavailable")


async def read_result(request: Request, task_id: str, wait: float) -> Response:
    """The task's state, once it ended or ``wait`` seconds passed."""
    gateway = deployment_of(request).gateway
    owner = request_owner(request)
    if wait <= 0:
        state = await gateway.result(task_id, owner=owner)
    else:
        client = client_of(request, gateway.settings.trust_client_id)
        waiting = _until_shutdown(gateway.result(task_id, wait, owner=owner, client=client), request)
        ended = await unless_gone(waiting, request.receive)
        # None: the server began shutting down; the state now, and the caller polls again
        state = ended if ended is not None else await gateway.result(task_id, owner=owner)
    return json_response(200, state.to_public())


async def _until_shutdown(waiting: Awaitable[TaskState], request: Request) -> TaskState | None:
    """``waiting``'s state, or None once the server begins shutting down: a long-poll would hold the
    graceful shutdown for its whole ``?wait=``, as an event stream would (``StreamsEnd``)."""
    end: StreamsEnd | None = deployment_of(request).streams_end
    if end is None:
        return await waiting
    work = asyncio.ensure_future(waiting)
    either: set[asyncio.Future[Any]] = {work, end.future()}
    try:
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            await cancel_and_wait(work)
    return None if work.cancelled() else work.result()


async def cancel(request: Request, task_id: TaskId) -> Response:
    """Cancels a task no worker has started; answers its cancelled state."""
    state = await deployment_of(request).gateway.cancel(task_id, owner=request_owner(request))
    return json_response(200, state.to_public())


def add_routes(routes: APIRouter, settings: GatewaySettings) -> None:
    """Polling and cancelling, the long-poll documented with this deployment's longest wait."""
    wait_doc = Query(
        ge=0,
        allow_inf_nan=False,
        description="Seconds to wait for the task to end (long-poll); a longer wait than this deployment's "
        f"longest ({settings.max_poll_wait_s:g} s, BATCHWIRE_MAX_POLL_WAIT_S) waits that long. 0 answers at "
        "once. The answer is the latest state, ended or not: poll again while it has not ended.",
    )

    async def result(request: Request, task_id: TaskId, wait: Annotated[float, wait_doc] = 0.0) -> Response:
        return await read_result(request, task_id, wait)

    routes.add_api_route(
        RESULT_PATH,
        result,
        methods=["GET"],
        response_model=TaskResult,
        responses=error_responses(*READ_ERRORS),
        summary="A task's status, and its output or error once it ended",
    )
    routes.add_api_route(
        RESULT_PATH,
        cancel,
        methods=["DELETE"],
        response_model=TaskResult,
        responses=error_responses("invalid_task_id", "task_not_found", "not_cancellable", "unavailable"),
        summary="Cancel a task that no worker has started",
        description="A `queued` or `batched` task ends `cancelled` and never reaches a GPU; the answer is its "
        "cancelled state (again for a task already cancelled). A task that is running or ended otherwise "
        "answers 409 `not_cancellable`, as does a synchronous request's task recorded at its 504 (it reads `queued` "
        "while a worker may be running it). A synchronous caller waiting for the task gets 409 `task_cancelled`.",
    )
