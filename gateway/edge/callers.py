"""Who is calling: the API key's owner and the bucket a request's rate limit counts against, and
whether the caller is still there.

Without API keys, rate limits count per peer address. ``X-Client-Id`` chooses the bucket only with
``trust_client_id`` (a proxy in front sets it): a header any client may send would let one client
spend another's bucket.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request
from starlette.types import Receive

from gateway.admission.gate import ANONYMOUS, Caller
from gateway.admission.priority import KeyTiers
from gateway.answers import waiters
from gateway.errors import ClientDisconnected, InvalidClientId
from gateway.settings import GatewaySettings

T = TypeVar("T")

CLIENT_ID_HEADER = "X-Client-Id"
_CLIENT_ID_PATTERN = re.compile(r"[\x21-\x7e]{1,128}")

CallerOf = Callable[[Request], Caller]


def caller_of(settings: GatewaySettings) -> CallerOf:
    """How a request's caller is told: a constant when neither API keys nor rate limits are on."""
    keys_on = bool(settings.api_keys)
    limits_on = settings.rate_limit_per_s > 0
    trust_client_id = settings.trust_client_id
    if not keys_on and not limits_on:
        return lambda request: ANONYMOUS

    def caller(request: Request) -> Caller:
        owner = request_owner(request)
        if not limits_on:
            return Caller(owner, tiers=request_tiers(request))
        if owner is not None:
            return Caller(owner, f"key:{owner}", request_tiers(request))
        return Caller(None, client_of(request, trust_client_id))

    return caller


def client_of(request: Request, trust_client_id: bool) -> str:
    """Which client sent ``request``: ``key:<owner>`` with API keys, else ``id:<X-Client-Id>`` behind a
    trusted proxy, else ``ip:<peer address>`` (an IPv6 peer by its /64: ``address_client``)."""
    owner = request_owner(request)
    if owner is not None:
        return f"key:{owner}"
    claimed = request.headers.get(CLIENT_ID_HEADER) if trust_client_id else None
    if claimed is not None:
        if not _CLIENT_ID_PATTERN.fullmatch(claimed):
            raise InvalidClientId(
                f"the {CLIENT_ID_HEADER} header must be 1 to 128 visible ASCII characters (no spaces)"
            )
        return f"id:{claimed}"
    return address_client(request.client.host) if request.client else "ip:unknown"


_PEERS_KEPT = 4096
"""IPv6 peers whose client ``address_client`` keeps: ``ipaddress`` costs as much as parsing a request,
and every submit asks (its body's share, its rate limit), a keep-alive peer many times over."""


def address_client(host: str) -> str:
    """``ip:<address>``, an IPv6 address by its /64: one subscriber (a home line, a cloud VM) gets a whole
    /64 and may send from any address in it, so counted by address one machine would be as many
    clients as it liked, each with its own rate limit, watchers and share of the bodies being read."""
    if ":" not in host:
        return f"ip:{host}"
    return _ipv6_client(host)


@functools.lru_cache(maxsize=_PEERS_KEPT)
def _ipv6_client(host: str) -> str:
    try:
        address = ipaddress.IPv6Address(host.partition("%")[0])  # without its zone (fe80::1%eth0)
    except ValueError:
        return f"ip:{host}"
    if address.ipv4_mapped is not None:  # an IPv4 peer of a dual-stack socket
        return f"ip:{address.ipv4_mapped}"
    return f"ip:{ipaddress.IPv6Network((address, 64), strict=False)}"


def request_tiers(request: Request) -> KeyTiers | None:
    """The API key's tiers that ``AuthMiddleware`` found, or None (normal, up to high)."""
    state = request.scope.get("state")
    return None if state is None else state.get("tiers")


def request_owner(request: Request) -> str | None:
    """The API key's owner id that ``AuthMiddleware`` found, or None without API keys."""
    state = request.scope.get("state")
    return None if state is None else state.get("owner")


async def disconnected(receive: Receive) -> None:
    """Returns once the client has gone: ASGI's ``receive()`` gives the request's body first (read
    already, or none for a GET), then waits for the disconnect."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_gone(work: Awaitable[T], receive: Receive) -> T:
    """``work``'s result, or ``ClientDisconnected`` once the client has gone: a wait must not hold
    what it counts against (a long-poll's watch) for a client that left (uvicorn cancels nothing)."""
    return await waiters.unless_gone(
        work,
        lambda: disconnected(receive),
        lambda: ClientDisconnected("the caller closed the connection before the answer"),
    )
