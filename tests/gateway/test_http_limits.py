"""The HTTP edge's limits, on the protocol itself: header bytes counted before parsing, deadlines in
virtual time, the connection cap, and the answers' shape.

The protocol runs over a recording transport; its clock and timers are a test's (``VirtualLoop``),
its ASGI tasks run on the test's loop. ``tests/adversarial/test_http_edge.py`` attacks the same
limits over real sockets, against a real service.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import socket
from collections.abc import Callable
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState

from gateway.edge.descriptors import FD_RESERVE, connection_cap, refusal_budget
from gateway.edge.handlers import EdgeMiddleware
from gateway.edge.http_limits import (
    EDGE_ROUTE,
    HEAD_PIECE_BYTES,
    OPERATIONS_OVER_CAP,
    PIPELINE_DEPTH,
    REFUSAL_LINGER_S,
    SLOW_AFTER_S,
    LimitedHttpToolsProtocol,
    limited_http_protocol,
)
from gateway.edge.refused_request import REFUSED_READ_BYTES
from gateway.settings import GatewaySettings
from telemetry.metrics import REGISTRY, REQUESTS
from tests.support.eventually import eventually

LIMIT = 1024
HEADER_TIMEOUT_S = 10.0
HIGH_WATER = 64 * 1024
"""asyncio's default high-water mark of a transport's write buffer."""
BODY_TIMEOUT_S = 30.0


class VirtualTimer:
    def __init__(self, when: float, callback: Callable[..., object], args: tuple[Any, ...]) -> None:
        self.when = when
        self.callback = callback
        self.args = args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class VirtualLoop:
    """The test's loop for tasks, with a clock and timers that move only in :meth:`advance`."""

    def __init__(self) -> None:
        self.real = asyncio.get_running_loop()
        self.now = 1000.0
        self.timers: list[VirtualTimer] = []
        self.made: list[VirtualTimer] = []

    def time(self) -> float:
        return self.now

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any) -> VirtualTimer:
        timer = VirtualTimer(self.now + delay, callback, args)
        self.timers.append(timer)
        self.made.append(timer)
        return timer

    def create_task(self, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        return self.real.create_task(coro, **kwargs)

    def advance(self, seconds: float) -> None:
        end = self.now + seconds
        while True:
            due = [timer for timer in self.timers if not timer.cancelled and timer.when <= end]
            if not due:
                break
            timer = min(due, key=lambda t: t.when)
            self.timers.remove(timer)
            self.now = timer.when
            timer.callback(*timer.args)
        self.now = end


class Transport:
    """Records what the protocol writes; ``close`` reports the loss to the protocol soon, as asyncio does,
    unless ``unread`` bytes wait for a client that does not read (then only ``abort`` does)."""

    def __init__(self) -> None:
        self.written = b""
        self.unread = 0
        """Bytes written that the client has not read, its window shut: a close waits for them."""
        self.closed = False
        self.aborted = False
        self.read_paused = False
        self.eof_written = False
        self.protocol: Any = None
        self.sock: socket.socket | None = None
        """A real socket, for what waits unread in it (``_unread``); None: nothing does."""

    def get_extra_info(self, key: str, default: Any = None) -> Any:
        extra = {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 40000), "socket": self.sock}
        return extra.get(key, default)

    def write(self, data: bytes) -> None:
        if not self.closed:  # a closed socket takes nothing more
            self.written += data

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if not self.unread:
                asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    def abort(self) -> None:
        if not self.aborted and (self.unread or not self.closed):
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)
        self.closed = self.aborted = True
        self.unread = 0

    def get_write_buffer_size(self) -> int:
        return self.unread

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.read_paused = True

    def resume_reading(self) -> None:
        self.read_paused = False

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof_written = True

    def get_protocol(self) -> Any:
        return self.protocol

    def set_protocol(self, protocol: Any) -> None:
        self.protocol = protocol


class CountingParser:
    """The protocol's parser, counting the bytes it is given."""

    def __init__(self, parser: Any) -> None:
        self.parser = parser
        self.fed = 0
        self.feeds = 0
        """Calls of ``feed_data``: each is a parse of its own, and a read parsed in pieces is several."""

    def feed_data(self, data: Any) -> None:
        self.fed += len(data)
        self.feeds += 1
        self.parser.feed_data(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.parser, name)


class App:
    """Reads the whole body and answers its length; ``/early`` answers 415 without reading; ``gate``
    holds every answer while clear."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.disconnected: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope["path"]
        self.calls.append(path)
        if path == "/early":
            await respond(send, 415, b"no")
            return
        if path == "/stream":  # an event stream: one event, then the next once ``gate`` is set
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
            )
            await send({"type": "http.response.body", "body": b"data: 1\r\n\r\n", "more_body": True})
            await self.gate.wait()
            await send({"type": "http.response.body", "body": b"data: 2\r\n\r\n", "more_body": True})
            if (await receive())["type"] == "http.disconnect":
                self.disconnected.append(path)
            return
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.disconnected.append(path)
                return
            body += message["body"]
            if not message["more_body"]:
                break
        await self.gate.wait()
        await respond(send, 200, b"%d" % len(body))


async def respond(send: Any, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Edge:
    """One server's state and its connections, each a protocol over a :class:`Transport`."""

    def __init__(self, **limits: Any) -> None:
        self.loop = VirtualLoop()
        self.app = App()
        self.state = ServerState()
        settings = GatewaySettings(
            **{"max_header_bytes": LIMIT, "header_timeout_s": HEADER_TIMEOUT_S, "body_timeout_s": BODY_TIMEOUT_S}
            | limits
        )
        self.protocol_class = limited_http_protocol(settings)
        self.config = uvicorn.Config(app=self.app, lifespan="off", log_level="warning", proxy_headers=False)
        self.config.load()

    def connect(self) -> tuple[LimitedHttpToolsProtocol, Transport, CountingParser]:
        protocol = self.protocol_class(config=self.config, server_state=self.state, app_state={}, _loop=self.loop)  # type: ignore[arg-type]
        assert isinstance(protocol, LimitedHttpToolsProtocol)
        transport = Transport()
        transport.protocol = protocol
        protocol.connection_made(transport)  # type: ignore[arg-type]
        parser = CountingParser(protocol.parser)
        protocol.parser = parser  # type: ignore[assignment]
        return protocol, transport, parser

    def our_timers(self) -> int:
        return sum(1 for timer in self.loop.made if getattr(timer.callback, "__name__", "") == "_on_timer")


def get(path: str = "/", extra: bytes = b"") -> bytes:
    return b"GET " + path.encode() + b" HTTP/1.1\r\nhost: gw\r\n" + extra + b"\r\n"


def post(body: bytes, path: str = "/") -> bytes:
    return b"POST %s HTTP/1.1\r\nhost: gw\r\ncontent-length: %d\r\n\r\n" % (path.encode(), len(body)) + body


def status_of(written: bytes) -> int:
    return int(written.split(b" ", 2)[1])


def error_code_of(written: bytes) -> str:
    head, _, body = written.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head, head
    code: str = json.loads(body)["error"]["code"]
    return code


def read_until_closed(protocol: LimitedHttpToolsProtocol, transport: Transport, data: bytes, read_size: int) -> int:
    """Hands ``data`` to ``protocol`` ``read_size`` bytes a read until it is read or the connection closes;
    the bytes handed over."""
    sent = 0
    while sent < len(data) and not transport.closed:
        protocol.data_received(data[sent : sent + read_size])
        sent += read_size
    return sent


async def answered(transport: Transport, count: int = 1) -> None:
    await eventually(lambda: transport.written.count(b"HTTP/1.1 ") >= count, f"{count} answer(s)", timeout_s=5)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


# header size ---------------------------------------------------------------------------------------
HUGE_HEADERS = {
    "one huge header": get(extra=b"x-big: " + b"a" * 20 * LIMIT + b"\r\n"),
    "many medium headers": get(extra=b"".join(b"x-h%d: %s\r\n" % (n, b"b" * 200) for n in range(100))),
    "a huge URL": get("/" + "u" * 20 * LIMIT),
    "a huge header name": get(extra=b"x-" + b"n" * 20 * LIMIT + b": v\r\n"),
}


@pytest.mark.parametrize("read_size", [1 << 20, 4096, 7, 1], ids=["one read", "4 KiB reads", "7-byte reads", "bytes"])
@pytest.mark.parametrize("case", list(HUGE_HEADERS))
async def test_headers_over_the_limit_get_431_and_no_byte_past_it_is_parsed(case: str, read_size: int) -> None:
    edge = Edge()
    protocol, transport, parser = edge.connect()
    request = HUGE_HEADERS[case]
    read_until_closed(protocol, transport, request, read_size)
    assert transport.closed, f"{case}: the connection must close"
    assert status_of(transport.written) == 431, transport.written[:200]
    assert error_code_of(transport.written) == "headers_too_large"
    assert b"BATCHWIRE_MAX_HEADER_BYTES" in transport.written
    assert parser.fed <= LIMIT, f"{case}: the parser was given {parser.fed} bytes; the limit is {LIMIT}"
    assert edge.app.calls == [], "the app must never see the request"


async def test_headers_of_exactly_the_limit_are_served() -> None:
    edge = Edge()
    protocol, transport, _ = edge.connect()
    request = get(extra=b"x-pad: ")
    request = request[:-2] + b"p" * (LIMIT - len(request) - 2) + b"\r\n\r\n"
    assert len(request) == LIMIT
    protocol.data_received(request)
    await answered(transport)
    assert status_of(transport.written) == 200, transport.written


async def test_a_body_in_the_same_read_as_its_headers_is_not_counted_as_headers() -> None:
    edge = Edge()
    protocol, transport, _ = edge.connect()
    protocol.data_received(post(b"j" * 50 * LIMIT))
    await answered(transport)
    assert transport.written.endswith(b"\r\n\r\n%d" % (50 * LIMIT)), transport.written


async def test_the_count_starts_again_for_each_request_on_a_connection() -> None:
    edge = Edge()
    protocol, transport, _ = edge.connect()
    request = get(extra=b"x-pad: " + b"p" * (LIMIT - 100) + b"\r\n")
    for n in range(1, 4):
        protocol.data_received(request)
        await answered(transport, n)
    assert transport.written.count(b"HTTP/1.1 200 ") == 3, transport.written


async def test_pipelined_requests_in_one_read_are_all_answered() -> None:
    edge = Edge()
    protocol, transport, _ = edge.connect()
    protocol.data_received(get("/a") + post(b"x" * 3000, "/b") + get("/c") * 20)
    await answered(transport, 22)
    assert edge.app.calls == ["/a", "/b"] + ["/c"] * 20
    assert not transport.closed


async def test_many_small_pipelined_requests_in_one_large_read_are_not_refused() -> None:
    edge = Edge()
    protocol, transport, _ = edge.connect()
    many = get("/p") * 200  # far more than the limit in one read, each request small
    protocol.data_received(many[:-10])
    protocol.data_received(many[-10:])
    await answered(transport, 200)
    assert b" 431 " not in transport.written
    assert not transport.closed


@pytest.mark.parametrize("limit", [LIMIT, 16_384], ids=["1 KiB headers", "16 KiB headers"])
async def test_requests_pipelined_past_a_few_wait_unparsed_and_are_all_answered_in_order(limit: int) -> None:
    """uvicorn parses a whole read and queues every request in it (about 2 KB each: its scope and cycle):
    ten connections that each sent 256 KiB of pipelined ``GET`` and read nothing grew the gateway by 240 MB.
    Past ``PIPELINE_DEPTH`` queued requests the rest waits unparsed, and is parsed as the queue drains."""
    edge = Edge(max_header_bytes=limit)
    edge.app.gate.clear()
    protocol, transport, parser = edge.connect()
    count = 3000
    protocol.data_received(get("/p") * count)
    await settle()
    queued = len(protocol.pipeline)
    assert queued <= PIPELINE_DEPTH + HEAD_PIECE_BYTES // len(get("/p")), f"{queued} requests were read and queued"
    assert parser.fed <= 2 * HEAD_PIECE_BYTES, f"{parser.fed} bytes were parsed"
    edge.app.gate.set()
    await answered(transport, count)
    assert edge.app.calls == ["/p"] * count
    assert transport.written.count(b"HTTP/1.1 200 ") == count and not transport.closed


@pytest.mark.parametrize("limit", [LIMIT, 16_384], ids=["1 KiB headers", "16 KiB headers"])
async def test_requests_pipelined_behind_the_end_of_a_body_wait_unparsed_past_a_few(limit: int) -> None:
    """A read that begins in a body (its last bytes) and goes on with pipelined requests is held to
    ``PIPELINE_DEPTH`` like one that begins with a head: parsed whole, a read of the header limit's
    size queued every request in it (about 560 ``GET`` at 16 KiB)."""
    edge = Edge(max_header_bytes=limit)
    edge.app.gate.clear()
    protocol, transport, _ = edge.connect()
    protocol.data_received(b"POST /body HTTP/1.1\r\nhost: gw\r\ncontent-length: 5\r\n\r\nhell")
    await eventually(lambda: edge.app.calls == ["/body"], "the app to wait for the body")
    count = (limit - 1) // len(get("/p"))
    protocol.data_received(b"o" + get("/p") * count)
    await settle()
    queued = len(protocol.pipeline)
    assert queued <= PIPELINE_DEPTH + HEAD_PIECE_BYTES // len(get("/p")), f"{queued} requests were read and queued"
    edge.app.gate.set()
    await answered(transport, count + 1)
    assert edge.app.calls == ["/body"] + ["/p"] * count
    assert transport.written.count(b"HTTP/1.1 200 ") == count + 1 and not transport.closed


async def test_a_read_that_holds_one_request_is_parsed_in_one_go_however_long() -> None:
    """Only a read that may hold many requests is parsed a piece at a time (``PIPELINE_DEPTH``): a
    request of a few KB, headers and body in one read, is the common case on every connection, and
    parsing it in pieces costs a parse each."""
    edge = Edge(max_header_bytes=16_384)
    protocol, transport, parser = edge.connect()
    request = post(b'{"input": "' + b"x" * (4 * HEAD_PIECE_BYTES) + b'"}', "/one")
    protocol.data_received(request)
    await answered(transport)
    assert parser.feeds == 1, f"a read of {len(request)} bytes holding one request was parsed in {parser.feeds} pieces"
    assert edge.app.calls == ["/one"] and status_of(transport.written) == 200


@pytest.mark.parametrize("behind", ["a GET", "a POST"])
async def test_a_huge_header_pipelined_behind_a_request_is_refused_within_the_limit(behind: str) -> None:
    edge = Edge()
    protocol, transport, parser = edge.connect()
    first = get("/first") if behind == "a GET" else post(b"y" * 500, "/first")
    huge = HUGE_HEADERS["one huge header"]
    data = first + huge
    for start in range(0, len(data), 4096):
        if transport.closed:
            break
        protocol.data_received(data[start : start + 4096])
    assert transport.closed, "the connection must close"
    assert parser.fed <= len(first) + LIMIT, f"parsed {parser.fed} bytes; at most {len(first) + LIMIT} may be"


# deadlines ------------------------------------------------------------------------------------------
async def test_a_connection_that_sends_nothing_is_closed_silently_at_the_header_timeout() -> None:
    edge = Edge()
    _, transport, _ = edge.connect()
    edge.loop.advance(HEADER_TIMEOUT_S - 0.01)
    assert not transport.closed, "closed before the header timeout"
    edge.loop.advance(0.02)
    assert transport.closed, "an idle connection must be closed at the header timeout"
    assert transport.written == b"", "nothing was asked, so nothing is answered"


async def test_headers_trickled_a_byte_a_second_get_408_at_the_header_timeout() -> None:
    edge = Edge()
    protocol, transport, _ = edge.connect()
    request = get(extra=b"x-slow: " + b"s" * 100 + b"\r\n")
    for n in range(int(HEADER_TIMEOUT_S) + 5):
        if transport.closed:
            break
        protocol.data_received(request[n : n + 1])
        edge.loop.advance(1.0)
    assert transport.closed
    assert edge.loop.now - 1000.0 == pytest.approx(HEADER_TIMEOUT_S, abs=1.0), "closed at the header timeout"
    assert status_of(transport.written) == 408
    assert error_code_of(transport.written) == "request_timeout"
    assert b"BATCHWIRE_HEADER_TIMEOUT_S" in transport.written
    assert edge.app.calls == []


async def test_the_header_timeout_counts_from_the_end_of_the_previous_response() -> None:
    edge = Edge()
    protocol, transport, _ = edge.connect()
    edge.loop.advance(HEADER_TIMEOUT_S * 0.9)
    protocol.data_received(get())
    await answered(transport)
    edge.loop.advance(4.0)
    protocol.data_received(b"GET / HT")
    edge.loop.advance(HEADER_TIMEOUT_S - 4.0 - 0.1)
    assert not transport.closed, "the header timeout runs from the end of the response"
    edge.loop.advance(0.2)
    assert transport.closed
    assert transport.written.count(b"HTTP/1.1 ") == 2
    assert status_of(transport.written[transport.written.rindex(b"HTTP/1.1 ") :]) == 408


async def test_an_idle_keep_alive_connection_stays_open_until_the_header_timeout() -> None:
    """Past the 5 s that clients keep an idle connection (httpx, openai-python): the client closes
    first, and never writes a request into a connection that the gateway is closing."""
    edge = Edge()
    protocol, transport, _ = edge.connect()
    protocol.data_received(get())
    await answered(transport)
    edge.loop.advance(HEADER_TIMEOUT_S - 0.1)
    assert not transport.closed, "still open for the client's next request"
    edge.loop.advance(0.2)
    assert transport.closed and transport.written.count(b"HTTP/1.1 ") == 1, "closed without a word"


@pytest.mark.parametrize("shape", ["short of its content-length", "chunked without end"])
async def test_a_body_that_does_not_come_gets_408_at_the_body_timeout(shape: str) -> None:
    edge = Edge()
    protocol, transport, _ = edge.connect()
    if shape == "chunked without end":
        protocol.data_received(b"POST /b HTTP/1.1\r\nhost: gw\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(int(BODY_TIMEOUT_S) + 5):
            if transport.closed:
                break
            protocol.data_received(b"1\r\nz\r\n")
            edge.loop.advance(1.0)
    else:
        protocol.data_received(b"POST /b HTTP/1.1\r\nhost: gw\r\ncontent-length: 100\r\n\r\n0123456789")
        await settle()
        edge.loop.advance(BODY_TIMEOUT_S - 0.01)
        assert not transport.closed
        edge.loop.advance(0.02)
    assert transport.closed
    assert status_of(transport.written) == 408, transport.written
    assert error_code_of(transport.written) == "request_timeout"
    assert b"BATCHWIRE_BODY_TIMEOUT_S" in transport.written
    await eventually(lambda: edge.app.disconnected == ["/b"], "the app to see the client gone", timeout_s=5)
    assert transport.written.count(b"HTTP/1.1 ") == 1, "the app's own answer must not follow the 408"


async def test_no_deadline_runs_while_the_app_works_on_a_request() -> None:
    edge = Edge()
    protocol, transport, _ = edge.connect()
    edge.app.gate.clear()
    protocol.data_received(post(b"{}"))
    await settle()
    edge.loop.advance(HEADER_TIMEOUT_S + BODY_TIMEOUT_S + 100)
    assert not transport.closed, "a slow answer is the app's business, not the connection's"
    edge.app.gate.set()
    await answered(transport)
    assert status_of(transport.written) == 200


async def test_an_answer_before_a_long_body_half_closes_reads_and_drops_it_and_closes_at_its_end() -> None:
    """A client that writes its whole body before it reads (httpx) reads the answer once its write ends:
    the rest is read as it comes, in reads as large as the socket gives (20 MiB in 256 KiB reads is
    within the pieces' bound of a 64 KiB limit, 1024; cut into pieces of the header limit it is not),
    kept nowhere, and a request behind it is not served."""
    edge = Edge(max_body_bytes=65536)
    protocol, transport, parser = edge.connect()
    read, reads = b"x" * 256 * 1024, 80
    head = b"POST /early HTTP/1.1\r\nhost: gw\r\ncontent-length: %d\r\n\r\n" % (len(read) * reads)
    protocol.data_received(head)
    await answered(transport)
    assert status_of(transport.written) == 415
    assert transport.eof_written, "the client sees the answer end"
    for _ in range(reads - 1):
        protocol.data_received(read)
        assert not transport.read_paused and not transport.closed, "the rest of the body is read"
    assert protocol.cycle.body == b"", "and kept nowhere"
    protocol.data_received(read + get("/next"))
    assert transport.closed, "closed once the body ended"
    assert parser.fed == len(head) + len(read) * reads + len(get("/next")), parser.fed
    await settle()
    assert edge.app.calls == ["/early"], "a request behind the body is not served"
    assert transport.written.count(b"HTTP/1.1 ") == 1, transport.written


@pytest.mark.parametrize("framing", [b"content-length: 1000000", b"transfer-encoding: chunked"])
async def test_a_long_body_answered_early_is_read_until_the_body_deadline_at_most(framing: bytes) -> None:
    edge = Edge()
    protocol, transport, _ = edge.connect()
    protocol.data_received(b"POST /early HTTP/1.1\r\nhost: gw\r\n" + framing + b"\r\n\r\n")
    await answered(transport)
    edge.loop.advance(BODY_TIMEOUT_S / 2)  # past uvicorn's keep-alive timeout
    protocol.data_received(b"1\r\nz\r\n")
    edge.loop.advance(BODY_TIMEOUT_S / 2 - 0.1)
    assert not transport.closed, "the body deadline bounds the drain, no shorter timer"
    for _ in range(10):
        protocol.data_received(b"1\r\nz\r\n")
    edge.loop.advance(0.2)
    assert transport.closed, "closed at the body deadline"
    assert transport.written.count(b"HTTP/1.1 ") == 1, "no 408 behind the answer"


async def test_an_answer_before_a_short_body_reads_and_drops_it_and_serves_the_next_request() -> None:
    edge = Edge()
    protocol, transport, _ = edge.connect()
    body = b'{"input": "cross-site"}'
    head, rest = post(body, "/early")[: -len(body) + 4], body[4:]
    protocol.data_received(head)  # the answer comes before the body's rest, as under load
    await answered(transport)
    assert status_of(transport.written) == 415
    assert not transport.read_paused and not transport.eof_written, "the connection stays usable"
    protocol.data_received(rest)
    protocol.data_received(post(b"1234"))
    await answered(transport, 2)
    assert transport.written.rsplit(b"HTTP/1.1 ", 1)[1].endswith(b"4"), "the next request is read whole, alone"
    assert edge.app.calls == ["/early", "/"]
    edge.loop.advance(HEADER_TIMEOUT_S + 1)
    assert transport.closed, "then it idles under the header deadline, as any kept connection"


async def test_an_answer_before_a_body_that_never_ends_is_closed_at_the_body_deadline() -> None:
    edge = Edge()
    protocol, transport, _ = edge.connect()
    protocol.data_received(b"POST /early HTTP/1.1\r\nhost: gw\r\ncontent-length: 100\r\n\r\nxx")
    await answered(transport)
    edge.loop.advance(BODY_TIMEOUT_S + 1)
    assert transport.closed


async def test_a_busy_keep_alive_connection_makes_few_timers() -> None:
    edge = Edge()
    protocol, transport, _ = edge.connect()
    for n in range(1, 201):
        protocol.data_received(get() if n % 2 else post(b'{"input": "x"}'))
        await answered(transport, n)
        edge.loop.advance(0.1)
    assert edge.our_timers() <= 1 + int(200 * 0.1 / HEADER_TIMEOUT_S) + 1, f"{edge.our_timers()} timers"


# connections and bad requests -------------------------------------------------------------------
async def test_at_the_cap_a_new_connection_whose_head_comes_takes_the_longest_waiting_slow_one_s_place() -> None:
    edge = Edge(max_connections=3)
    _, oldest_silent, _ = edge.connect()
    served, served_transport, _ = edge.connect()
    served.data_received(get())
    await answered(served_transport)
    edge.loop.advance(SLOW_AFTER_S)
    _, newer_silent, _ = edge.connect()
    _, silent_newcomer_transport, _ = edge.connect()
    assert not oldest_silent.closed, "a new connection that sends nothing takes no one's place"
    assert silent_newcomer_transport.written == b"" and not silent_newcomer_transport.closed, "held apart"
    admitted, admitted_transport, _ = edge.connect()
    admitted.data_received(post(b'{"input":"x"}'))
    assert oldest_silent.closed and oldest_silent.written == b"", "the longest waiting one makes room, unanswered"
    await answered(admitted_transport)
    assert status_of(admitted_transport.written) == 200, "the new connection is served"
    assert not newer_silent.closed and not served_transport.closed
    also_admitted, also_admitted_transport, _ = edge.connect()
    also_admitted.data_received(get())
    assert served_transport.closed, "a keep-alive connection idle SLOW_AFTER_S since its answer makes room too"
    await answered(also_admitted_transport)
    assert not newer_silent.closed, "one waiting for less than SLOW_AFTER_S keeps its place"
    refused, refused_transport, _ = edge.connect()
    refused.data_received(get())
    assert status_of(refused_transport.written) == 503, "no one slow: the new one's request is answered 503"
    edge.loop.advance(SLOW_AFTER_S)
    again, again_transport, _ = edge.connect()
    again.data_received(get())
    assert newer_silent.closed, "then the next longest waiting one without a request"
    await answered(again_transport)
    assert status_of(again_transport.written) == 200
    await settle()
    assert len(edge.state.connections) == 3
    assert edge.protocol_class.occupancy.closing == 0, "closes that made room are done"


async def test_a_new_connection_whose_head_comes_in_pieces_takes_a_place_once_it_is_whole() -> None:
    edge = Edge(max_connections=1)
    _, silent, _ = edge.connect()
    edge.loop.advance(SLOW_AFTER_S)
    newcomer, newcomer_transport, parser = edge.connect()
    request = post(b'{"input":"x"}', "/piecewise")
    newcomer.data_received(request[:12])
    assert not silent.closed, "not before its head is whole"
    newcomer.data_received(request[12:-5])
    assert silent.closed and parser.fed == len(request) - 5, "what it sent so far reaches the parser"
    newcomer.data_received(request[-5:])
    await answered(newcomer_transport)
    assert edge.app.calls == ["/piecewise"] and status_of(newcomer_transport.written) == 200
    await settle()
    assert edge.protocol_class.occupancy.refusing == 0 and len(edge.state.connections) == 1


async def test_at_the_cap_a_connection_whose_request_is_worked_on_keeps_its_place() -> None:
    """Connections that send one cheap request and then trickle the next wait for a request like new
    ones (evictable); one whose request the app works on does not."""
    edge = Edge(max_connections=2)
    trickler, trickler_transport, _ = edge.connect()
    trickler.data_received(get("/healthz"))
    await answered(trickler_transport)
    trickler.data_received(b"GET / HTTP/1.1\r\nhost")  # the next request's headers, trickled
    edge.app.gate.clear()
    busy, busy_transport, _ = edge.connect()
    busy.data_received(post(b"x"))
    await eventually(lambda: "/" in edge.app.calls, "the app to work on the request")
    edge.loop.advance(SLOW_AFTER_S)
    new, new_transport, _ = edge.connect()
    new.data_received(get("/new"))
    assert trickler_transport.closed, "the trickling keep-alive connection makes room"
    assert not busy_transport.closed and not new_transport.closed, "the one being answered keeps its place"
    edge.app.gate.set()
    await answered(busy_transport)


async def test_at_the_cap_a_connection_stalled_in_its_body_makes_room_like_one_stalled_in_its_head() -> None:
    """A request's body is part of the request: a connection that sent its headers and stalls in its body
    has not sent a whole request, and once it has waited ``SLOW_AFTER_S`` it makes room for a new client, as
    a trickling one does. Else one client holding the cap with bodies it never ends shut every other client
    out until the body timeout, and again after it. The app reading the body is told the client left."""
    edge = Edge(max_connections=1)
    stalled, stalled_transport, _ = edge.connect()
    stalled.data_received(b"POST /stalled HTTP/1.1\r\nhost: gw\r\ncontent-length: 100\r\n\r\n" + b"x" * 10)
    await eventually(lambda: "/stalled" in edge.app.calls, "the app to read the stalled body")
    edge.loop.advance(SLOW_AFTER_S)
    new, new_transport, _ = edge.connect()
    new.data_received(get("/new"))
    assert stalled_transport.closed and stalled_transport.written == b"", "the stalled body's connection makes room"
    await answered(new_transport)
    assert status_of(new_transport.written) == 200, new_transport.written[:200]
    await eventually(lambda: edge.app.disconnected == ["/stalled"], "the app to be told its client left")


@pytest.mark.parametrize("closed_by", ["the header timeout", "the cap", "connection: close"])
async def test_a_connection_closed_with_its_answer_unread_is_reset(closed_by: str) -> None:
    """A close waits for the client to read what was written to it: a client that asks for a large answer
    and never reads it (its window shut) would hold the connection, its descriptor and the answer's bytes
    for ever, counted against no cap once closing. Idle with its answer unread until the header timeout,
    or until a new client needs its place at the cap, it is reset at once; closed after a ``connection:
    close`` answer, it is reset if that answer is still unread a header timeout later."""
    edge = Edge(max_connections=1)
    protocol, transport, _ = edge.connect()
    transport.unread = 200_000  # the answer's bytes, written and never read
    protocol.data_received(get(extra=b"connection: close\r\n" if closed_by == "connection: close" else b""))
    await answered(transport)
    if closed_by == "the cap":
        edge.loop.advance(SLOW_AFTER_S)
        new, new_transport, _ = edge.connect()
        new.data_received(get("/new"))
        await answered(new_transport)
        assert status_of(new_transport.written) == 200, "the new client takes its place"
    else:
        edge.loop.advance(HEADER_TIMEOUT_S - 0.1)
        assert not transport.aborted, "a client has the header timeout to read its answer"
        edge.loop.advance(0.1)
    assert transport.aborted, f"closed by {closed_by} with its answer unread: reset"
    await settle()
    assert protocol not in edge.state.connections and edge.protocol_class.occupancy.closing == 0


@pytest.mark.parametrize("client", ["never reads", "reads", "reads slowly"])
async def test_a_stream_whose_client_reads_nothing_for_a_header_timeout_is_reset(client: str) -> None:
    """A streaming answer (an event stream) whose client never reads fills the write buffer, and the
    app's next send waits for it to drain: for ever, so the stream would hold its place among the
    watchers and at the cap past its own end (``--sse-max-s``), and shutdown. A client has a header
    timeout to read what was written, as at a close; one that reads meanwhile keeps its stream."""
    edge = Edge()
    edge.app.gate.clear()
    protocol, transport, _ = edge.connect()
    protocol.data_received(get("/stream"))
    await eventually(lambda: b"data: 1" in transport.written, "the first event")
    transport.unread = 3 * HIGH_WATER
    protocol.pause_writing()  # the transport's write buffer is over its high-water mark
    edge.app.gate.set()
    await settle()
    edge.loop.advance(HEADER_TIMEOUT_S - 0.1)
    assert not transport.aborted, "a client has the header timeout to read"
    assert b"data: 2" not in transport.written, "the next event waits for the buffer to drain"
    if client == "reads slowly":  # a long answer, read a little in each header timeout: never drained
        for _ in range(2):
            transport.unread -= HIGH_WATER // 2
            edge.loop.advance(HEADER_TIMEOUT_S)
            assert not transport.aborted, "a client that reads some keeps its connection"
        edge.loop.advance(HEADER_TIMEOUT_S)
        assert transport.aborted, "... until it reads nothing for a header timeout"
        return
    if client == "reads":
        transport.unread = 0
        protocol.resume_writing()
        await eventually(lambda: b"data: 2" in transport.written, "the next event, once the client read")
        edge.loop.advance(HEADER_TIMEOUT_S)
        assert not transport.aborted, "a stream whose client reads goes on"
        return
    edge.loop.advance(0.1)
    assert transport.aborted, "the stream whose client read nothing for a header timeout is reset"
    await eventually(lambda: edge.app.disconnected == ["/stream"], "the app to be told its client left")
    assert protocol not in edge.state.connections


async def test_a_whole_answer_read_slowly_keeps_its_connection_past_the_keep_alive_timeout() -> None:
    """A long answer written in one send (an embeddings list) completes at once, and the wait for the
    next request starts; a client still reading it, slowly, is not idle, and keeps its connection
    until it reads nothing for a header timeout."""
    edge = Edge()
    protocol, transport, _ = edge.connect()
    protocol.data_received(get("/"))
    await eventually(lambda: b"200" in transport.written, "the answer")
    await settle()
    transport.unread = 4 * HIGH_WATER  # the answer is long: the write buffer is over its high-water mark
    protocol.pause_writing()
    for step in range(6):  # the client reads some every half header timeout
        transport.unread -= HIGH_WATER // 2
        edge.loop.advance(HEADER_TIMEOUT_S / 2)
        assert not transport.aborted, f"reset at {(step + 1) * HEADER_TIMEOUT_S / 2} s though the client was reading"
    edge.loop.advance(HEADER_TIMEOUT_S)
    assert transport.aborted, "a client that then reads nothing for a header timeout is reset"


async def test_at_the_cap_with_every_connection_proven_a_new_ones_request_gets_503_unread() -> None:
    edge = Edge(max_connections=2, retry_after_s=3)
    transports = []
    for _ in range(2):
        protocol, transport, _ = edge.connect()
        protocol.data_received(get())
        await answered(transport)
        transports.append(transport)
    over, over_transport, parser = edge.connect()
    assert over_transport.written == b"" and not over_transport.closed, "it waits for the request it will answer"
    over.data_received(post(b'{"input":"x"}'))
    assert status_of(over_transport.written) == 503
    assert error_code_of(over_transport.written) == "too_many_connections"
    assert b"retry-after: 3\r\n" in over_transport.written
    assert b"BATCHWIRE_MAX_CONNECTIONS" in over_transport.written
    assert not over_transport.closed, "open for the client to close it: unread bytes would make the close a reset"
    written = over_transport.written
    over.data_received(b"more of the body")
    assert over_transport.written == written and parser.fed == 0, "what comes after is dropped unparsed"
    edge.loop.advance(REFUSAL_LINGER_S)
    assert over_transport.closed, "closed when the client has not closed by then"
    await settle()
    assert len(edge.state.connections) == 2, "a refused connection is not counted"
    assert edge.protocol_class.occupancy.refusing == 0
    transports[0].close()
    await settle()
    assert len(edge.state.connections) == 1
    _, again, _ = edge.connect()
    assert not again.closed and again.written == b"", "a closed connection frees its place"


async def test_a_refused_connection_that_sends_past_a_request_s_worth_is_answered_and_closed() -> None:
    edge = Edge(max_connections=1)
    protocol, transport, _ = edge.connect()
    protocol.data_received(get())
    await answered(transport)
    over, over_transport, parser = edge.connect()
    over.data_received(b"POST / HTTP/1.1\r\nhost: gw\r\ncontent-length: 100000000\r\n\r\n")
    chunk = b"x" * 65536
    for _ in range(REFUSED_READ_BYTES // len(chunk) - 1):
        over.data_received(chunk)
    assert over_transport.written == b"" and not over_transport.closed, "up to a request's worth is read"
    over.data_received(chunk)
    assert status_of(over_transport.written) == 503 and over_transport.closed
    assert parser.fed == 0


async def test_a_refused_connection_that_sends_nothing_is_answered_at_the_header_timeout() -> None:
    edge = Edge(max_connections=2)
    for _ in range(2):
        protocol, transport, _ = edge.connect()
        protocol.data_received(get())
        await answered(transport)
    _, silent, _ = edge.connect()
    edge.loop.advance(HEADER_TIMEOUT_S - 0.1)
    assert silent.written == b"" and not silent.closed
    edge.loop.advance(0.1)
    assert status_of(silent.written) == 503 and silent.closed


async def test_past_the_refusal_budget_the_oldest_unanswered_makes_room_one_without_a_head_first() -> None:
    edge = Edge(max_connections=2)
    assert edge.protocol_class.max_refusing == 2, "as many as the cap"
    edge.app.gate.clear()  # the two in the cap are worked on all along: no place to take
    for _ in range(2):
        protocol, _, _ = edge.connect()
        protocol.data_received(get())
    await eventually(lambda: len(edge.app.calls) == 2, "the app to work on both requests")
    headed, headed_transport, _ = edge.connect()
    headed.data_received(post(b"{}")[:-2])  # its head came, its body not yet
    _, silent, _ = edge.connect()
    newest, newest_transport, _ = edge.connect()
    assert status_of(silent.written) == 503 and silent.closed, "the oldest held one without a head makes room"
    assert newest_transport.written == b"" and not newest_transport.closed, "the new one is held in its place"
    assert headed_transport.written == b"" and not headed_transport.closed, "one whose head came is kept longer"
    await settle()
    newest.data_received(post(b"{}")[:-2])
    _, newer, _ = edge.connect()
    assert status_of(headed_transport.written) == 503 and headed_transport.closed, "then the oldest unanswered"
    assert not newest_transport.closed and not newer.closed
    await settle()
    newer.protocol.data_received(post(b"{}"))
    newest.data_received(b"{}")
    assert status_of(newer.written) == 503 and status_of(newest_transport.written) == 503, "no place to take"
    assert not newer.closed and not newest_transport.closed, "answered, and open for the client to close"
    _, unheld, _ = edge.connect()
    assert status_of(unheld.written) == 503 and unheld.closed, "every held one has its answer: answered at once"
    await settle()
    assert edge.protocol_class.occupancy.refusing == 2, "the ones still held"
    edge.app.gate.set()


async def test_a_held_request_that_waits_for_100_continue_is_refused_at_its_head() -> None:
    """Its client sends the body only after an answer: the 503 is that answer (not the header timeout)."""
    edge = Edge(max_connections=1)
    edge.app.gate.clear()
    protocol, _, _ = edge.connect()
    protocol.data_received(get())
    await eventually(lambda: edge.app.calls == ["/"], "the app to work on the request")
    held, held_transport, _ = edge.connect()
    held.data_received(b"POST / HTTP/1.1\r\nhost: gw\r\nexpect: 100-continue\r\ncontent-length: 5\r\n\r\n")
    assert status_of(held_transport.written) == 503 and not held_transport.closed
    edge.app.gate.set()


async def test_a_held_connection_takes_a_place_freed_since_it_came_and_closes_no_one() -> None:
    edge = Edge(max_connections=2)
    _, silent, _ = edge.connect()
    protocol, transport, _ = edge.connect()
    protocol.data_received(get())
    await answered(transport)
    edge.loop.advance(SLOW_AFTER_S)
    held, held_transport, _ = edge.connect()
    transport.close()
    await settle()
    held.data_received(get("/held"))
    await answered(held_transport)
    assert status_of(held_transport.written) == 200 and edge.app.calls[-1] == "/held"
    assert not silent.closed, "the place was free: no one is closed for it"


async def test_a_slow_looking_connection_whose_bytes_wait_unread_keeps_its_place() -> None:
    """A busy loop has not read it yet, or a keep-alive client has just sent its next request."""
    edge = Edge(max_connections=1)
    protocol, transport, _ = edge.connect()
    protocol.data_received(get())
    await answered(transport)
    ours, theirs = socket.socketpair()
    try:
        transport.sock = ours
        theirs.sendall(get("/next"))  # in the socket, not read
        edge.loop.advance(SLOW_AFTER_S * 4)
        newcomer, newcomer_transport, _ = edge.connect()
        newcomer.data_received(get("/newcomer"))
        assert not transport.closed, "its request waits to be read: not slow"
        assert status_of(newcomer_transport.written) == 503
        ours.recv(1024)  # read: now it is idle
        edge.loop.advance(REFUSAL_LINGER_S)  # the refused one closes: the budget has room again
        await settle()
        _, again, _ = edge.connect()
        again.protocol.data_received(get("/again"))
        assert transport.closed, "idle, with nothing unread: it makes room"
    finally:
        ours.close()
        theirs.close()


async def test_once_the_server_shuts_down_a_held_connection_takes_no_place() -> None:
    edge = Edge(max_connections=1)
    protocol, transport, _ = edge.connect()
    protocol.data_received(get())
    await answered(transport)
    edge.loop.advance(SLOW_AFTER_S)
    held, held_transport, _ = edge.connect()
    protocol.shutdown()
    assert transport.closed, "uvicorn's shutdown closes its idle connection"
    held.data_received(get("/held"))
    assert status_of(held_transport.written) == 503 and "/held" not in edge.app.calls


async def test_over_the_cap_a_probe_or_a_scrape_is_served_and_its_connection_closed() -> None:
    edge = Edge(max_connections=1)
    protocol, transport, _ = edge.connect()
    protocol.data_received(get())
    await answered(transport)
    for path in ("/healthz", "/readyz", "/metrics?name=x"):
        over, over_transport, _ = edge.connect()
        over.data_received(get(path)[:10])
        assert over_transport.written == b"", "nothing before the head has come"
        over.data_received(get(path)[10:])
        await answered(over_transport)
        assert status_of(over_transport.written) == 200, over_transport.written
        assert b"connection: close" in over_transport.written.lower()
        await settle()
        assert over_transport.closed, "one answer, then its place over the cap is given back"
    assert edge.app.calls[1:] == ["/healthz", "/readyz", "/metrics"]
    await settle()
    assert edge.protocol_class.occupancy.operations == 0 and edge.protocol_class.occupancy.refusing == 0
    assert len(edge.state.connections) == 1


async def test_over_the_cap_other_requests_to_operations_paths_are_refused() -> None:
    edge = Edge(max_connections=1)
    protocol, _, _ = edge.connect()
    edge.app.gate.clear()  # its request is worked on all along: its place is never given up
    protocol.data_received(get())
    await eventually(lambda: edge.app.calls == ["/"], "the app to work on the request")
    big_head = get("/metrics", b"x-big: " + b"a" * LIMIT + b"\r\n")
    for request in (post(b"{}", "/healthz"), get("/healthzz"), get("/v1/result/x"), big_head):
        over, over_transport, parser = edge.connect()
        over.data_received(request)
        assert status_of(over_transport.written) == 503, request
        assert parser.fed == 0
        edge.loop.advance(REFUSAL_LINGER_S)  # closed: the next one is refused within the budget, as this one
        await settle()
    assert edge.app.calls == ["/"]


async def test_at_most_so_many_operations_requests_are_served_over_the_cap_at_once() -> None:
    edge = Edge(max_connections=1)
    protocol, transport, _ = edge.connect()
    protocol.data_received(get())
    await answered(transport)
    edge.app.gate.clear()
    served = []
    for _ in range(OPERATIONS_OVER_CAP):
        over, over_transport, _ = edge.connect()
        over.data_received(get("/metrics"))
        served.append(over_transport)
    _, refused, _ = edge.connect()
    refused.protocol.data_received(get("/metrics"))
    assert status_of(refused.written) == 503, "past the reserve"
    assert all(transport.written == b"" for transport in served), "held by the app"
    transport.close()
    edge.loop.advance(REFUSAL_LINGER_S)
    await settle()
    _, newcomer, _ = edge.connect()
    newcomer.protocol.data_received(post(b"{}", "/newcomer"))
    await settle()
    assert edge.app.calls[-1] == "/newcomer", "those served over the cap do not take a client's place"
    edge.app.gate.set()
    for over_transport in served:
        await answered(over_transport)
    await settle()
    assert edge.protocol_class.occupancy.operations == 0


async def test_invalid_http_gets_a_json_400() -> None:
    edge = Edge()
    protocol, transport, _ = edge.connect()
    protocol.data_received(b"NOT HTTP AT ALL\r\n\r\n")
    assert transport.closed
    assert status_of(transport.written) == 400
    assert error_code_of(transport.written) == "invalid_http"


async def test_invalid_http_is_counted_not_logged_as_a_warning() -> None:
    """Bytes that are not HTTP are a client's doing: answered 400 and counted at the edge, they log no
    WARNING (uvicorn's "Invalid HTTP request received.", which names neither client nor remedy), or any
    client could fire an operator's alert on WARNING at will."""
    edge = Edge()
    counted = REQUESTS.labels(route="edge", status="400")
    before = counted._value.get()
    seen = _Records()
    uvicorn_log = logging.getLogger("uvicorn.error")  # it propagates to uvicorn's own handler, not the root's
    uvicorn_log.addHandler(seen)
    try:
        for _ in range(3):
            protocol, transport, _ = edge.connect()
            protocol.data_received(b"NOT HTTP AT ALL\r\n\r\n")
            assert status_of(transport.written) == 400
    finally:
        uvicorn_log.removeHandler(seen)
    assert counted._value.get() - before == 3
    loud = [record.getMessage() for record in seen.records if record.levelno >= logging.WARNING]
    assert loud == [], loud


async def test_an_upgrade_the_gateway_does_not_speak_is_served_without_a_warning() -> None:
    """``Upgrade: h2c`` (curl --http2 sends it) is a client's offer, served as plain HTTP/1.1: uvicorn's
    "Unsupported upgrade request." WARNING names nothing to fix, and any client could write one per request."""
    edge = Edge()
    seen = _Records()
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addHandler(seen)
    try:
        protocol, transport, _ = edge.connect()
        protocol.data_received(b"GET /a HTTP/1.1\r\nhost: gw\r\nconnection: upgrade\r\nupgrade: h2c\r\n\r\n")
        await answered(transport)
    finally:
        uvicorn_log.removeHandler(seen)
    assert status_of(transport.written) == 200, transport.written
    loud = [record.getMessage() for record in seen.records if record.levelno >= logging.WARNING]
    assert loud == [], loud


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def chunked(size_line: bytes, path: str = "/", encoding: bytes = b"chunked") -> bytes:
    head = b"POST %s HTTP/1.1\r\nhost: gw\r\ntransfer-encoding: %s\r\n\r\n" % (path.encode(), encoding)
    return head + size_line + b"\r\nabc\r\n0\r\n\r\n"


@pytest.mark.parametrize(
    "framing",
    [chunked(b"zz"), chunked(b"f" * 40), chunked(b"-10"), chunked(b"1 0"), chunked(b"3", encoding=b"xchunked")],
    ids=["zz", "overflow", "negative", "space", "xchunked"],
)
async def test_a_malformed_chunked_body_gets_a_json_400(framing: bytes) -> None:
    edge = Edge()
    protocol, transport, _ = edge.connect()
    protocol.data_received(framing)
    await eventually(lambda: transport.closed, "the connection to close", timeout_s=5)
    assert transport.written.count(b"HTTP/1.1 ") == 1, transport.written
    assert status_of(transport.written) == 400 and error_code_of(transport.written) == "invalid_http"


@pytest.mark.parametrize(
    "encoding",
    [
        b"gzip, chunked",
        b"deflate,chunked",
        b"identity, chunked",
        b"x-evil, chunked",
        b"gzip\r\ntransfer-encoding: chunked",
    ],
    ids=["gzip", "deflate", "identity", "unknown", "gzip in a header of its own"],
)
async def test_a_transfer_coding_besides_chunked_gets_a_json_400_and_never_reaches_the_app(encoding: bytes) -> None:
    """httptools takes any codings before a final ``chunked`` and hands the body on still coded: a
    gzipped body was read as JSON and refused as not UTF-8, which says nothing of what to change."""
    edge = Edge()
    protocol, transport, _ = edge.connect()
    protocol.data_received(chunked(b"3", "/coded", encoding=encoding))
    await eventually(lambda: transport.closed, "the connection to close", timeout_s=5)
    assert transport.written.count(b"HTTP/1.1 ") == 1, transport.written
    assert status_of(transport.written) == 400 and error_code_of(transport.written) == "invalid_http"
    assert edge.app.calls == [], "the app never sees a body it cannot read"


async def test_a_chunked_body_named_in_any_case_is_served() -> None:
    edge = Edge()
    protocol, transport, _ = edge.connect()
    protocol.data_received(chunked(b"3", encoding=b"Chunked"))
    await answered(transport)
    assert status_of(transport.written) == 200 and transport.written.endswith(b"\r\n\r\n3"), transport.written


async def test_requests_pipelined_before_an_invalid_one_are_answered_then_the_400() -> None:
    edge = Edge()
    protocol, transport, _ = edge.connect()
    protocol.data_received(get("/a") * 5 + b"NOT HTTP AT ALL\r\n\r\n" + get("/never"))
    await eventually(lambda: transport.closed, "the connection to close", timeout_s=5)
    answers = [b"HTTP/1.1 " + part for part in transport.written.split(b"HTTP/1.1 ")[1:]]
    assert [status_of(one) for one in answers] == [200] * 5 + [400], transport.written
    assert error_code_of(answers[-1]) == "invalid_http"
    assert edge.app.calls == ["/a"] * 5, "nothing after the invalid request is read"


async def test_a_malformed_body_pipelined_behind_requests_is_answered_400_after_them() -> None:
    edge = Edge()
    protocol, transport, _ = edge.connect()
    protocol.data_received(get("/a") * 2 + chunked(b"zz", "/bad"))
    await eventually(lambda: transport.closed, "the connection to close", timeout_s=5)
    answers = [b"HTTP/1.1 " + part for part in transport.written.split(b"HTTP/1.1 ")[1:]]
    assert [status_of(one) for one in answers] == [200, 200, 400], transport.written
    assert "/bad" not in edge.app.calls, "the request whose body is not HTTP never reaches the app"


def chunked_in(pieces: int) -> bytes:
    head = b"POST /frag HTTP/1.1\r\nhost: gw\r\ntransfer-encoding: chunked\r\n\r\n"
    return head + b"1\r\nx\r\n" * pieces + b"0\r\n\r\n"


async def test_a_body_in_too_many_pieces_gets_400_and_the_app_is_told_the_client_left() -> None:
    edge = Edge()
    pieces = edge.protocol_class.max_body_pieces
    assert pieces == 4096, "a 1 MiB body limit allows 4096 pieces"
    protocol, transport, _ = edge.connect()
    protocol.data_received(chunked_in(pieces + 1))
    await eventually(lambda: transport.closed, "the connection to close", timeout_s=5)
    assert status_of(transport.written) == 400 and error_code_of(transport.written) == "body_too_fragmented"
    await eventually(lambda: edge.app.disconnected == ["/frag"], "the app to see the client leave")
    assert transport.written.count(b"HTTP/1.1 ") == 1, "nothing the app sends after is written"

    whole, whole_transport, _ = edge.connect()
    whole.data_received(chunked_in(pieces))
    await answered(whole_transport)
    assert status_of(whole_transport.written) == 200 and whole_transport.written.endswith(b"%d" % pieces)


TRAILERS = {
    "many trailers": b"0\r\n" + b"t: v\r\n" * 50 * LIMIT,
    "one endless trailer": b"0\r\nx-t: " + b"v" * 200 * LIMIT,
    "endless chunk extensions": b"1;" + b"e" * 200 * LIMIT,
}


@pytest.mark.parametrize("read_size", [1 << 16, 100], ids=["64 KiB reads", "100-byte reads"])
@pytest.mark.parametrize("case", list(TRAILERS))
async def test_a_chunked_bodys_trailers_and_extensions_are_held_to_the_header_limit(case: str, read_size: int) -> None:
    """A chunked body's trailers are headers that come after the body: httptools gathers each whole and
    uvicorn appends it to the request's headers, so trailers sent for the body's 30 s grew the gateway
    by about 20 bytes of memory per byte sent (a single connection: 700 MB in 5 s). They, and the chunk
    sizes and extensions, are held to the header limit beside a few bytes per piece of the body."""
    edge = Edge()
    protocol, transport, _ = edge.connect()
    protocol.data_received(b"POST /body HTTP/1.1\r\nhost: gw\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
    await eventually(lambda: edge.app.calls == ["/body"], "the app to wait for the body")
    rest = TRAILERS[case]
    sent = read_until_closed(protocol, transport, rest, read_size)
    assert transport.closed, f"{case}: all {len(rest)} bytes were read; the connection must close past the limit"
    assert sent <= 3 * LIMIT + read_size, f"{case}: {sent} bytes were read before the refusal"
    assert status_of(transport.written) == 431 and error_code_of(transport.written) == "headers_too_large"
    assert b"trailers" in transport.written and b"BATCHWIRE_MAX_HEADER_BYTES" in transport.written
    await eventually(lambda: edge.app.disconnected == ["/body"], "the app to see the client leave")


async def test_a_chunked_body_of_many_small_chunks_and_a_few_trailers_is_served() -> None:
    edge = Edge()
    pieces = edge.protocol_class.max_body_pieces
    protocol, transport, _ = edge.connect()
    request = chunked_in(pieces)
    protocol.data_received(request[:-2] + b"x-sum: 1\r\nx-sig: " + b"s" * (LIMIT // 2) + b"\r\n\r\n")
    await answered(transport)
    assert status_of(transport.written) == 200 and transport.written.endswith(b"%d" % pieces), transport.written


# the descriptor limit ------------------------------------------------------------------------------
class Rlimit:
    """``resource``'s open-file limit, as a test sets it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, soft: int, hard: int) -> None:
        self.soft, self.hard = soft, hard
        self.raised_to: int | None = None
        monkeypatch.setattr(resource, "getrlimit", lambda which: (self.soft, self.hard))
        monkeypatch.setattr(resource, "setrlimit", self.set)

    def set(self, which: int, limits: tuple[int, int]) -> None:
        self.soft = self.raised_to = limits[0]


def test_the_open_file_limit_is_raised_to_the_hard_limit_when_the_cap_needs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    rlimit = Rlimit(monkeypatch, soft=1024, hard=65536)
    assert connection_cap(10_000) == 10_000
    assert rlimit.raised_to == 65536


def test_a_cap_the_soft_limit_holds_leaves_the_limit_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    rlimit = Rlimit(monkeypatch, soft=20_000, hard=65536)
    assert connection_cap(10_000) == 10_000
    assert rlimit.raised_to is None


def test_a_cap_the_hard_limit_cannot_hold_is_lowered_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    Rlimit(monkeypatch, soft=1024, hard=2048)
    with caplog.at_level(logging.WARNING, logger="gateway.edge.descriptors"):
        assert connection_cap(10_000) == 2048 - FD_RESERVE
    assert "BATCHWIRE_MAX_CONNECTIONS" in caplog.text, caplog.text


def test_as_many_refusals_as_the_cap_may_wait_within_the_spare_descriptors(monkeypatch: pytest.MonkeyPatch) -> None:
    Rlimit(monkeypatch, soft=65536, hard=65536)
    assert refusal_budget(4096) == 4096
    Rlimit(monkeypatch, soft=4096 + FD_RESERVE + 100, hard=65536)
    assert refusal_budget(4096) == 100, "what the cap and the reserve leave"
    Rlimit(monkeypatch, soft=2048, hard=2048)
    assert refusal_budget(2048 - FD_RESERVE) == 0, "none left: refused at once"


async def test_a_burst_at_the_cap_keeps_its_first_connections_and_holds_its_newest() -> None:
    edge = Edge(max_connections=3)
    transports = [edge.connect()[1] for _ in range(13)]  # all in one go: none has sent its request yet
    first, answered_for_room, held = transports[:3], transports[3:10], transports[10:]
    assert not any(transport.closed or transport.written for transport in first + held), "kept, and held apart"
    assert all(status_of(transport.written) == 503 and transport.closed for transport in answered_for_room), (
        "the oldest held ones make room past the budget"
    )
    await settle()
    assert len(edge.state.connections) == 3
    assert edge.protocol_class.occupancy.closing == 0
    assert edge.protocol_class.occupancy.refusing == 3


def edge_answers(status: int) -> float:
    return REGISTRY.get_sample_value("batchwire_requests_total", {"route": EDGE_ROUTE, "status": str(status)}) or 0.0


async def test_the_edge_s_own_answers_are_counted_with_the_app_s() -> None:
    """An operator's error rate includes the connections refused before any route: at the cap, over the
    header limit."""
    refused, too_large = edge_answers(503), edge_answers(431)
    edge = Edge(max_connections=1)
    protocol, transport, _ = edge.connect()
    protocol.data_received(get())
    await answered(transport)
    over, over_transport, _ = edge.connect()
    over.data_received(get())
    assert status_of(over_transport.written) == 503
    assert edge_answers(503) == refused + 1
    transport.close()
    await settle()
    protocol, transport, _ = edge.connect()
    protocol.data_received(HUGE_HEADERS["one huge header"])
    assert status_of(transport.written) == 431
    assert edge_answers(431) == too_large + 1


def requests_counted() -> float:
    """Every answer ``batchwire_requests_total`` has counted, over all routes and statuses."""
    (family,) = REQUESTS.collect()
    return sum(sample.value for sample in family.samples if sample.name.endswith("_total"))


@pytest.mark.parametrize(
    ("body", "code"),
    [(b"zz\r\nabc\r\n0\r\n\r\n", "invalid_http"), (b"1\r\nx\r\n" * 4097 + b"0\r\n\r\n", "body_too_fragmented")],
    ids=["malformed chunk", "too many pieces"],
)
async def test_a_request_the_edge_refuses_mid_body_is_counted_once(body: bytes, code: str) -> None:
    """The edge's answer is the request's one answer: the app, told that the client left, answers nothing
    the client reads, and its route must not count a second answer (a 499 the client never got)."""
    edge = Edge()
    edge.config = uvicorn.Config(app=EdgeMiddleware(edge.app), lifespan="off", log_level="warning", proxy_headers=False)
    edge.config.load()
    protocol, transport, _ = edge.connect()
    protocol.data_received(b"POST /body HTTP/1.1\r\nhost: gw\r\ntransfer-encoding: chunked\r\n\r\n")
    await eventually(lambda: edge.app.calls == ["/body"], "the app to wait for the body")
    counted = requests_counted()
    protocol.data_received(body)
    await eventually(lambda: edge.app.disconnected == ["/body"], "the app to see the client leave")
    await eventually(lambda: not protocol.tasks, "the app's task, its count included, to end")
    assert status_of(transport.written) == 400 and error_code_of(transport.written) == code
    assert requests_counted() == counted + 1, "one request, one answer counted: the edge's"
