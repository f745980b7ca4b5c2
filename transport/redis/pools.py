"""Redis connection pools for the three kinds of traffic, each sized and timed for its own job.

- commands: short requests from many coroutines; waits for a free connection instead of failing a
  burst, and gives up quickly (socket timeout) when Redis stops answering;
- blocking: BZPOPMIN holds its connection for the whole wait, so claimers get a pool of their own and
  never starve the commands;
- pubsub: the one subscribed connection; no retry inside redis-py, because the reader task owns
  reconnecting (with backoff, logging, and subscribing again).

A ``redis+sentinel://`` URL gives pools that ask the Sentinels for the primary on every new
connection (``transport.redis.sentinel``), so every user of these pools follows a failover; the pools
of one process share a ``PrimaryFollower`` (``follower``), which moves their open connections too.

A ``redis+cluster://HOST:PORT,...`` URL names a Redis Cluster's startup nodes. Every transport (the
task store, the credit pool, the delivery log, the rate limits, the fleet registry, the answer cache)
touches one key's slot per command and script, and takes one through ``KeyedClient``: redis-py's
cluster client learns the slot map and routes each command to the primary of its key's slot. The
pools here refuse it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import redis
from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.cluster import PRIMARY
from redis.exceptions import (
    AskError,
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    BusyLoadingError,
    ClusterDownError,
    MaxConnectionsError,
    NoPermissionError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry as SyncRetry

from transport.errors import PermanentTransportError, StoreFullError
from transport.ports import TransportError
from transport.redis.blocking import BlockingPool
from transport.redis.sentinel import (
    UNENCODED_SLASH,
    PrimaryFollower,
    SentinelPool,
    blocking_sentinel_pool,
    is_sentinel_url,
    primary_follower,
    redacted_sentinel_url,
    sentinel_pool,
)

CLUSTER_SCHEME = "redis+cluster"


def is_cluster_url(url: str) -> bool:
    return url.partition("://")[0].lower() == CLUSTER_SCHEME


def redacted(url: str) -> str:
    """The URL without its password, for error messages and logs: up to its last ``@``
    (``redacted_sentinel_url``), and any ``...password=`` field of the query, which redis-py reads too."""
    base, mark, query = redacted_sentinel_url(url).partition("?")
    return base + mark + "&".join(map(_hidden, query.split("&"))) if mark else base


def _hidden(field: str) -> str:
    name, equals, _ = field.partition("=")
    return f"{name}=***" if equals and name.lower().endswith("password") else field


def unanswered(url: str, timeout_s: float = 1.0) -> str | None:
    """Why the Redis server at ``url`` did not answer a PING (None: it did), asked once, synchronously,
    at a role's start: a role pointed at nothing stops with that reason rather than a traceback. A
    server still loading its data answers (``LOADING``); the role's retries wait for it."""
    try:
        client = sync_client(url, timeout_s)
    except (*REDIS_ERRORS, OSError) as err:  # a cluster client reads the slot map here
        return str(err) or type(err).__name__
    try:
        client.ping()
    except BusyLoadingError:
        return None
    except (*REDIS_ERRORS, OSError) as err:
        return str(err) or type(err).__name__
    finally:
        client.close()
    return None


def sync_client(url: str, timeout_s: float) -> redis.Redis | redis.RedisCluster:
    """A synchronous client of ``url`` that tries each command once (a cluster's: of its startup nodes,
    whose slot map it reads as it is made), for checks made once at start, and for tools and tests."""
    options: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    if is_cluster_url(url):
        nodes, user, password = cluster_nodes(url)
        startup = [redis.cluster.ClusterNode(node.host, node.port) for node in nodes]  # type: ignore[no-untyped-call]
        return redis.RedisCluster(startup_nodes=startup, username=user, password=password, **options)
    return redis.Redis.from_url(url, retry=SyncRetry(NoBackoff(), 0), **options)


# Redis's refusal of a write over ``maxmemory``. redis-py maps the ``-OOM`` reply to
# ``OutOfMemoryError``; a script error from an older server wraps it in a plain ``ResponseError``.
_OOM_TEXT = "command not allowed when used memory"


def is_out_of_memory(err: Exception) -> bool:
    return isinstance(err, OutOfMemoryError) or (isinstance(err, ResponseError) and _OOM_TEXT in str(err))


REDIS_ERRORS = (RedisError, RedisClusterException)
"""What a command can raise: redis-py's errors, and its cluster client's own, which are not
``RedisError``s (a slot no primary serves mid-failover, a slot map no node could give)."""


FULL_ADVICE = (
    "room comes back as stored results expire, and an operator can raise Redis's maxmemory "
    "(batchwire stack up --redis-maxmemory, BATCHWIRE_REDIS_MAXMEMORY)"
)
"""What to do about a full Redis: the one advice of every message that says so (a write that failed here,
the write-refusal watch's refusal of a submit)."""


def translate(action: str, err: RedisError | RedisClusterException) -> TransportError:
    """``ResponseError`` (a script or type error) will repeat; connection trouble may not, nor the
    refusals that pass (``_passes``: a failover in progress, say), and neither does a full store
    (``OOM``: the server refuses writes until expiring states free memory)."""
    if is_out_of_memory(err):
        return StoreFullError(
            f"{action} failed: the result store is full (Redis used memory is over its maxmemory, and "
            f"it evicts nothing); {FULL_ADVICE}: {err}"
        )
    message = f"{action} failed: {type(err).__name__}: {err}{credentials_hint(err)}"
    permanent = isinstance(err, ResponseError) and not _passes(err)
    return PermanentTransportError(message) if permanent else TransportError(message)


CREDENTIALS_ADVICE = (
    "Redis refused this process's credentials or their rights: check the user and password in --redis-url / "
    "BATCHWIRE_REDIS_URL against the server's requirepass or ACL user (a role reads its URL at start)"
)
"""What to do about an authentication or ACL refusal: redis-py's own text names neither the setting nor the server's."""


def credentials_hint(err: BaseException) -> str:
    """``"; " + CREDENTIALS_ADVICE`` for a refusal of this process's credentials or rights (a password
    changed at runtime, an ACL user disabled or narrowed), else ``""``: a role that meets one retries
    and logs it, and redis-py's text (``HELLO must be called with the client already authenticated``)
    does not say what to change."""
    refused = isinstance(err, (AuthenticationError, AuthenticationWrongNumberOfArgsError, NoPermissionError)) or (
        isinstance(err, ResponseError) and str(err).startswith(("NOAUTH", "WRONGPASS", "NOPERM"))
    )
    return f"; {CREDENTIALS_ADVICE}" if refused else ""


WRITE_REFUSALS = ("NOREPLICAS", "MISCONF")
"""Error codes of a primary that refuses every write for a while (see ``_passes``), besides ``OOM``."""

_TOPOLOGY_ERRORS = (ClusterDownError, TryAgainError, AskError, ReadOnlyError)
"""Error replies of a failover in progress (a Redis Cluster whose shard has lost its primary, a slot
that moved, a primary turned replica): retried, not permanent."""


def _passes(err: RedisError | RedisClusterException) -> bool:
    """A failover's error reply, or a server's refusal that clears without a change of ours: ``UNBLOCKED``,
    which a primary turned replica gives a blocked command (``BZPOPMIN``); ``NOREPLICAS``, a primary's
    refusal of writes while fewer replicas than its ``min-replicas-to-write`` are connected (a replica
    down, or promoted away from it); ``MISCONF``, its refusal of writes while it cannot save to disk
    (redis-py raises these three as plain ``ResponseError``s); ``NOPERM``, a command its ACL user may not
    run (an operator narrowed or disabled the user at runtime: the fix is the server's, ``ACL SETUSER``);
    and ``NOSCRIPT`` from a script call that already loaded its script once (a second failover to a fresh
    primary in between: the next try loads it again). Retried, a role waits them out; stopped, it would
    be restarted into the same refusal, each restart a death toward ``--max-deliveries`` for the inputs
    of the batch it held."""
    return isinstance(err, (*_TOPOLOGY_ERRORS, NoScriptError, NoPermissionError)) or str(err).startswith(
        ("UNBLOCKED", *WRITE_REFUSALS)
    )


def _retry_once() -> Retry:
    # One immediate retry on a fresh connection covers a pooled connection that Redis closed (restart,
    # idle timeout). Timeouts are not retried: the command may have run, and the caller's deadline
    # is better served by an error. The rare reply lost after a write ran makes the retry report
    # "already there" (create -> False, apply -> False), which callers treat as someone else's write.
    return Retry(ExponentialBackoff(cap=0.1, base=0.01), 1, supported_errors=(RedisConnectionError,))


@dataclass(frozen=True, slots=True)
class PoolOptions:
    """How one transport's command connections are pooled and timed (each transport sizes its own)."""

    max_connections: int = 16
    socket_timeout_s: float = 2.0
    """A connect or a command that gets no answer this long fails."""
    pool_timeout_s: float = 2.0
    """A burst waits this long for a free connection rather than fail."""
    health_check_interval_s: float = 10.0


def _keepalive(url: str) -> dict[str, bool]:
    """TCP keepalive, where there is TCP: a ``unix://`` connection refuses the option."""
    return {} if url.partition("://")[0].lower() == "unix" else {"socket_keepalive": True}


def _blocking_from_url(url: str, follower: PrimaryFollower | None, **kwargs: Any) -> BlockingPool:
    if is_cluster_url(url):
        raise PermanentTransportError(
            f"{redacted(url)}: a connection pool talks to one primary, over a redis:// or redis+sentinel:// URL; "
            "a Redis Cluster takes a KeyedClient"
        )
    if is_sentinel_url(url):
        return blocking_sentinel_pool(url, follower, **kwargs)
    return BlockingPool.from_url(url, **kwargs)


def follower_of(url: str) -> PrimaryFollower | None:
    """The ``PrimaryFollower`` that every pool of ``url`` in a process shares: one for a Sentinel URL,
    None for any other (a plain server is its own primary; a cluster client follows its slot map)."""
    return primary_follower(url) if is_sentinel_url(url) else None


def command_pool(url: str, options: PoolOptions, follower: PrimaryFollower | None = None) -> BlockingPool:
    """``follower``: behind Sentinel, the one the process's pools of ``url`` share (None: one of its own)."""
    return _blocking_from_url(url, follower, **_command_options(url, options))


def _command_options(url: str, options: PoolOptions) -> dict[str, Any]:
    """A command pool's settings: ``options``' connections and timeouts, keepalive, one retry."""
    return {
        "max_connections": options.max_connections,
        "timeout": options.pool_timeout_s,
        "socket_timeout": options.socket_timeout_s,
        "socket_connect_timeout": options.socket_timeout_s,
        **_keepalive(url),
        "health_check_interval": options.health_check_interval_s,
        "retry": _retry_once(),
    }


class CommandClient:
    """A Redis client over a pool of its own (``command_pool``, or ``blocking_pool`` with ``options``'
    connections); ``close`` releases both."""

    def __init__(
        self, url: str, options: PoolOptions, *, blocking: bool = False, follower: PrimaryFollower | None = None
    ) -> None:
        self.pool = (
            blocking_pool(url, options.max_connections, options, follower)
            if blocking
            else command_pool(url, options, follower)
        )
        self.redis = Redis(connection_pool=self.pool)

    async def confirm_primary(self) -> bool:
        """Behind Sentinel, ``SentinelPool.confirm_primary``; a plain Redis URL names its primary itself."""
        return not isinstance(self.pool, SentinelPool) or await self.pool.confirm_primary()

    async def close(self) -> None:
        await self.redis.aclose()
        await self.pool.disconnect()


class KeyedClient:
    """A client for a transport whose every command and script touches one key's slot: over a
    ``redis+cluster://`` URL, the cluster client (``cluster_client``); otherwise a ``CommandClient``.
    ``blocking``: for blocking commands (BZPOPMIN), with no read timeout. ``follower``: as ``command_pool``."""

    def __init__(
        self, url: str, options: PoolOptions, *, blocking: bool = False, follower: PrimaryFollower | None = None
    ) -> None:
        self.url = url
        self._commands = (
            None if is_cluster_url(url) else CommandClient(url, options, blocking=blocking, follower=follower)
        )
        self.redis: Redis | RedisCluster = (
            cluster_client(url, options, blocking=blocking) if self._commands is None else self._commands.redis
        )

    async def start(self) -> None:
        """Reads a cluster's slot map before any command: redis-py's cluster client, first used by many
        coroutines at once, has them all read it together, and some of their commands fail."""
        if isinstance(self.redis, RedisCluster):
            what = f"reading the slot map of the Redis Cluster at {redacted(self.url)}"
            try:
                await self.redis.initialize()
            except REDIS_ERRORS as err:
                raise translate(what, err) from err

    async def confirm_primary(self) -> bool:
        """Whether the server the commands reach is surely the primary (``CommandClient.confirm_primary``;
        a cluster's client routes by its slot map, which a failover's errors make it read again)."""
        return self._commands is None or await self._commands.confirm_primary()

    async def close(self) -> None:
        if self._commands is not None:
            await self._commands.close()
        else:
            await self.redis.aclose()


class NodeClients:
    """Plain clients to single nodes of the Redis Cluster of ``url`` (its credentials), each over a
    pool of ``options``' connections, made on first use: for pipelines that must run on one
    connection to one primary (``WAIT`` counts only its own connection's writes)."""

    def __init__(self, url: str, options: PoolOptions) -> None:
        self.url = url
        self.options = options
        self._clients: dict[tuple[str, int], Redis] = {}

    def of(self, host: str, port: int) -> Redis:
        client = self._clients.get((host, port))
        if client is None:
            _, user, password = cluster_nodes(self.url)
            options = _command_options(self.url, self.options)
            pool = BlockingPool(host=host, port=port, username=user, password=password, **options)
            client = self._clients[(host, port)] = Redis(connection_pool=pool)
        return client

    async def close(self) -> None:
        clients, self._clients = self._clients, {}
        for client in clients.values():
            await client.aclose()
            await client.connection_pool.disconnect()


def cluster_nodes(url: str) -> tuple[list[ClusterNode], str | None, str | None]:
    """The startup nodes, user and password of a ``redis+cluster://[USER:PASSWORD@]HOST:PORT,...`` URL.

    Parsed here: redis-py's ``RedisCluster.from_url`` takes one node, and a deployment names several,
    so that losing one does not stop a client from finding the cluster. The user and password are
    percent-decoded, as in a ``redis://`` URL: one with a character a URL reserves is written encoded."""
    _, _, rest = url.partition("://")
    netloc, _, path = rest.partition("/")
    form = f"the form is {CLUSTER_SCHEME}://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]"
    if "@" in path:  # its addresses would quote the password's start
        raise PermanentTransportError(f"Redis URL {redacted(url)!r}: {UNENCODED_SLASH}; {form}")
    userinfo, at, hosts = netloc.rpartition("@")
    user, _, password = (unquote(part) for part in userinfo.partition(":")) if at else ("", "", "")
    nodes: list[ClusterNode] = []
    for address in hosts.split(","):
        host, _, port = address.strip().rpartition(":")
        if not host or not port.isdigit():
            raise PermanentTransportError(f"Redis URL {redacted(url)!r}: {address!r} is not HOST:PORT; {form}")
        nodes.append(ClusterNode(host, int(port)))
    return nodes, user or None, password or None


class _WaitingCluster(RedisCluster):
    """redis-py's cluster client raises ``MaxConnectionsError`` once a node's connections are all busy.
    Here a command waits up to the pool timeout for one of its node's ``max_connections`` turns instead,
    as it does on the single-Redis command pool (``BlockingPool``). The turns are the node's
    own, as its connections are: commands queued behind a primary that answers slowly leave the other
    primaries' commands their turns. Pipelines do not take a turn.

    It also meets a node that an ``ASK`` names before the slot map does (a slot migrating to a primary
    added since the map was read, as a scale-out does): redis-py follows a ``MOVED`` to such a node but
    looks an ``ASK``'s up in its cache alone, and fails with an ``AttributeError`` of its own.

    A command that timed out is not sent again, as over one Redis (``ERRORS_ALLOW_RETRY``): it may have run, and
    a frozen primary would hold it through every retry. Connection errors, ``CLUSTERDOWN`` and a slot no
    primary serves are still retried on a refreshed slot map; the timeout asks for that refresh too.
    Pipelines read redis-py's own list (``RedisCluster.ERRORS_ALLOW_RETRY``) and still retry a timeout, so a
    write that must not land twice is one script, not a pipeline."""

    ERRORS_ALLOW_RETRY = tuple(  # type: ignore[assignment]  # redis-py types it as its own four errors
        error for error in RedisCluster.ERRORS_ALLOW_RETRY if error is not RedisTimeoutError
    )

    def __init__(self, *, max_connections: int, pool_timeout_s: float | None, **kwargs: Any) -> None:
        super().__init__(max_connections=max_connections, **kwargs)
        self._max_connections = max_connections
        self._turns: dict[str, asyncio.Semaphore] = {}
        """Per node name: turns for its connections."""
        self._pool_timeout_s = pool_timeout_s

    async def _execute_command(self, target_node: ClusterNode, *args: Any, **kwargs: Any) -> Any:
        # redis-py's one attempt of a command on the node its slot names (its retries call it again).
        # ``MaxConnectionsError`` is no node's failure: redis-py neither retries it nor reads the slot map.
        turns = self._turns.get(target_node.name)
        if turns is None:
            turns = self._turns[target_node.name] = asyncio.Semaphore(self._max_connections)
        try:
            async with asyncio.timeout(self._pool_timeout_s):
                await turns.acquire()
        except TimeoutError:
            raise MaxConnectionsError(
                f"no free connection to Redis Cluster node {target_node.name} within {self._pool_timeout_s} s"
            ) from None
        try:
            return await super()._execute_command(target_node, *args, **kwargs)
        finally:
            turns.release()

    def get_node(
        self, host: str | None = None, port: int | None = None, node_name: str | None = None
    ) -> ClusterNode | None:
        node = super().get_node(host, port, node_name)
        if node is None and host and port:  # a redirect's node, not met yet: as redis-py meets a MOVED's
            manager = self.nodes_manager
            node = ClusterNode(host, port, PRIMARY, **manager.connection_kwargs)
            manager.set_nodes(manager.nodes_cache, {node.name: node})
        return node


def cluster_client(url: str, options: PoolOptions, *, blocking: bool = False) -> RedisCluster:
    """A cluster client over the URL's startup nodes, with ``options``' connections per node. ``blocking``:
    for blocking commands (BZPOPMIN), as ``blocking_pool``: no read timeout, and no limit on the wait for
    a connection (the caller bounds each wait itself)."""
    nodes, user, password = cluster_nodes(url)
    return _WaitingCluster(
        pool_timeout_s=None if blocking else options.pool_timeout_s,
        startup_nodes=nodes,
        username=user,
        password=password,
        max_connections=options.max_connections,
        socket_timeout=None if blocking else options.socket_timeout_s,
        socket_connect_timeout=options.socket_timeout_s,
        socket_keepalive=True,
        health_check_interval=options.health_check_interval_s,
    )


def blocking_pool(
    url: str, max_connections: int, options: PoolOptions, follower: PrimaryFollower | None = None
) -> BlockingPool:
    """Connections for blocking commands: no read timeout (the caller bounds each wait itself)."""
    return _blocking_from_url(
        url,
        follower,
        max_connections=max_connections,
        timeout=None,
        socket_timeout=None,
        socket_connect_timeout=options.socket_timeout_s,
        **_keepalive(url),
        health_check_interval=options.health_check_interval_s,
        retry=_retry_once(),
    )


def _pubsub_options(url: str, socket_timeout_s: float) -> dict[str, Any]:
    return {
        "max_connections": 2,
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": socket_timeout_s,
        **_keepalive(url),
        "health_check_interval": 0,
        "retry": Retry(NoBackoff(), 0, supported_errors=()),
    }


def pubsub_pool(url: str, *, socket_timeout_s: float, follower: PrimaryFollower | None = None) -> ConnectionPool:
    """The PubSub connection: reads are bounded per call by the reader; no health check and no retry
    inside redis-py, whose own reconnect would read replies behind the reader's back."""
    options = _pubsub_options(url, socket_timeout_s)
    if is_sentinel_url(url):
        return sentinel_pool(url, follower, **options)
    return ConnectionPool.from_url(url, **options)


def node_pubsub_pool(url: str, host: str, port: int, *, socket_timeout_s: float) -> ConnectionPool:
    """``pubsub_pool`` to one node of the Redis Cluster of ``url`` (its credentials)."""
    _, user, password = cluster_nodes(url)
    options = _pubsub_options(url, socket_timeout_s)
    return ConnectionPool(host=host, port=port, username=user, password=password, **options)
