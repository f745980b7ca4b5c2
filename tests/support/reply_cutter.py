"""A TCP relay to a Redis server that can lose one reply: the command runs on Redis, and the client
sees its connection close instead of the answer (a connection dropped after the write)."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit, urlunsplit


class _Cut(Exception):
    """Ends one relayed connection."""


class ReplyCutter:
    """Relays each client connection to ``redis_url``; ``cut_next()`` closes the connection that
    receives the next reply, in place of that reply."""

    def __init__(self, redis_url: str) -> None:
        self._url = urlsplit(redis_url)
        self.host, self.port = self._url.hostname or "127.0.0.1", self._url.port or 6379
        self.cuts = 0
        """Replies lost so far."""
        self._armed = False
        self._server: asyncio.Server | None = None
        self._relays: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        """Listens on a free loopback port; returns the URL that reaches Redis through the relay (the
        given one's credentials and database)."""
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        user = self._url.netloc.rpartition("@")[0]
        netloc = f"{user}@" if user else ""
        port = self._server.sockets[0].getsockname()[1]
        return urlunsplit(self._url._replace(netloc=f"{netloc}127.0.0.1:{port}"))

    def cut_next(self) -> None:
        self._armed = True

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for relay in list(self._relays):
            relay.cancel()
        await asyncio.gather(*self._relays, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None, "a connection is relayed by a task of its own"
        self._relays.add(task)
        try:
            redis_reader, redis_writer = await asyncio.open_connection(self.host, self.port)
        except OSError:
            client_writer.transport.abort()
            self._relays.discard(task)
            return
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._pipe(client_reader, redis_writer, replies=False))
                group.create_task(self._pipe(redis_reader, client_writer, replies=True))
        except* (_Cut, ConnectionError):
            pass
        finally:
            self._relays.discard(task)
            client_writer.transport.abort()
            redis_writer.transport.abort()

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, *, replies: bool) -> None:
        while data := await source.read(65536):
            if replies and self._armed:
                self._armed = False
                self.cuts += 1
                raise _Cut
            sink.write(data)
            await sink.drain()
        raise _Cut  # one side closed: so does the other
