"""Redis behind Sentinel: ``redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/MASTER[/DB]``.

A pool built from such a URL asks the Sentinels for the primary's address whenever it opens a
connection (redis-py's ``SentinelConnectionPool``), so a connection that breaks in a failover is
reopened to the new primary without a restart. A connection that does not break (a graceful failover,
or a partition, leaves the old primary up and taking writes until the Sentinels demote it, which wipes
them) is closed by a check of the Sentinels that the pools of one URL in a process share
(``PrimaryFollower``). The credentials and DB are the Redis servers'; the Sentinels are asked without
credentials. A HOST without ``:PORT`` means Sentinel's port, 26379.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import redis
from redis.asyncio import Redis as AsyncRedis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import MasterNotFoundError, Sentinel, SentinelConnectionPool, SentinelManagedConnection
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.retry import Retry as SyncRetry

from transport.background_loop import BackgroundLoop
from transport.redis.blocking import BlockingPool

log = logging.getLogger(__name__)

SCHEME = "redis+sentinel"
FORM = "redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER[/DB]"
DEFAULT_SENTINEL_PORT = 26379
FOLLOW_INTERVAL_S = 0.5
"""How often a ``PrimaryFollower`` asks the Sentinels for the primary, to close its pools' connections to
any other server."""
HINT = "check --redis-url / BATCHWIRE_REDIS_URL"
UNENCODED_SLASH = "an '@' follows a '/', as when a password has a '/': write it %2F (and an '@' in it %40)"
"""The advice for a URL whose password has a ``/`` written as it is, which ends the URL's authority."""


class SentinelError(ValueError):
    """A Sentinel URL that is malformed, or names Sentinels or a master that are not there."""


@dataclass(frozen=True, slots=True)
class SentinelUrl:
    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None

    @property
    def addresses(self) -> str:
        return ",".join(_address(host, port) for host, port in self.sentinels)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_sentinel_url(url: str) -> bool:
    return url.partition("://")[0].lower() == SCHEME


def parse_sentinel_url(url: str) -> SentinelUrl:
    """The URL's parts; a ``SentinelError`` names the part that is wrong and the form expected."""

    def wrong(what: str) -> SentinelError:
        return SentinelError(f"Redis URL {redacted_sentinel_url(url)!r}: {what}; the form is {FORM}")

    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() != SCHEME:
        raise wrong(f"the scheme must be {SCHEME}://")
    if "?" in rest or "#" in rest:
        raise wrong("query options (?...) and fragments (#...) are not supported")
    netloc, _, path = rest.partition("/")
    if "@" in path:  # its addresses would quote the password's start
        raise wrong(UNENCODED_SLASH)
    username = password = None
    if "@" in netloc:
        userinfo, _, netloc = netloc.rpartition("@")
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    sentinels = tuple(_sentinel_address(item, wrong) for item in netloc.split(","))
    segments = path.split("/")
    if segments and segments[-1] == "" and len(segments) > 1:
        segments.pop()  # a trailing slash
    master = unquote(segments[0]) if segments else ""
    if not master:
        raise wrong("no master name after the Sentinel addresses")
    if len(segments) > 2:
        raise wrong(f"{'/'.join(segments[2:])!r} follows the DB number")
    db = 0
    if len(segments) == 2:
        if not segments[1].isdigit():
            raise wrong(f"the DB {segments[1]!r} is not a number")
        db = int(segments[1])
    return SentinelUrl(sentinels, master, db, username, password)


def _sentinel_address(item: str, wrong: Any) -> tuple[str, int]:
    if not item:
        raise wrong("no Sentinel address (HOST:PORT) before the master name")
    if item.startswith("["):
        host, bracket, tail = item[1:].partition("]")
        if not bracket or (tail and not tail.startswith(":")):
            raise wrong(f"the Sentinel address {item!r} is not [IPv6]:PORT")
        port_text = tail[1:] if tail else ""
    else:
        host, colon, port_text = item.rpartition(":")
        if not colon:
            host, port_text = item, ""
    if not host:
        raise wrong(f"the Sentinel address {item!r} has no host")
    if not port_text:
        return host, DEFAULT_SENTINEL_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise wrong(f"the port in Sentinel address {item!r} is not a number from 1 to 65535")
    return host, int(port_text)


def redacted_sentinel_url(url: str) -> str:
    """``url`` with its password hidden, up to its last ``@``: a password with a ``/`` written unencoded
    ends the authority early, and what follows the ``/`` is a secret too."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, tail = rest.rpartition("@")
    if not at:
        return url
    user, colon, _ = userinfo.partition(":")
    return f"{scheme}{sep}{user}{':***' if colon else ''}@{tail}"


def lookup_error(parsed: SentinelUrl, unanswered: Sequence[str], known: set[str], down: bool) -> str:
    """Why the Sentinels gave no primary, saying what to change."""
    where = parsed.addresses
    if len(unanswered) >= len(parsed.sentinels):
        return f"no Sentinel answered at {where}: {HINT} ({'; '.join(unanswered)})"
    if down:
        return (
            f"the Sentinels at {where} see master {parsed.master!r} as down (a failover may be under way; "
            "it ends once they promote a replica)"
        )
    named = ", ".join(repr(name) for name in sorted(known)) or "none"
    return f"Sentinels at {where} know no master named {parsed.master!r}; they know: {named}: {HINT}"


def _by_name(masters: object) -> Mapping[str, Mapping[str, Any]]:
    """SENTINEL MASTERS as redis-py parses it over RESP2: each master's state by its name."""
    if not isinstance(masters, dict):
        raise SentinelError(f"unexpected SENTINEL MASTERS reply: {masters!r}")
    return masters


def _up(state: Mapping[str, Any]) -> bool:
    """One Sentinel's view of the master (an entry of SENTINEL MASTERS): a primary it does not see down."""
    return bool(state["is_master"]) and not state["is_sdown"] and not state["is_odown"]


def _settled(state: Mapping[str, Any]) -> bool:
    """As ``_up``, and with no failover under way (one started leaves the primary up until it ends)."""
    return _up(state) and "failover" not in str(state.get("flags", ""))


def check_sentinels(url: str, timeout_s: float = 1.0) -> tuple[str, int]:
    """The primary's address as the Sentinels report it, asked once, synchronously, at start-up, so a
    role with a wrong URL stops before it creates anything; raises ``SentinelError`` otherwise."""
    parsed = parse_sentinel_url(url)
    unanswered: list[str] = []
    known: set[str] = set()
    down = False
    for host, port in parsed.sentinels:
        client = redis.Redis(
            host=host,
            port=port,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=SyncRetry(NoBackoff(), 0),  # a silent Sentinel is reported, not waited out
        )
        try:
            masters = _by_name(client.sentinel_masters())
        except (RedisError, OSError) as err:
            unanswered.append(f"{_address(host, port)}: {err}")
            continue
        finally:
            client.close()
        state = masters.get(parsed.master)
        if state is None:
            known.update(masters)
        elif _up(state):
            return str(state["ip"]), int(state["port"])
        else:
            down = True
    raise SentinelError(lookup_error(parsed, unanswered, known, down))


@dataclass(frozen=True, slots=True)
class MasterState:
    """What the Sentinels say of the master, for a readiness check that found Redis not ready."""

    failing_over: bool
    """The Sentinels see the primary as down (a failover is under way, or about to be)."""
    reason: str


async def master_state(url: str, timeout_s: float = 1.0) -> MasterState:
    """Asks the Sentinels (asynchronously, each at most ``timeout_s``) how they see the master."""
    parsed = parse_sentinel_url(url)
    unanswered: list[str] = []
    known: set[str] = set()
    for host, port in parsed.sentinels:
        client = AsyncRedis(
            host=host,
            port=port,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        try:
            masters = _by_name(await client.sentinel_masters())
        except (RedisError, OSError) as err:
            unanswered.append(f"{_address(host, port)}: {err}")
            continue
        finally:
            await client.aclose()
        state = masters.get(parsed.master)
        if state is None:
            known.update(masters)
            continue
        where = _address(str(state["ip"]), int(state["port"]))
        if not _settled(state):
            return MasterState(
                True,
                f"the Sentinels see the primary of {parsed.master!r} at {where} as down; they are promoting a replica",
            )
        return MasterState(
            False,
            f"the Sentinels name the primary of {parsed.master!r} at {where}; it does not answer, or the change "
            "feed is still reconnecting to it (the Sentinels fail it over if it stays silent)",
        )
    return MasterState(False, lookup_error(parsed, unanswered, known, down=False))


class _Sentinels(Sentinel):
    """redis-py's Sentinel client; its lookup failure says what to change instead of "No master found"."""

    def __init__(self, parsed: SentinelUrl, **sentinel_kwargs: Any) -> None:
        super().__init__(list(parsed.sentinels), sentinel_kwargs=sentinel_kwargs)
        self.parsed = parsed

    async def discover_master(self, service_name: str) -> tuple[str, int]:
        unanswered: list[str] = []
        known: set[str] = set()
        down = False
        for index, sentinel in enumerate(self.sentinels):
            try:
                masters = _by_name(await sentinel.sentinel_masters())
            except (RedisError, OSError, SentinelError) as err:
                # Passed over as at start (``check_sentinels``): one that answers with an error (a server
                # there that is no Sentinel) would otherwise fail every lookup, since it stays first.
                kwargs = sentinel.connection_pool.connection_kwargs
                unanswered.append(f"{_address(kwargs['host'], kwargs['port'])}: {err}")
                continue
            state = masters.get(service_name)
            if state is None:
                known.update(masters)
            elif self.check_master_state(dict(state), service_name):
                # The Sentinel that answered is asked first next time, as redis-py's own lookup does.
                self.sentinels[0], self.sentinels[index] = sentinel, self.sentinels[0]
                return str(state["ip"]), int(state["port"])
            else:
                down = True
        raise MasterNotFoundError(lookup_error(self.parsed, unanswered, known, down))


async def _masters(sentinel: AsyncRedis) -> Mapping[str, Mapping[str, Any]] | None:
    """One Sentinel's SENTINEL MASTERS; None if it does not answer, or answers something else."""
    try:
        return _by_name(await sentinel.sentinel_masters())
    except (RedisError, OSError, SentinelError):
        return None


class PrimaryFollower:
    """Asks the Sentinels for the primary every ``FOLLOW_INTERVAL_S`` and closes the connections, idle
    and in use, of every pool that follows it to any other server; each reopens to the primary they name.

    redis-py asks the Sentinels only when it opens a connection, so an open one stays on a server that
    lost the primary role without closing it (a graceful failover, a partition): that server takes
    writes until the Sentinels demote it, then drops them as it copies the new primary. One follower
    serves every pool of a Sentinel URL in a process (the composition root makes it with
    ``pools.follower_of``), so the Sentinels are asked once a round however many pools the process
    has. Its loop runs from the first pool's first connection to the last pool's close, and a round
    that fails is logged and tried again; a silent Sentinel costs a round its timeout, and the next
    one asks the others first.
    """

    def __init__(self, sentinels: _Sentinels, master: str) -> None:
        self.master = master
        self._sentinels = sentinels
        self._pools: set[SentinelPool] = set()
        self._following = BackgroundLoop(f"following the Redis primary of {master!r}")

    def join(self, pool: SentinelPool) -> None:
        """Follows for ``pool`` too, starting the loop if no pool had."""
        self._pools.add(pool)
        if not self._following.started:
            self._following.start(self._follow())

    async def leave(self, pool: SentinelPool) -> None:
        """Stops following for ``pool``; after the last pool, cancels and awaits the loop and closes the
        Sentinel connections (a pool that joins later starts them again)."""
        self._pools.discard(pool)
        if not self._pools:
            await self._following.close()
            await self._sentinels.aclose()

    async def _follow(self) -> None:
        """Runs until the last pool leaves: a round that fails is logged, and the next one tries again."""
        failing = ""  # the error last logged: one that repeats is logged once
        while True:
            await asyncio.sleep(FOLLOW_INTERVAL_S)
            try:
                primary = await self._sentinels.discover_master(self.master)
                for pool in list(self._pools):
                    await pool.close_others(primary)
                failing = ""
            except MasterNotFoundError:
                pass  # the Sentinels name no primary now; connections to a dead one fail by themselves
            except (RedisError, OSError, SentinelError) as err:
                if repr(err) != failing:
                    log.warning(
                        "following the primary of %r failed (tried again every %g s): %r",
                        self.master,
                        FOLLOW_INTERVAL_S,
                        err,
                    )
                failing = repr(err)


def primary_follower(url: str, timeout_s: float = 2.0) -> PrimaryFollower:
    """One follower for every pool of ``url`` in a process (pass it to each transport over that URL);
    ``timeout_s`` bounds each Sentinel's answer."""
    parsed = parse_sentinel_url(url)
    return PrimaryFollower(_sentinels(parsed, {"socket_connect_timeout": timeout_s}), parsed.master)


class SentinelPool(SentinelConnectionPool):
    """Connections to the master the Sentinels name; closing the pool closes its Sentinel clients too.

    From its first connection to its close, the pool's open connections follow the primary through
    ``follower`` (``PrimaryFollower``), shared with the other pools of its URL; given none, it follows
    with one of its own.
    """

    def __init__(self, *args: Any, follower: PrimaryFollower | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        self._follower = follower or PrimaryFollower(self.sentinel_manager, self.service_name)

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        self._follower.join(self)
        return await super().get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]

    async def disconnect(self, inuse_connections: bool = True) -> None:
        if inuse_connections:  # a full close; a master change drops only the idle connections
            await self._follower.leave(self)
        await super().disconnect(inuse_connections)
        if inuse_connections:
            await self.sentinel_manager.aclose()

    async def confirm_primary(self) -> bool:
        """Whether most Sentinels answer and every one that does names the same primary, not down and
        with no failover under way; if so, the pool's connections to any other server are closed, so
        the commands that follow reach that primary. A server's own word is no proof: one that lost
        the role while still up calls itself primary until the Sentinels demote it."""
        # All at once, so silent Sentinels cost one timeout together; over a copy, as ``discover_master``
        # reorders the list in place meanwhile.
        sentinels = list(self.sentinel_manager.sentinels)
        async with asyncio.TaskGroup() as group:
            asked = [group.create_task(_masters(sentinel)) for sentinel in sentinels]
        answers = [masters for task in asked if (masters := task.result()) is not None]
        named: set[tuple[str, int] | None] = set()
        for masters in answers:
            state = masters.get(self.service_name)
            named.add((str(state["ip"]), int(state["port"])) if state is not None and _settled(state) else None)
        if len(answers) * 2 <= len(sentinels) or len(named) != 1 or None in named:
            return False
        primary = named.pop()
        assert primary is not None
        await self.close_others(primary)
        return True

    async def close_others(self, primary: tuple[str, int]) -> None:
        """Closes the pool's connections, idle or in use, to any server but ``primary``."""
        open_ = [*self._get_free_connections(), *self._get_in_use_connections()]
        stale = [
            conn
            for conn in open_
            if isinstance(conn, SentinelManagedConnection) and conn.is_connected and (conn.host, conn.port) != primary
        ]
        for conn in stale:
            # Not waiting for the close to finish: a server cut off by a partition never acknowledges it.
            await conn.disconnect(nowait=True)
        if stale:
            log.warning(
                "closed %d connection(s) to %s, which the Sentinels no longer name primary of %r; they reopen to %s",
                len(stale),
                ", ".join(sorted({_address(conn.host, conn.port) for conn in stale})),
                self.service_name,
                _address(*primary),
            )


class BlockingSentinelPool(SentinelPool, BlockingPool):
    """``SentinelPool`` that makes a burst wait for a free connection, as ``BlockingPool``."""


def _sentinels(parsed: SentinelUrl, connection_kwargs: Mapping[str, Any]) -> _Sentinels:
    timeout_s = connection_kwargs.get("socket_connect_timeout") or 2.0
    return _Sentinels(
        parsed,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        # One quick retry covers a Sentinel connection that went stale; a Sentinel that stays
        # silent is skipped for the next one.
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    )


def _server_kwargs(parsed: SentinelUrl) -> dict[str, Any]:
    return {"db": parsed.db, "username": parsed.username, "password": parsed.password}


def sentinel_pool(url: str, follower: PrimaryFollower | None = None, **connection_kwargs: Any) -> SentinelPool:
    """A pool over the master named by ``url``, following it through ``follower`` (None: one of its own);
    ``connection_kwargs`` as for ``ConnectionPool``."""
    parsed = parse_sentinel_url(url)
    sentinels = _sentinels(parsed, connection_kwargs)
    return SentinelPool(parsed.master, sentinels, follower=follower, **_server_kwargs(parsed), **connection_kwargs)


def blocking_sentinel_pool(
    url: str, follower: PrimaryFollower | None = None, **connection_kwargs: Any
) -> BlockingSentinelPool:
    """As ``sentinel_pool``, with ``BlockingConnectionPool``'s ``timeout`` for a free connection."""
    parsed = parse_sentinel_url(url)
    sentinels = _sentinels(parsed, connection_kwargs)
    return BlockingSentinelPool(
        parsed.master, sentinels, follower=follower, **_server_kwargs(parsed), **connection_kwargs
    )


__all__ = [
    "FORM",
    "BlockingSentinelPool",
    "MasterState",
    "PrimaryFollower",
    "SentinelError",
    "SentinelPool",
    "SentinelUrl",
    "blocking_sentinel_pool",
    "check_sentinels",
    "is_sentinel_url",
    "master_state",
    "parse_sentinel_url",
    "primary_follower",
    "redacted_sentinel_url",
    "sentinel_pool",
]
