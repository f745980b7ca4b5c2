"""Limits at the HTTP edge: header size, header and body deadlines, and open connections.

uvicorn's httptools protocol has none of them, and no setting adds them: it hands the parser a
request line and headers of any size (httptools joins a header value that spans reads by
concatenation, so one huge header costs the event loop quadratic copying), waits forever for
headers or a body (its keep-alive timeout covers only the idle time after a response, and one byte
cancels it), and accepts every connection the process has a descriptor for.
:class:`LimitedHttpToolsProtocol` subclasses it and adds them where the bytes arrive, overriding
only the asyncio callbacks, the parser callbacks, ``on_response_complete`` and
``send_400_response``, each of which calls uvicorn's own:

- pipelined requests are parsed a piece at a time, and once ``PIPELINE_DEPTH`` of them wait behind
  the one being answered, the connection's bytes wait unparsed until they are answered;
- header bytes are counted in ``data_received`` before the parser sees them; a read that would
  cross the limit is parsed only up to it, so no byte past the limit is buffered or parsed; a
  chunked body's bytes that are not body (its chunk sizes and extensions, and its trailers, headers
  after the body that httptools gathers and uvicorn appends to the request's) are held to the same
  limit, beside ``FRAMING_PER_PIECE`` bytes per piece of the body (``_parse_body``);
- each connection has one deadline (headers, from the connection's opening or the end of the
  previous response; a body, from its headers) behind one timer that is re-armed lazily, so a busy
  keep-alive connection makes about one timer per header timeout, not one per request; the header
  deadline is also the keep-alive timeout (uvicorn's own is set past it);
- a connection closed while its client has not read what was written to it is reset (at once when
  it was idle, else a header timeout later, ``_close``): a close waits for that read, which a client
  that never reads never makes; so is one whose client reads nothing of a full write buffer for a
  header timeout (``pause_writing``): a streaming answer's next send waits for that read;
- at the cap, a new connection is held apart and its request read (``gateway.edge.refused_request``).
  Once its head has come whole it takes a place freed meanwhile, or the place of the connection that
  has waited longest for a whole request, head and body (since it opened, or since its last response:
  an idle or trickling keep-alive connection too), if that one has waited ``SLOW_AFTER_S`` and none of
  its bytes wait unread in its socket: a flood of connections that send nothing, a slowloris of heads
  or of bodies, or connections that send one cheap request and then trickle the next cannot lock out a
  client, which writes its head as it connects. A connection whose whole request the app works on
  keeps its place, and a new connection that sends nothing takes no one's. Otherwise (or once the
  server shuts down) the new connection gets 503 once its request has come whole (within the header
  timeout and ``REFUSED_READ_BYTES``; it is read and dropped; at its head if it asks for ``100-continue``): a
  client that meets an answer and a close while it still writes fails without reading it. The
  connection then stays open until the client closes it, for ``REFUSAL_LINGER_S`` at most (a socket
  closed with bytes unread sends a reset). At most ``refusal_budget`` connections are held apart at
  once; past it a new one takes the place of the oldest held one not yet answered, one whose head
  has not come first (that one is answered 503 and closed), or, when every held one has its answer,
  is answered and closed at once. A held connection whose request is a ``GET`` of
  ``OPERATIONS_PATHS`` is served instead, and closed after its answer (``OPERATIONS_OVER_CAP`` at
  once): a supervisor's liveness probe that met a full gateway would restart it, and its metrics are
  wanted most when it is full.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import math
import struct
import termios
from typing import Any, ClassVar

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import ServerState

from gateway.edge.descriptors import refusal_budget
from gateway.edge.refused_request import OPERATIONS_PATHS, REFUSED_READ_BYTES, RefusedRequest
from gateway.errors import HTTP_STATUS, error_body
from gateway.settings import GatewaySettings, env_name
from telemetry.metrics import REQUESTS

SLOW_AFTER_S = 0.25
"""A connection open this long without a whole request (or idle this long since its last response)
is a slow one: at the cap it gives its place to a new connection whose head has come. A client's
head arrives with the handshake's last packet; the wait covers a head that a lost packet delays.
One whose bytes wait unread in its socket is not slow, whatever its age: the gateway has not read
them yet (a busy loop), or a keep-alive client has just sent its next request."""
UNREAD_SCAN = 16
"""Slow-looking connections with unread bytes passed over, at most, to find one to close."""
FRAMING_PER_PIECE = 16
"""Bytes of a chunked body's framing allowed per piece of its body, beside the header limit: a chunk's
size line and the line end after its data (``ffffffff\\r\\n`` and ``\\r\\n``, 12 bytes)."""
HEAD_PIECE_BYTES = 1024
"""The most bytes parsed at once before a request's head has ended: each head that ends is a request
uvicorn starts or queues (about 2 KB, its scope and cycle), so a read that may hold many pipelined
requests (``_may_queue_past_depth``) is parsed a piece at a time, and parsing stops once
``PIPELINE_DEPTH`` of them are queued."""
PIPELINE_DEPTH = 16
"""Pipelined requests one connection may have read and queued behind the one being answered: uvicorn
parses a whole read and queues every request in it, so 256 KiB of pipelined ``GET`` held about 24 MB
until answered. Past this many, the connection's bytes wait unparsed (``_held``) until the queue drains."""
REFUSAL_LINGER_S = 1.0
"""How long a refused connection stays open after its 503 for the client to close it."""
OPERATIONS_OVER_CAP = 16
"""Connections over the cap that may be serving ``OPERATIONS_PATHS`` at once."""
DRAIN_BYTES = 64 * 1024
"""A body declared this long or shorter and answered before it came (a 415, a 404) is read and dropped,
so the connection serves the client's next request: a client keeps a connection whose answer did not
say ``connection: close``, and a connection closed under it fails the request it sends next. A longer
or chunked one (a 413) is read and dropped behind a half-close, and the connection closes once it ends:
a lingering close (RFC 9112 section 9.6, see ``on_response_complete``)."""


def _unread(transport: asyncio.BaseTransport) -> int:
    """Bytes that wait in the transport's socket for the gateway to read them (0 when unknown)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]  # type: ignore[no-any-return]
    except OSError:
        return 0


def answer(code: str, message: str, headers: bytes = b"") -> bytes:
    """A whole response in the gateway's error shape that closes the connection, as written bytes."""
    body = json.dumps(error_body(code, message), separators=(",", ":")).encode()
    head = b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n" % len(body)
    return STATUS_LINE[HTTP_STATUS[code]] + head + headers + b"\r\n" + body


EDGE_ROUTE = "edge"
"""The ``route`` label of the answers this protocol writes itself, in ``batchwire_requests_total``."""
EDGE_ANSWERED = "batchwire.edge_answered"
"""Set in a request's ASGI scope when this protocol answered it mid-body, in the app's place: the app's
own count (``EdgeMiddleware``) skips it, so the request counts once, as the edge's answer."""


def _write_answer(transport: asyncio.WriteTransport, response: bytes) -> None:
    """Writes one of this protocol's own answers (``answer``) and counts it, as the app's answers are
    counted by route: an operator's error rate includes the connections refused at the edge."""
    transport.write(response)
    REQUESTS.labels(route=EDGE_ROUTE, status=response[9:12].decode()).inc()


_INVALID_HTTP = answer("invalid_http", "the request is not valid HTTP/1.1; the connection is closed")


class Occupancy:
    """One server's connections at the cap's edge: those waiting for a whole request (longest waiting
    first), and counts of those being closed to make room (uvicorn counts them until their
    close completes), refused, and served over the cap."""

    __slots__ = ("closing", "headless", "operations", "refusing", "shutting_down", "unanswered", "waiting")

    def __init__(self) -> None:
        self.waiting: dict[LimitedHttpToolsProtocol, float] = {}
        """Oldest first, with the loop time each began to wait (opened, or answered its last request)."""
        self.closing = 0
        self.refusing = 0
        """Connections held apart at the cap that are still open (see the module)."""
        self.unanswered: dict[LimitedHttpToolsProtocol, None] = {}
        """Those held apart and not answered yet, oldest first: each may make room for a newer one."""
        self.headless: dict[LimitedHttpToolsProtocol, None] = {}
        """Those of ``unanswered`` whose head has not come, oldest first: they make room first."""
        self.shutting_down = False
        """The server shuts down: a connection held apart takes no place."""
        self.operations = 0
        """Connections over the cap served because they asked for ``OPERATIONS_PATHS``."""


class WriteStallWatch:
    """Resets a connection whose client reads nothing of a full write buffer for ``within_s``: the
    app's next send waits for that read, so one that never reads would hold a streaming answer (an
    event stream) open for ever, past the stream's own end and the shutdown, which wait in that send.
    A slow reader keeps its connection while the buffer shrinks: each ``within_s`` it must have read
    some. The app is told the client left, as at any reset."""

    __slots__ = ("_loop", "_timer", "_transport", "_within_s")

    def __init__(self, loop: asyncio.AbstractEventLoop, transport: asyncio.WriteTransport, within_s: float) -> None:
        self._loop = loop
        self._transport = transport
        self._within_s = within_s
        self._timer: asyncio.TimerHandle | None = None

    @property
    def watching(self) -> bool:
        """Writing is paused and the client has not read what waits: its answer is still being read."""
        return self._timer is not None

    def start(self) -> None:
        """Writing paused: the client has ``within_s`` to read some of what waits."""
        if self._timer is None:
            self._arm(self._transport.get_write_buffer_size())

    def stop(self) -> None:
        """Writing resumed, or the connection is gone."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self, unread: int) -> None:
        self._timer = self._loop.call_later(self._within_s, self._check, unread)

    def _check(self, unread_before: int) -> None:
        unread = self._transport.get_write_buffer_size()
        if unread < unread_before:  # the client read some: another ``within_s`` to read more
            self._arm(unread)
        else:
            self._timer = None
            self._transport.abort()


def _coded(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a request names a transfer coding other than ``chunked`` (gzip, deflate, ...): httptools
    takes any before a final ``chunked`` and hands the body on still coded, which the gateway does not
    decode (RFC 9112 section 6.1: a server refuses a coding it does not understand)."""
    return any(
        coding.strip().lower() != b"chunked"
        for name, value in headers
        if name == b"transfer-encoding"
        for coding in value.split(b",")
    )


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits above; :func:`limited_http_protocol` binds them."""

    max_header_bytes: ClassVar[int] = 16_384
    header_timeout_s: ClassVar[float] = 10.0
    body_timeout_s: ClassVar[float] = 30.0
    max_connections: ClassVar[int] = 4096
    max_refusing: ClassVar[int] = 0
    """Refusals at the cap that may wait for their request at once (:func:`refusal_budget`)."""
    headers_too_large: ClassVar[bytes] = b""
    """The 431 answer; the four answers are built once per process by :func:`limited_http_protocol`."""
    trailers_too_large: ClassVar[bytes] = b""
    """The 431 answer to a chunked body whose framing and trailers are over the header limit."""
    header_timeout: ClassVar[bytes] = b""
    body_timeout: ClassVar[bytes] = b""
    too_many_connections: ClassVar[bytes] = b""
    max_body_pieces: ClassVar[int] = 4096
    """Pieces (chunks, or reads) one body may come in: each costs the parser and the app a callback,
    so a body of 1-byte chunks would cost a second of CPU per MiB."""
    body_too_fragmented: ClassVar[bytes] = b""
    occupancy: ClassVar[Occupancy] = Occupancy()

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        # The header deadline closes an idle keep-alive connection, not uvicorn's shorter timeout:
        # clients keep an idle connection up to 5 s (httpx, openai-python), and a request written
        # into one that the server closes at that moment meets a reset instead of an answer.
        self.timeout_keep_alive = int(self.header_timeout_s) + 1
        self._in_body = False
        """The parser is past a request's headers and before its end."""
        self._header_bytes = 0
        """Bytes of the coming request (request line and headers) handed to the parser so far."""
        self._begun_mid_read = False
        """A request began in the read being parsed, right behind the previous one (pipelining)."""
        self._deadline: float | None = None
        """Loop time by which what the connection waits for must have come; None while the app works."""
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._waiting = False
        """Waiting for a request's headers, opened or after a response (in ``occupancy.waiting``)."""
        self._making_room = False
        self._refused: RefusedRequest | None = None
        """Refused at the cap and still open (counted in ``occupancy.refusing``): what it sent."""
        self._refusal_sent = False
        self._operations = False
        """Served over the cap for ``OPERATIONS_PATHS`` (counted in ``occupancy.operations``)."""
        self._invalid = False
        """Bytes that are not HTTP came: the 400 waits for the answers to the requests before them."""
        self._unanswered = 0
        """Requests whose headers came and whose response has not ended."""
        self._body_pieces = 0
        """Pieces of the body being read that reached the parser's callback."""
        self._body_bytes = 0
        """Bytes of the body being read that reached the parser's callback."""
        self._framing_bytes = 0
        """Bytes of the body being read that were not body: a chunked body's framing and trailers."""
        self._requests_read = 0
        """Requests whose end the parser has read."""
        self._lingering = False
        """Answered and half-closed before a long body came: its rest is read and dropped, then it closes."""
        self._write_stall: WriteStallWatch | None = None
        """Made at the first pause of writing (:class:`WriteStallWatch`, the header timeout to read)."""
        self._held = b""
        """Bytes read behind ``PIPELINE_DEPTH`` queued requests, parsed once they are answered."""

    # asyncio callbacks ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        occupancy = self.occupancy
        if len(self.connections) - occupancy.closing - occupancy.operations >= self.max_connections:
            # Never added to uvicorn's connections, so connection_lost's discard leaves the count right.
            self.transport = transport
            self._hold_over_cap(transport)
            return
        super().connection_made(transport)
        self._wait_for_request()
        self._expect(self.header_timeout_s)

    def _hold_over_cap(self, transport: asyncio.Transport) -> None:
        """Holds the connection apart to read its request (see the module), or answers and closes at once."""
        occupancy = self.occupancy
        if occupancy.refusing >= self.max_refusing:
            oldest = next(iter(occupancy.headless or occupancy.unanswered), None)
            if oldest is None:
                _write_answer(transport, self.too_many_connections)
                self._close()
                return
            oldest._end_refusal()  # it had its time; counted until its close completes
        occupancy.refusing += 1
        occupancy.unanswered[self] = None
        occupancy.headless[self] = None
        self._refused = RefusedRequest(OPERATIONS_PATHS, self.max_header_bytes)
        self._timer = self.loop.call_later(self.header_timeout_s, self._end_refusal)

    def _read_refused(self, refused: RefusedRequest, data: bytes) -> None:
        """Reads what a connection held apart sends: when its head comes, serves it if it may take a
        place (or asks for ``OPERATIONS_PATHS``); else drops its request and answers once it is whole."""
        ended = refused.feed(data)
        if refused.serve and not self._refusal_sent and self.occupancy.operations < OPERATIONS_OVER_CAP:
            self._serve_after_all(bytes(refused.kept), operations=True)
            return
        if refused.head_ended and self in self.occupancy.headless:
            del self.occupancy.headless[self]
            if self._take_place(refused):
                return
            if refused.expects_continue:  # its client sends the body only after an answer: this one
                ended = True
        if ended and not self._refusal_sent:
            self._send_refusal()
        if refused.read > REFUSED_READ_BYTES:
            self._end_refusal()

    def _take_place(self, refused: RefusedRequest) -> bool:
        """Serves this connection, whose head came whole, in a place freed since it came, or in the
        place of the one that has waited longest for a request, if that one is slow (``SLOW_AFTER_S``)."""
        occupancy = self.occupancy
        if not refused.head_kept or occupancy.shutting_down:
            return False
        if len(self.connections) - occupancy.closing - occupancy.operations >= self.max_connections:
            slow = self._slowest()
            if slow is None:
                return False
            slow._make_room()
        self._serve_after_all(bytes(refused.kept), operations=False)
        return True

    def _slowest(self) -> LimitedHttpToolsProtocol | None:
        """The connection that has waited longest for a request, if it is slow and no bytes of its wait unread."""
        deadline = self.loop.time() - SLOW_AFTER_S
        for scanned, (connection, since) in enumerate(self.occupancy.waiting.items()):
            if since > deadline or scanned >= UNREAD_SCAN:
                return None
            if not _unread(connection.transport):
                return connection
        return None

    def _serve_after_all(self, head: bytes, *, operations: bool) -> None:
        """Serves a connection held apart after all, from what it sent so far (its request's head at
        least): in a place of the cap, or over it for ``OPERATIONS_PATHS`` (``operations``)."""
        self._cancel_timer()
        self._refused = None
        self.occupancy.refusing -= 1
        self._unhold()
        if operations:
            self.occupancy.operations += 1
            self._operations = True
        super().connection_made(self.transport)
        if not operations:
            self._wait_for_request()
        self._expect(self.header_timeout_s)
        self.data_received(head)

    def _unhold(self) -> None:
        """No longer among the held connections that may make room for a newer one."""
        self.occupancy.unanswered.pop(self, None)
        self.occupancy.headless.pop(self, None)

    def _send_refusal(self) -> None:
        """The 503 (``connection: close``); then the wait is for the client's close (see the module)."""
        self._refusal_sent = True
        self.occupancy.unanswered.pop(self, None)
        _write_answer(self.transport, self.too_many_connections)
        self._cancel_timer()
        self._timer = self.loop.call_later(REFUSAL_LINGER_S, self._end_refusal)

    def _end_refusal(self) -> None:
        self._unhold()
        self._cancel_timer()
        if not self._refusal_sent and not self.transport.is_closing():  # answered unasked: none came whole
            _write_answer(self.transport, self.too_many_connections)
        self._close()

    def _wait_for_request(self) -> None:
        """Counts the connection as waiting for a request (the newest such), evictable at the cap."""
        self.occupancy.waiting[self] = self.loop.time()
        self._waiting = True

    def _stop_waiting(self) -> None:
        if self._waiting:
            del self.occupancy.waiting[self]
            self._waiting = False

    def _make_room(self) -> None:
        """Closes this connection, which has waited longest for a whole request, for a new one."""
        self._stop_waiting()
        self._making_room = True
        self.occupancy.closing += 1
        self._close(unread_for_s=0)  # slow: its client has left its last answer unread since

    def connection_lost(self, exc: Exception | None) -> None:
        self._deadline = None
        self._cancel_timer()
        if self._write_stall is not None:
            self._write_stall.stop()
        if self._waiting:
            self._stop_waiting()
        elif self._making_room:
            self.occupancy.closing -= 1
        elif self._refused is not None:
            self.occupancy.refusing -= 1
            self._unhold()
            self._refused = None
        if self._operations:
            self.occupancy.operations -= 1
            self._operations = False
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        """The write buffer is full: as at a close (``_reset_if_unread``), the client has a header
        timeout to read some of it, or the connection is reset (:class:`WriteStallWatch`)."""
        super().pause_writing()
        if self._write_stall is None:
            self._write_stall = WriteStallWatch(self.loop, self.transport, self.header_timeout_s)
        self._write_stall.start()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_stall is not None:
            self._write_stall.stop()

    def data_received(self, data: bytes) -> None:
        if self._invalid:
            return  # behind bytes that were not HTTP: nothing more is read
        if self._refused is not None:
            self._read_refused(self._refused, data)
            return
        if self._held:  # behind a full queue of pipelined requests: parsed once it drains
            self._held += data
            self.flow.pause_reading()
            return
        if self._in_body:
            if not self._lingering and (  # lingering: no request follows
                len(data) > self.max_header_bytes
                or (len(data) > HEAD_PIECE_BYTES and self._declared_body_bytes() - self._body_bytes < len(data))
            ):  # a large read, or one that goes on past its body's declared end: requests may follow it
                self._parse_in_pieces(data)
                return
            self._parse_body(data)
        else:
            counted = self._header_bytes + len(data)
            if counted > self.max_header_bytes or (len(data) > HEAD_PIECE_BYTES and self._may_queue_past_depth(data)):
                self._parse_in_pieces(data)
                return
            self._header_bytes = counted
            super().data_received(data)
        if self._begun_mid_read:
            self._count_pipelined(data, 0, len(data))

    def _may_queue_past_depth(self, data: bytes) -> bool:
        """Whether parsing ``data`` whole could queue more than ``PIPELINE_DEPTH`` requests: each head
        that ends in it holds two line ends at least (httptools takes no head without its CRLFs), so a
        read of one request with its body, however long, is parsed in one go, not in pieces."""
        return len(self.pipeline) + data.count(b"\n") // 2 > PIPELINE_DEPTH

    def _parse_in_pieces(self, data: bytes) -> None:
        """Parses a read that would cross the header limit, or a large read, a piece at a time: headers
        only up to the limit and ``HEAD_PIECE_BYTES`` at once, a body in pieces no larger than the limit,
        so that a request pipelined behind the body is counted from the piece it begins in; once
        ``PIPELINE_DEPTH`` requests are queued, the rest is held unparsed."""
        view = memoryview(data)
        start, size = 0, len(data)
        while start < size:
            if self._in_body:
                end = min(size, start + self._body_piece_bytes())
                self._parse_body(view[start:end])
            else:
                room = self.max_header_bytes - self._header_bytes
                if room <= 0:
                    self._refuse(self.headers_too_large)
                    return
                end = min(size, start + room, start + HEAD_PIECE_BYTES)
                self._header_bytes += end - start
                super().data_received(view[start:end])  # type: ignore[arg-type]  # httptools takes any buffer
            if self.transport.is_closing() or self.transport.get_protocol() is not self:
                return  # refused, answered 400, or upgraded to a WebSocket
            if self._begun_mid_read:
                self._count_pipelined(data, start, end)
            start = end
            if len(self.pipeline) >= PIPELINE_DEPTH and start < size:
                self._held = bytes(view[start:])
                self.flow.pause_reading()  # uvicorn resumes it at each answer: held bytes come first
                return

    def _body_piece_bytes(self) -> int:
        """The most bytes of a body parsed at once: the header limit, or less, up to the body's end where
        its length is declared, so that requests pipelined behind it are parsed in head pieces, and
        stop at ``PIPELINE_DEPTH``. (A chunked body's end is not known ahead: its last piece may hold
        as many pipelined requests as fit in the header limit.)"""
        left = self._declared_body_bytes() - self._body_bytes
        return int(left) if 0 < left < self.max_header_bytes else self.max_header_bytes

    def _parse_body(self, piece: bytes | memoryview) -> None:
        """Parses a piece of a body, counting its bytes that were no body when the body goes on past it:
        a chunked body's sizes and extensions, and its trailers, which httptools gathers whole (a long
        one by concatenation) and uvicorn appends to the request's headers, so that trailers sent for
        the body timeout would hold memory many times their size. Past the header limit, beside
        ``FRAMING_PER_PIECE`` per piece of the body, the request gets 431 and the connection closes.
        A piece in which the body ends is not counted: it holds at most the header limit's bytes."""
        body_bytes, requests_read = self._body_bytes, self._requests_read
        super().data_received(piece)  # type: ignore[arg-type]  # httptools takes any buffer
        if self._requests_read != requests_read or not self._in_body or self.transport.is_closing():
            return
        self._framing_bytes += len(piece) - (self._body_bytes - body_bytes)
        if self._framing_bytes > self.max_header_bytes + FRAMING_PER_PIECE * self._body_pieces:
            self._refuse_body(self.trailers_too_large)

    def _count_pipelined(self, data: bytes, start: int, end: int) -> None:
        """Counts the bytes of a request that began in ``data[start:end]`` behind another one and whose
        headers did not end there: the piece's tail after its last blank line (exact behind a request
        without a body; behind a body, that body's tail is counted too, which errs toward the limit)."""
        self._begun_mid_read = False
        if self._in_body:
            return
        blank = data.rfind(b"\r\n\r\n", start, end)
        self._header_bytes = max(1, end - (blank + 4 if blank >= 0 else start))

    # parser callbacks ----------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        # Bytes are counted before each read is parsed, so none counted means the previous request
        # ended earlier in this same read.
        self._begun_mid_read = self._header_bytes == 0
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        if self.transport.is_closing():
            return  # read behind a close (a lingering body's end) in the same read: no one reads its answer
        if _coded(self.headers):
            # Raised out of the parser as its error: answered 400 ``invalid_http`` (``send_400_response``).
            raise ValueError("a transfer coding other than chunked")
        self._unanswered += 1
        super().on_headers_complete()
        if self._operations and self.cycle is not None:
            self.cycle.keep_alive = False  # its place is over the cap: one answer, then closed
        self._in_body = True
        self._body_pieces = self._body_bytes = self._framing_bytes = 0
        if self.pipeline:
            self._deadline = None  # it waits behind an earlier response, with reading paused
        else:
            self._expect(self.body_timeout_s)

    def on_body(self, body: bytes) -> None:
        self._body_pieces += 1
        self._body_bytes += len(body)
        if self._body_pieces <= self.max_body_pieces:
            super().on_body(body)
        elif self._body_pieces == self.max_body_pieces + 1:
            self._refuse_body(self.body_too_fragmented)

    def on_message_complete(self) -> None:
        self._requests_read += 1
        super().on_message_complete()
        # Only now has the whole request come: one stalled in its body waits for it as one that trickles
        # its headers does, and at the cap makes room like it.
        self._stop_waiting()
        self._in_body = False
        self._header_bytes = 0
        if self._lingering:
            self._close()  # the client has written its whole body: its answer ends the connection
        elif self.cycle.response_complete:  # answered before its body came, which is now read and dropped
            self._idle()
        else:
            self._deadline = None  # the app works on it: no deadline of the connection's own

    def on_response_complete(self) -> None:
        self._unanswered -= 1
        super().on_response_complete()
        if self.transport.is_closing():
            self._reset_if_unread(self.header_timeout_s)  # closed by uvicorn after a ``connection: close`` answer
            return
        if self._invalid:
            self.flow.pause_reading()  # uvicorn resumed it
            self._answer_invalid_when_due()
            return
        cycle = self.cycle
        if not cycle.response_complete:  # a pipelined request started
            if self._in_body and self._deadline is None:
                self._expect(self.body_timeout_s)
        elif self._in_body and self._declared_body_bytes() > DRAIN_BYTES:
            # Answered before a long body came (a 413). Half-close so the client sees the answer end,
            # and read the rest, dropped as parsed (uvicorn's ``on_body`` keeps nothing once answered):
            # a client that writes its whole body before it reads (httpx) blocks on a full socket
            # until it is read, and a close with bytes unread resets the connection, losing the answer.
            # The body deadline and the pieces' bound still hold; the close comes at the body's end.
            self._lingering = True
            self._unset_keepalive_if_required()  # uvicorn's idle timer: the body deadline bounds this
            if self.transport.can_write_eof():
                self.transport.write_eof()
        elif not self._in_body:
            self._idle()
        # else: answered before a short body came; it is read and dropped (``DRAIN_BYTES``), within the
        # body deadline, and the connection then waits for the next request (``on_message_complete``).
        if self._held and len(self.pipeline) < PIPELINE_DEPTH:
            held, self._held = self._held, b""
            self.data_received(held)

    def _idle(self) -> None:
        """The connection waits for its next request."""
        self._expect(self.header_timeout_s)
        if not self._operations:
            self._wait_for_request()  # idle keep-alive: evictable at the cap like a new connection

    def _declared_body_bytes(self) -> float:
        """The Content-Length of the request being read (inf: chunked, or none given)."""
        for name, value in self.headers:
            if name == b"content-length":
                return int(value) if value.isdigit() else math.inf
        return math.inf

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown (of the connections it counts): from now on a connection held
        apart is refused, as it would find the app shutting down."""
        self.occupancy.shutting_down = True
        super().shutdown()

    def handle_websocket_upgrade(self) -> None:
        self._deadline = None  # the WebSocket protocol owns the connection from here
        self._stop_waiting()
        super().handle_websocket_upgrade()

    def send_400_response(self, msg: str) -> None:
        """Bytes that are not HTTP/1.1 (a bad request line or header, a malformed chunk size, an unknown
        transfer coding): the requests read before them are answered, then this 400, then the
        connection closes; nothing after them is read."""
        cycle = self.cycle
        if self._in_body and cycle is not None and not cycle.response_complete:
            # The bad bytes are in the body of the request read last: that request is the invalid one.
            if self.pipeline and self.pipeline[0][0] is cycle:
                self.pipeline.popleft()  # queued behind another response, never started
                self._unanswered -= 1
            else:
                self._refuse_body(_INVALID_HTTP)
                return
        self._invalid = True
        self.flow.pause_reading()
        self._answer_invalid_when_due()

    def _answer_invalid_when_due(self) -> None:
        """The 400 and the close, once no request read before the invalid bytes is still unanswered."""
        if self._unanswered == 0:
            self._deadline = None
            _write_answer(self.transport, _INVALID_HTTP)
            self._close()

    # deadlines -----------------------------------------------------------------------------------
    def _expect(self, within_s: float) -> None:
        """What the connection waits for must come within ``within_s``; the timer is made only when
        none is pending early enough (it re-arms itself for a later deadline when it fires)."""
        deadline = self.loop.time() + within_s
        self._deadline = deadline
        if self._timer is None or self._timer_at > deadline:
            self._cancel_timer()
            self._timer = self.loop.call_later(within_s, self._on_timer)
            self._timer_at = deadline

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        self._timer = None
        deadline = self._deadline
        if deadline is None or self.transport.is_closing():
            return
        left = deadline - self.loop.time()
        if left > 0:
            self._timer = self.loop.call_later(left, self._on_timer)
            self._timer_at = deadline
            return
        if self._write_stall is not None and self._write_stall.watching:  # its last answer is still being read
            self._expect(self.header_timeout_s)
            return
        self._deadline = None
        if self._in_body:
            self._refuse_body(self.body_timeout)
            return
        if self._header_bytes:
            _write_answer(self.transport, self.header_timeout)  # an idle connection is closed without a word
        self._close(unread_for_s=0)  # its last answer, if still unread, had this timeout to be read

    def _close(self, *, unread_for_s: float | None = None) -> None:
        """Closes the connection, and resets it if what was written to it is still unread
        ``unread_for_s`` later (the header timeout unless given; 0: at once)."""
        self.transport.close()
        self._reset_if_unread(self.header_timeout_s if unread_for_s is None else unread_for_s)

    def _reset_if_unread(self, within_s: float) -> None:
        """A close waits for the client to read what was written to it: one that never reads (its
        window shut) would hold the connection, its descriptor and those bytes for ever, counted against
        no cap once it is closing. Still unread ``within_s`` from now, the connection is reset."""
        if not self.transport.get_write_buffer_size():
            return  # nothing waits: the close completes now
        self._cancel_timer()
        if within_s <= 0:
            self.transport.abort()
        else:
            self._timer = self.loop.call_later(within_s, self.transport.abort)

    def _refuse_body(self, response: bytes) -> None:
        """Answers and closes mid-body: the app waiting in receive() is told the client left (so
        nothing it sends is written), unless its answer is already on its way."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            cycle.scope[EDGE_ANSWERED] = True  # type: ignore[literal-required]
            cycle.disconnected = True
            cycle.message_event.set()
            _write_answer(self.transport, response)
        self._close()

    def _refuse(self, response: bytes) -> None:
        """Answers and closes, or only closes while an earlier response is still being written."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            _write_answer(self.transport, response)
        self._close()


def limited_http_protocol(
    settings: GatewaySettings, max_connections: int | None = None
) -> type[LimitedHttpToolsProtocol]:
    """The protocol class for uvicorn's ``http=``, bound to ``settings``' limits (``max_connections``
    overrides the setting, for a process whose descriptor limit allows fewer)."""
    cap = settings.max_connections if max_connections is None else max_connections

    class Bound(LimitedHttpToolsProtocol):
        max_header_bytes = settings.max_header_bytes
        header_timeout_s = settings.header_timeout_s
        body_timeout_s = settings.body_timeout_s
        max_connections = cap
        headers_too_large = answer(
            "headers_too_large",
            f"the request line and headers are over {settings.max_header_bytes} bytes, the limit "
            f"({env_name('max_header_bytes')}); send smaller headers",
        )
        trailers_too_large = answer(
            "headers_too_large",
            f"the chunked body's trailers, chunk sizes and extensions are over {settings.max_header_bytes} bytes, "
            f"the limit ({env_name('max_header_bytes')}); send the body without trailers or chunk extensions",
        )
        header_timeout = answer(
            "request_timeout",
            f"the request's headers did not come within {settings.header_timeout_s:g} s "
            f"({env_name('header_timeout_s')})",
        )
        body_timeout = answer(
            "request_timeout",
            f"the request's body did not come within {settings.body_timeout_s:g} s of its headers "
            f"({env_name('body_timeout_s')})",
        )
        max_body_pieces = max(1024, settings.max_body_bytes // 256)
        body_too_fragmented = answer(
            "body_too_fragmented",
            f"the body came in more than {max_body_pieces} pieces (chunks or reads); send it in larger chunks",
        )
        occupancy = Occupancy()
        too_many_connections = answer(
            "too_many_connections",
            f"the gateway holds {cap} open connections, its limit ({env_name('max_connections')}); retry after "
            "Retry-After",
            b"retry-after: %d\r\n" % settings.retry_after_s,
        )

    Bound.max_refusing = refusal_budget(cap)
    Bound.__name__ = Bound.__qualname__ = LimitedHttpToolsProtocol.__name__
    logging.getLogger("uvicorn.error").addFilter(_not_clients_doing)  # added once, however many calls
    return Bound


CLIENTS_DOINGS = frozenset(
    {
        "Invalid HTTP request received.",
        "Unsupported upgrade request.",
        "No supported WebSocket library detected. Please use \"pip install 'uvicorn[standard]'\", or install "
        "'websockets' or 'wsproto' manually.",
    }
)
"""What uvicorn's protocol logs at WARNING for a client's bytes: a request that is not HTTP (before it asks
for the 400), and an ``Upgrade`` the server does not speak (``h2c``; ``websocket``, which no route serves:
``ws="none"``, and no library is missing), which it serves as plain HTTP/1.1."""


def _not_clients_doing(record: logging.LogRecord) -> bool:
    """Drops uvicorn's WARNINGs for what a client sent (``CLIENTS_DOINGS``): no fault of the gateway, the
    first answered 400 ``invalid_http`` and counted in ``batchwire_requests_total{route="edge",status="400"}``,
    the second served; they name neither the client nor a remedy, and any client could fire an alert on
    WARNING with them at will."""
    return record.msg not in CLIENTS_DOINGS
