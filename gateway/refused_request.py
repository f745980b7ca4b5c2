"""The request of a connection refused at the connection cap: read, dropped, and where it ends.

The gateway answers such a connection 503 only once its request has come whole (see
``gateway.http_limits``). Its bytes never reach the app: a parser of its own, with no callback but
the message's end, finds that end, through bodies of any framing (length or chunked).
"""

from __future__ import annotations

import httptools


class RefusedRequest:
    """Counts what a refused connection sent and notes when its request came whole."""

    __slots__ = ("_parser", "ended", "read")

    def __init__(self) -> None:
        self.ended = False
        """The request came whole, or what came is not HTTP (answered all the same)."""
        self.read = 0
        """Bytes the connection sent, its request and anything after it."""
        self._parser = httptools.HttpRequestParser(self)

    def on_message_complete(self) -> None:
        """The parser's callback."""
        self.ended = True

    def feed(self, data: bytes) -> bool:
        """Drops ``data``; True once the request has come whole."""
        self.read += len(data)
        if not self.ended:
            try:
                self._parser.feed_data(data)
            except (httptools.HttpParserUpgrade, httptools.HttpParserError):
                self.ended = True
        return self.ended
