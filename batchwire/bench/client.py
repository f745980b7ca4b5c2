"""The HTTP clients the sender can use, behind one small Protocol.

aiohttp is the default: a well-trodden client whose behaviour users can trust. ``raw``
(``batchwire.bench.rawhttp``) is a minimal HTTP/1.1 keep-alive client that costs less CPU per
request, for when the generator shares few cores with the server under test and every core-share
it takes is one the server does not get.

Both raise the same exceptions, so outcomes are classified alike: ``TimeoutError`` past the
per-request timeout, ``ConnectionError`` (an ``OSError``) when no answer could be had, and
``HttpProtocolError`` for an answer that is not valid HTTP.
"""

from __future__ import annotations

from typing import Literal, Protocol

import aiohttp
from yarl import URL

ClientKind = Literal["aiohttp", "raw"]


class HttpProtocolError(Exception):
    """The server answered something that is not a well-formed HTTP/1.x response."""


class HttpClient(Protocol):
    async def post(self, url: URL, body: bytes) -> tuple[int, bytes]:
        """POSTs a JSON body; returns the status code and the whole response body."""
        ...

    async def close(self) -> None: ...


class AiohttpClient:
    """One ``ClientSession`` whose pool holds up to ``limit`` keep-alive connections."""

    def __init__(self, limit: int, timeout_s: float) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=limit, limit_per_host=0, ttl_dns_cache=None),
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            cookie_jar=aiohttp.DummyCookieJar(),
            headers={"Content-Type": "application/json"},
        )

    async def post(self, url: URL, body: bytes) -> tuple[int, bytes]:
        try:
            async with self._session.post(url, data=body) as response:
                return response.status, await response.read()
        except TimeoutError:
            raise
        except aiohttp.ClientConnectionError as err:
            raise ConnectionError(str(err) or type(err).__name__) from err
        except aiohttp.ClientError as err:
            raise HttpProtocolError(str(err) or type(err).__name__) from err

    async def close(self) -> None:
        await self._session.close()
