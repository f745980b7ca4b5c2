"""A traced route that streams its answer (a streamed completion): its gateway spans end with the
stream, not when the route hands the stream over, and an error the stream ends in, or its cut before
the last answer, marks them failed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route

from gateway.admission.gate import ANONYMOUS
from gateway.answers.outcomes import Answer
from gateway.edge.events import EventStream
from gateway.edge.routes.openai import GONE_GRACE_S, CompletionChunks, CompletionsBody
from gateway.edge.traced import traced
from gateway.errors import ClientDisconnected, TaskFailed
from gateway.settings import GatewaySettings
from telemetry import spans, tracing
from telemetry.spans import RequestSpans


class Answers:
    """Two events, as two prompts' answers; the second is an error (an error chunk) when ``fails``."""

    def __init__(self, fails: bool) -> None:
        self.fails = fails
        self.sent = 0
        self.last_ns = 0
        """When the last event was handed to the stream."""

    def __aiter__(self) -> Answers:
        return self

    async def __anext__(self) -> bytes:
        if self.sent == 2:
            raise StopAsyncIteration
        self.sent += 1
        if self.sent == 2 and self.fails:
            spans.request_failed(TaskFailed("the model failed on this input", task_id="t2", task_code=None))
        self.last_ns = time.time_ns()
        return b"data: x\r\n\r\n"

    async def aclose(self) -> None:
        return None


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.configure(None, "batchwire-test", exporter=exporter)  # before the route is wrapped
    yield exporter
    tracing.shutdown()


async def _streamed(answers: Answers, exporter: InMemorySpanExporter) -> Any:
    """Streams ``answers`` from a traced route; returns its ``reply`` span (the SDK's)."""

    async def stream(request: Request) -> EventStream:
        spans.request_sent("t1")
        spans.request_answered(int(time.time() * 1000))  # the first answer is in: the route answers
        return EventStream(answers, ping_s=15)

    app = Starlette(routes=[Route("/stream", traced(stream), methods=["POST"])])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        response = await client.post("/stream")
    assert response.status_code == 200 and response.text.count("data: x") == 2, response.text
    replies = [span for span in exporter.get_finished_spans() if span.name == "reply"]
    assert len(replies) == 1, f"one reply span per request: {replies}"
    return replies[0]


async def test_a_streamed_answers_reply_span_lasts_until_its_last_event(exporter: InMemorySpanExporter) -> None:
    answers = Answers(fails=False)
    reply = await _streamed(answers, exporter)
    assert reply.end_time >= answers.last_ns, (
        f"the reply ended {(answers.last_ns - reply.end_time) / 1e6:.3f} ms before the stream's last event"
    )
    assert reply.status.is_ok, reply.status.description


async def test_a_stream_that_ends_in_an_error_marks_its_reply_span_failed(exporter: InMemorySpanExporter) -> None:
    reply = await _streamed(Answers(fails=True), exporter)
    assert not reply.status.is_ok, "an error event ends the stream: its reply failed"
    assert "the model failed" in (reply.status.description or ""), reply.status.description
    assert reply.attributes.get("http.response.status_code") == 200, "the stream's status"


class Submits:
    """A gateway whose "a" is answered at once, whose "b" fails once the first answer is out, and whose "c"
    waits for its caller to leave."""

    settings = GatewaySettings(models=("sim",))

    def __init__(self) -> None:
        self.first_out = asyncio.Event()

    async def submit(self, text: str, model: str | None, *args: object, disconnected: Any, **kw: object) -> Answer:
        if text == "b":
            await self.first_out.wait()
            raise TaskFailed("the model failed on this input", task_id="t-b", task_code="backend_error")
        if text == "c":
            await disconnected()
            raise ClientDisconnected("gone", task_id="t-c")
        return Answer("t-a", "sim", text[::-1], 1.0, 1)


async def _completion(exporter: InMemorySpanExporter, prompts: list[str], *, read: int) -> Any:
    """A streamed completion of ``prompts`` whose client reads ``read`` events, then leaves (the stream is
    closed); returns its ``reply`` span."""
    request = RequestSpans(None)
    request.sent("t-a")  # as the gateway's submit of the first prompt does
    body = CompletionsBody(prompt=prompts, model="sim", stream=True)
    gateway = Submits()
    chunks = CompletionChunks(gateway, prompts, prompts, body, [], ANONYMOUS)  # type: ignore[arg-type]
    async with asyncio.timeout(GONE_GRACE_S * 10):
        await chunks.begin()  # the route answers once the first chunk is in
        gateway.first_out.set()
        for _ in range(read):  # the first is the one ``begin`` read
            await anext(chunks)
        await chunks.aclose()
    request.answered(int(time.time() * 1000))
    request.end(200)
    (reply,) = [span for span in exporter.get_finished_spans() if span.name == "reply"]
    return reply


async def test_a_completion_streams_error_chunk_marks_its_reply_span_failed(exporter: InMemorySpanExporter) -> None:
    reply = await _completion(exporter, ["a", "b"], read=2)
    assert not reply.status.is_ok and "the model failed" in (reply.status.description or ""), reply.status


async def test_a_completion_stream_cut_before_its_last_answer_marks_its_reply_span_failed(
    exporter: InMemorySpanExporter,
) -> None:
    reply = await _completion(exporter, ["a", "c"], read=1)
    assert not reply.status.is_ok and "before its last answer" in (reply.status.description or ""), reply.status


async def test_a_completion_streamed_whole_leaves_its_reply_span_ok(exporter: InMemorySpanExporter) -> None:
    reply = await _completion(exporter, ["a", "a"], read=3)  # two answers and [DONE]
    assert reply.status.is_ok, reply.status.description
