"""The request of a connection refused at the connection cap: read, dropped, and where it ends.

The gateway answers such a connection 503 only once its request has come whole (see
``gateway.edge.http_limits``). Its bytes never reach the app: a parser of its own finds the head's
and the message's end, through bodies of any framing (length or chunked), and the request's method
and path. A connection whose head comes may still be served (it takes a slow one's place, or it is
a probe or a metrics scrape), so the bytes up to the end of the head are kept for the protocol that
serves it.
"""

from __future__ import annotations

import httptools

REFUSED_READ_BYTES = 1 << 20
"""What a refused connection may send, its request and after: then it is answered (if not yet) and closed."""
OPERATIONS_PATHS = frozenset({b"/healthz", b"/readyz", b"/metrics"})
"""Paths served over the cap (``GET``): the probes and the scrape (``gateway.edge.routes.operations``)."""
MAX_URL_BYTES = 2048
"""Longer request targets are not one of the served paths: they are not kept whole."""


class RefusedRequest:
    """Counts what a refused connection sent, notes when its request came whole, and whether it asks for
    one of ``served`` paths."""

    __slots__ = (
        "_keep_bytes",
        "_kept_all",
        "_parser",
        "_served",
        "_url",
        "ended",
        "expects_continue",
        "head_ended",
        "head_kept",
        "kept",
        "read",
        "serve",
    )

    def __init__(self, served: frozenset[bytes] = frozenset(), keep_bytes: int = 0) -> None:
        self.ended = False
        """The request came whole, or what came is not HTTP (answered all the same)."""
        self.read = 0
        """Bytes the connection sent, its request and anything after it."""
        self.serve = False
        """The request is a ``GET`` of one of ``served`` paths and its head came within ``keep_bytes``."""
        self.head_ended = False
        """The request's head (request line and headers) came whole."""
        self.expects_continue = False
        """The head asks for ``100 Continue`` before the body: its client waits for an answer to send it."""
        self.head_kept = False
        """The head came whole within ``kept``: everything the connection sent up to it is there."""
        self.kept = bytearray()
        """What the connection sent until its head came whole, while that is at most ``keep_bytes``."""
        self._served = served
        self._keep_bytes = keep_bytes
        self._kept_all = True
        self._url = b""
        self._parser = httptools.HttpRequestParser(self)

    def on_url(self, url: bytes) -> None:
        """The parser's callback (the target may come in pieces)."""
        if len(self._url) <= MAX_URL_BYTES:
            self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        """The parser's callback (once per header, whole even when it came split across reads)."""
        if name.lower() == b"expect" and value.strip().lower() == b"100-continue":
            self.expects_continue = True

    def on_headers_complete(self) -> None:
        """The parser's callback."""
        self.head_ended = True
        self.head_kept = self._kept_all
        if self._served and len(self.kept) <= self._keep_bytes and self._parser.get_method() == b"GET":
            path = self._url.partition(b"?")[0]
            self.serve = path in self._served

    def on_message_complete(self) -> None:
        """The parser's callback."""
        self.ended = True

    def feed(self, data: bytes) -> bool:
        """Drops ``data`` (or keeps it, while the head is still coming); True once the request has come whole."""
        self.read += len(data)
        if self.ended:
            return True
        if not self.head_ended:
            if self._keep_bytes and len(self.kept) <= self._keep_bytes:
                self.kept += data  # one read past the bound at most: then nothing more is kept or served
            else:
                self._kept_all = False
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserUpgrade, httptools.HttpParserError):
            self.ended = True
        return self.ended
