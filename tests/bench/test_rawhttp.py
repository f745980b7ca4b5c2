"""The minimal HTTP/1.1 client against scripted servers: framing, keep-alive and failures."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
from yarl import URL

from batchwire.bench.client import HttpProtocolError
from batchwire.bench.rawhttp import RawHttpClient

Script = Callable[[int], list[bytes]]  # request number -> the pieces to write back


class Scripted:
    def __init__(self, script: Script, close_after: bool = False) -> None:
        self.script = script
        self.close_after = close_after
        self.connections = 0
        self.requests = 0
        self.url = URL()
        self._server: asyncio.Server | None = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                self.requests += 1
                for piece in self.script(self.requests):
                    writer.write(piece)
                    await writer.drain()
                if self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> Scripted:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = URL(f"http://127.0.0.1:{port}/v1/inference?x=1")
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()


@pytest.fixture
async def client() -> AsyncIterator[RawHttpClient]:
    made = RawHttpClient(timeout_s=1.0)
    yield made
    await made.close()


def _ok(body: bytes) -> list[bytes]:
    return [b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body]


async def test_content_length_answers_reuse_one_connection(client: RawHttpClient) -> None:
    async with Scripted(lambda n: _ok(b'{"n": %d}' % n)) as server:
        assert await client.post(server.url, b"{}") == (200, b'{"n": 1}')
        assert await client.post(server.url, b"{}") == (200, b'{"n": 2}')
    assert server.connections == 1


async def test_a_connection_idle_too_long_is_not_reused() -> None:
    client = RawHttpClient(timeout_s=5.0, max_idle_s=0.05)
    try:
        async with Scripted(lambda n: _ok(b'{"n": %d}' % n)) as server:
            assert await client.post(server.url, b"{}") == (200, b'{"n": 1}')
            await asyncio.sleep(0.1)  # the idleness under test, past max_idle_s
            assert await client.post(server.url, b"{}") == (200, b'{"n": 2}')
        assert server.connections == 2, "a server may be closing a connection idle that long"
    finally:
        await client.close()


async def test_chunked_body_split_into_tiny_writes(client: RawHttpClient) -> None:
    answer = (
        b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: 1\r\n\r\n"
    )
    async with Scripted(lambda n: [answer[i : i + 3] for i in range(0, len(answer), 3)]) as server:
        assert await client.post(server.url, b"{}") == (503, b"hello world")
        assert await client.post(server.url, b"{}") == (503, b"hello world")
    assert server.connections == 1


async def test_interim_100_then_the_answer(client: RawHttpClient) -> None:
    async with Scripted(lambda n: [b"HTTP/1.1 100 Continue\r\n\r\n", *_ok(b"x")]) as server:
        assert await client.post(server.url, b"{}") == (200, b"x")


async def test_body_until_close_and_a_new_connection_after(client: RawHttpClient) -> None:
    async with Scripted(lambda n: [b"HTTP/1.0 200 OK\r\n\r\n", b"all of it"], close_after=True) as server:
        assert await client.post(server.url, b"{}") == (200, b"all of it")
        assert await client.post(server.url, b"{}") == (200, b"all of it")
    assert server.connections == 2


async def test_connection_close_header_is_honoured(client: RawHttpClient) -> None:
    answer = [b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"]
    async with Scripted(lambda n: answer, close_after=True) as server:
        for _ in range(3):
            assert await client.post(server.url, b"{}") == (200, b"ok")
    assert server.connections == 3


async def test_garbage_is_a_protocol_error(client: RawHttpClient) -> None:
    async with Scripted(lambda n: [b"SPDY/9 what\r\n\r\n"]) as server:
        with pytest.raises(HttpProtocolError, match="status line"):
            await client.post(server.url, b"{}")


async def test_closed_without_answer_is_a_connection_error(client: RawHttpClient) -> None:
    async with Scripted(lambda n: [], close_after=True) as server:
        with pytest.raises(ConnectionError):
            await client.post(server.url, b"{}")


async def test_silence_is_a_timeout() -> None:
    quick = RawHttpClient(timeout_s=0.2)
    try:
        async with Scripted(lambda n: []) as server:
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(TimeoutError):
                await quick.post(server.url, b"{}")
            assert 0.15 < loop.time() - started < 1.0
    finally:
        await quick.close()


async def test_https_is_refused_with_advice(client: RawHttpClient) -> None:
    with pytest.raises(ValueError, match="--client aiohttp"):
        await client.post(URL("https://127.0.0.1:1/x"), b"{}")
