"""A minimal HTTP/1.1 keep-alive client for POSTs: one request at a time per connection.

It does only what the bench needs (Content-Length and chunked bodies, keep-alive, read-to-close),
which is why it is cheap. The sender caps outstanding requests, so the number of connections is
capped too; this pool only keeps idle ones for reuse.
"""

from __future__ import annotations

import asyncio

from yarl import URL

from batchwire.bench.client import HttpProtocolError

_MAX_HEAD = 64 * 1024


class _Connection(asyncio.Protocol):
    """Parses one response at a time; ``waiter`` gets (status, body, keep_alive)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.waiter: asyncio.Future[tuple[int, bytes, bool]] | None = None
        self._buffer = bytearray()
        self._status = 0
        self._keep_alive = True
        self._length: int | None = None  # body length once the head is read; -1 chunked; None head pending
        self._to_close = False  # no length and not chunked: the body ends when the server closes
        self._chunks = bytearray()

    # asyncio.Protocol ------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport (uvloop's too)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        try:
            self._parse()
        except HttpProtocolError as err:
            self._fail(err)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            if self._to_close and self._length is not None:
                self._finish(bytes(self._buffer), keep_alive=False)
            else:
                self._fail(ConnectionResetError("the server closed the connection before answering"))

    # requests --------------------------------------------------------------------------------------
    def send(self, data: bytes, loop: asyncio.AbstractEventLoop) -> asyncio.Future[tuple[int, bytes, bool]]:
        if self.transport is None or self.closed:
            raise ConnectionResetError("connection already closed")
        if self._buffer:
            raise HttpProtocolError("the server sent bytes nobody asked for")
        self.waiter = loop.create_future()
        self._length = None
        self._to_close = False
        self._chunks.clear()
        self.transport.write(data)
        return self.waiter

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # parsing ---------------------------------------------------------------------------------------
    def _parse(self) -> None:
        if self.waiter is None or self.waiter.done():
            if self._buffer:
                raise HttpProtocolError("the server sent bytes nobody asked for")
            return
        if self._length is None and not self._parse_head():
            return
        if self._to_close:
            return
        if self._length == -1:
            self._parse_chunks()
        elif self._length is not None and len(self._buffer) >= self._length:
            body = bytes(self._buffer[: self._length])
            del self._buffer[: self._length]
            self._finish(body, self._keep_alive)

    def _parse_head(self) -> bool:
        end = self._buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buffer) > _MAX_HEAD:
                raise HttpProtocolError(f"response head over {_MAX_HEAD} bytes")
            return False
        lines = bytes(self._buffer[:end]).decode("latin-1").split("\r\n")
        del self._buffer[: end + 4]
        version, _, rest = lines[0].partition(" ")
        if not version.startswith("HTTP/1.") or not rest[:3].isdigit():
            raise HttpProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        self._status = int(rest[:3])
        if 100 <= self._status < 200:  # an interim answer; the real one follows
            return self._parse_head()
        self._keep_alive = version == "HTTP/1.1"
        length: int | None = None
        chunked = False
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            value = value.strip().lower()
            if name == "content-length":
                try:
                    length = int(value)
                except ValueError as err:
                    raise HttpProtocolError(f"bad Content-Length {value!r}") from err
            elif name == "transfer-encoding":
                chunked = value.endswith("chunked")
            elif name == "connection":
                self._keep_alive = "close" not in value and (self._keep_alive or "keep-alive" in value)
        if chunked:
            self._length = -1
        elif length is not None:
            self._length = length
        else:
            self._length = 0
            self._to_close = self._status not in (204, 304)
            self._keep_alive = False
            if not self._to_close:
                self._finish(b"", keep_alive=True)
        return True

    def _parse_chunks(self) -> None:
        while True:
            line_end = self._buffer.find(b"\r\n")
            if line_end < 0:
                return
            size_text = bytes(self._buffer[:line_end]).split(b";")[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError as err:
                raise HttpProtocolError(f"bad chunk size {size_text[:20]!r}") from err
            if size == 0:
                trailer_end = self._buffer.find(b"\r\n\r\n", line_end)
                if self._buffer[line_end + 2 : line_end + 4] == b"\r\n":
                    del self._buffer[: line_end + 4]
                elif trailer_end >= 0:
                    del self._buffer[: trailer_end + 4]
                else:
                    return
                self._finish(bytes(self._chunks), self._keep_alive)
                return
            if len(self._buffer) < line_end + 2 + size + 2:
                return
            self._chunks += self._buffer[line_end + 2 : line_end + 2 + size]
            del self._buffer[: line_end + 2 + size + 2]

    def _finish(self, body: bytes, keep_alive: bool) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result((self._status, body, keep_alive))

    def _fail(self, err: Exception) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(err)
        self.close()


MAX_IDLE_S = 4.0
"""A connection idle this long is not reused: servers close idle keep-alive connections (uvicorn
after 5 s), and a request sent just as the server closes one fails without ever being read."""


class RawHttpClient:
    """Keeps idle connections per host and port; a connection is reused only after a full answer."""

    def __init__(self, timeout_s: float, max_idle_s: float = MAX_IDLE_S) -> None:
        self._timeout_s = timeout_s
        self._max_idle_s = max_idle_s
        self._idle: dict[tuple[str, int], list[tuple[_Connection, float]]] = {}
        self._heads: dict[URL, bytes] = {}
        self._all: set[_Connection] = set()

    def _head(self, url: URL) -> bytes:
        head = self._heads.get(url)
        if head is None:
            if url.scheme != "http":
                raise ValueError(f"--client raw speaks plain http only, not {url.scheme}: use --client aiohttp")
            head = (
                f"POST {url.raw_path_qs} HTTP/1.1\r\nHost: {url.raw_authority}\r\n"
                "Content-Type: application/json\r\nContent-Length: "
            ).encode()
            self._heads[url] = head
        return head

    async def post(self, url: URL, body: bytes) -> tuple[int, bytes]:
        head = self._head(url)
        key = (url.raw_host or "", url.port or 80)
        loop = asyncio.get_running_loop()
        connection: _Connection | None = None
        async with asyncio.timeout(self._timeout_s):
            idle = self._idle.get(key)
            while idle:
                candidate, since = idle.pop()
                if candidate.closed:
                    continue
                if loop.time() - since < self._max_idle_s:
                    connection = candidate
                    break
                candidate.close()
                self._all.discard(candidate)
            if connection is None:
                _, connection = await loop.create_connection(_Connection, key[0], key[1])
                self._all.add(connection)
            try:
                status, payload, keep_alive = await connection.send(
                    head + str(len(body)).encode() + b"\r\n\r\n" + body, loop
                )
            except BaseException:
                connection.close()  # a cancelled or broken exchange leaves the stream in an unknown state
                self._all.discard(connection)
                raise
        if keep_alive and not connection.closed:
            self._idle.setdefault(key, []).append((connection, loop.time()))
        else:
            connection.close()
            self._all.discard(connection)
        return status, payload

    async def close(self) -> None:
        for connection in self._all:
            connection.close()
        self._all.clear()
        self._idle.clear()
        await asyncio.sleep(0)  # lets the transports run their close callbacks
