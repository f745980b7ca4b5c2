"""Typed settings of one gateway process.

The CLI fills them from flags and ``BATCHWIRE_*`` environment variables: each field ``x`` is read
from ``BATCHWIRE_X``, which is why every validation message names both (see :func:`env_name`).
"""

from __future__ import annotations

import math
import re
import secrets
from dataclasses import dataclass, field, fields

ENV_PREFIX = "BATCHWIRE_"

# Gateway ids end up in Redis channel names and Kafka headers: keep them to a safe alphabet.
_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_DIGEST_PATTERN = re.compile(r"[0-9a-f]{64}")


def env_name(setting: str) -> str:
    """The environment variable the CLI reads ``setting`` from, e.g. ``BATCHWIRE_MAX_INPUT_CHARS``."""
    return ENV_PREFIX + setting.upper()


_NO_VARIABLE = frozenset({"min_timeout_ms", "retry_after_s", "ready_timeout_s"})
"""Fields that no flag or variable sets (code that builds the settings does): a message about one
names no ``BATCHWIRE_*`` variable, which would send an operator to set what nothing reads."""


MAX_SSE_PING_S = 50.0
"""The longest quiet an event stream may have: proxies commonly cut a connection idle for 60 s, and
batchwire's client reads a stream quiet that long as lost (``STREAM_READ_S``), spending a retry on each."""


def _named(setting: str) -> str:
    """``setting`` as a message names it: with its variable, where it has one."""
    return setting if setting in _NO_VARIABLE else f"{setting} ({env_name(setting)})"


def new_gateway_id() -> str:
    """A process-unique id, so that replies for this process's callers reach only this process."""
    return "gw-" + secrets.token_hex(4)


REQUEST_RUN = 16
"""Consecutive requests of a model that a gateway sends to one request partition, so that its
producer's linger gathers them into one record batch (``transport.routing.Partitioner.choose``)."""


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """What one gateway listens on, which requests it accepts, and how long it holds callers."""

    host: str = "127.0.0.1"
    port: int = 8000
    gateway_id: str = field(default_factory=new_gateway_id)
    models: tuple[str, ...] = ("sim",)
    default_model: str = "sim"
    default_timeout_ms: int = 30_000
    max_timeout_ms: int = 30_000
    min_timeout_ms: int = 1
    max_input_chars: int = 65_536
    max_batch_tokens: int = 0
    """With a token counter (``Gateway``'s ``count_tokens``), an input over this many tokens is refused
    (413): the batchers' budget, which no batch may exceed (0: no budget)."""
    max_body_bytes: int = 1_048_576
    max_body_bytes_in_flight: int = 33_554_432
    """What the bodies being read hold together, at most: past it a request is refused (503), so that
    connections that each send most of a large body and stall cannot take the process's memory. One
    client's bodies hold at most ``body_bytes_per_client`` of it."""
    max_inflight: int = 10_000
    """Submissions in progress plus synchronous callers held open; beyond it: 503 + Retry-After."""
    max_watchers: int = 2_000
    """Long-polls and event streams held open at once; beyond it: 503 ``overloaded`` + Retry-After.
    Each holds memory while open (its connection, request and store watch); the process keeps
    the high-water mark of that memory for reuse, so this also bounds what a burst of streams costs."""
    max_watchers_per_client: int = 500
    """Of ``max_watchers``, what one client (its API key; without keys its address, or its
    ``X-Client-Id`` behind a trusted proxy) may hold: one client cannot take every slot."""
    max_poll_wait_s: float = 60.0
    """The longest ``?wait=`` a long-poll may ask for."""
    sse_max_s: float = 600.0
    """An event stream closes after this long even without a terminal state; clients reconnect."""
    sse_ping_s: float = 15.0
    """Keep-alive comment interval on event streams, so proxies do not cut idle connections; at most
    ``MAX_SSE_PING_S``."""
    retry_after_s: int = 1
    """The Retry-After given with 503 answers (overloaded, unavailable, not ready)."""
    reply_recheck_s: float = 1.0
    """A synchronous caller whose reply has not come after this long is looked up in the store, and
    again after 2x, 4x, up to 8x as long (guards against a reply lost in a Redis PubSub reconnect).
    From then on its connection is also watched: a caller who leaves has its task cancelled. A task still
    queued or batched this long past its deadline is ended ``expired`` by a gateway that reads it (its
    batcher or worker would have ended it at the deadline: none is up)."""
    stream_recheck_s: float = 5.0
    """A long-poll or event stream with no change for this long re-reads the task from the store (a
    change message can be lost in a PubSub reconnect)."""
    ready_timeout_s: float = 2.0
    """How long ``/readyz`` and ``/metrics`` (its ``batchwire_ready``) wait for each readiness check before
    counting it as down."""
    max_queue_depth: int = 20_000
    """Requests of one model accepted and not yet handed to a worker (its request partitions' lag);
    beyond it that model's submits get 503 + Retry-After and nothing is queued. 0 turns the check off."""
    queue_fraction_normal: float = 0.8
    """A ``normal`` request is refused (503) once its model's queue holds this fraction of
    ``max_queue_depth``; ``high`` may fill all of it: overload sheds lower tiers first."""
    queue_fraction_low: float = 0.5
    """The same for ``low``: at most ``queue_fraction_normal``."""
    admit_by_wait: bool = True
    """Refuse (503 + Retry-After) a request whose answer its model's queue predicts past its deadline
    (see ``gateway.admission.wait``), and every request of a model whose workers take nothing."""
    stall_s: float = 5.0
    """A model whose queue holds requests while no batch reaches its workers for this long is stalled."""
    rate_limit_per_s: float = 0.0
    """Submits per second per client (API key, else the peer's IP address, or X-Client-Id with
    ``trust_client_id``), shared by every gateway through the store; beyond it: 429 + Retry-After.
    0 turns rate limits off."""
    trust_client_id: bool = False
    """Without API keys, rate-limit by the X-Client-Id header instead of the peer address. Only for a
    proxy in front that sets the header itself: a client that may send it can spend anyone's bucket."""
    rate_limit_burst: int = 0
    """Submits a client may save up and send at once; 0 means one second's worth of the rate."""
    request_linger_ms: float = 4.0
    """Over Kafka: how long the request producer gathers requests into one produce request
    (``linger_ms``), which carries up to ``REQUEST_RUN`` consecutive requests to one partition. Each
    produce round trip costs the gateway and the broker CPU whatever it carries (aiokafka encodes
    the protocol in Python), so fewer, fuller ones pay for the linger a batcher waits before it reads
    a request: under load that request waits for a busy worker anyway. A request that comes 5 lingers
    or more after the one before it goes at once (``transport.kafka.producers.IDLE_LINGERS``), so light
    load pays no linger. 0 sends each at once."""
    max_header_bytes: int = 16_384
    """Largest request line plus headers; beyond it the gateway answers 431 and closes the connection,
    having parsed no byte past the limit (``gateway.edge.http_limits``)."""
    header_timeout_s: float = 10.0
    """How long a request's headers may take to arrive, from the connection's opening or the end of the
    previous response; then 408 (a plain close when nothing came) and the connection closes."""
    body_timeout_s: float = 30.0
    """How long a request's body may take to arrive after its headers; then 408 and the connection closes."""
    max_connections: int = 4096
    """Open HTTP connections. At the cap a new connection takes the place of the one that has waited
    longest without sending a whole request (its head or its body); when every one has, the new one is answered
    503 + Retry-After and closed before it is read. Each open connection holds memory, so the cap also
    bounds what a flood of idle ones costs."""
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    """sha256 hex digests of the accepted API keys (never the keys; ``gateway.edge.auth.load_api_keys``
    turns keys into digests). Empty: no keys needed and every task is visible to every caller."""
    operator_keys: tuple[str, ...] = field(default=(), repr=False)
    """Those of ``api_keys`` that are operator keys: with keys on, only they read ``/metrics``."""
    key_tiers: tuple[str, ...] = field(default=(), repr=False)
    """Priority tiers of those of ``api_keys`` the keys file gives any, each ``<digest> <default>
    <ceiling>`` (``gateway.admission.priority.KeyTiers``); a key not here defaults to normal, up to high."""
    deterministic_models: tuple[str, ...] = ()
    """Models whose answer depends on the input alone (the sim backend's reversal, greedy decoding).
    Only their requests are collapsed and cached: another model's identical requests each run."""
    public_models: tuple[str, ...] = ()
    """Deterministic models whose answers every API key may share: their cache and collapsing span
    all callers. Any other model's are scoped per API key (``gateway.sharing.answer_keys``)."""
    cache_ttl_s: float = 0.0
    """How long a completed answer of a deterministic model is served from the result cache; 0 turns
    the cache off."""

    def __post_init__(self) -> None:
        _check_types(self)
        _check_identity(self)
        _check_models(self)
        _check_bounds(self)
        _check_durations(self)
        _check_rate_limits(self)
        _check_keys(self)
        _check_sharing(self)

    @property
    def url(self) -> str:
        """Where the gateway serves, as a browser or ``curl`` takes it (an IPv6 host in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def body_bytes_per_client(self) -> int:
        """What the bodies one client (its API key; without keys its address, or its ``X-Client-Id``
        behind a trusted proxy) sends may hold at once: a quarter of ``max_body_bytes_in_flight``, at
        least one body of ``max_body_bytes``, so that one client's stalled bodies leave room for others'."""
        return max(self.max_body_bytes, self.max_body_bytes_in_flight // 4)

    @property
    def rate_limit_burst_tokens(self) -> int:
        """The bucket size: ``rate_limit_burst``, or one second's worth of the rate when that is 0."""
        return self.rate_limit_burst or max(1, math.ceil(self.rate_limit_per_s))


def _check_types(settings: GatewaySettings) -> None:
    """Catches a CLI that forgot to convert a flag, before a str-typed port fails far from here."""
    for spec in fields(settings):
        value = getattr(settings, spec.name)
        if spec.type == "str":
            ok = isinstance(value, str)
        elif spec.type == "int":
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif spec.type == "float":
            ok = isinstance(value, int | float) and not isinstance(value, bool) and value == value
        elif spec.type == "bool":
            ok = isinstance(value, bool)
        else:  # tuple[str, ...]
            ok = isinstance(value, tuple) and all(isinstance(item, str) for item in value)
        if not ok:
            raise TypeError(f"{spec.name} ({env_name(spec.name)}) must be {spec.type}, got {value!r}")


def _at_least(settings: GatewaySettings, name: str, minimum: float, other: str | None = None) -> None:
    value = getattr(settings, name)
    if value < minimum:
        bound = f"{_named(other)} = {minimum}" if other else str(minimum)
        raise ValueError(f"{_named(name)} is {value}; it must be at least {bound}")


def _check_identity(settings: GatewaySettings) -> None:
    """Where it listens and the id its replies are addressed to."""
    if not settings.host:
        raise ValueError(f"host ({env_name('host')}) must not be empty")
    if not 0 <= settings.port <= 65535:
        raise ValueError(f"port ({env_name('port')}) is {settings.port}; it must be within 0..65535")
    if not _ID_PATTERN.fullmatch(settings.gateway_id):
        raise ValueError(
            f"gateway_id ({env_name('gateway_id')}) is {settings.gateway_id!r}; use 1 to 64 characters from "
            "A-Z a-z 0-9 . _ - starting with a letter or digit"
        )


def _check_models(settings: GatewaySettings) -> None:
    """At least one model, each named once in the safe alphabet, the default among them."""
    models = settings.models
    if not models:
        raise ValueError(f"models ({env_name('models')}) must name at least one model")
    for model in models:
        if not _ID_PATTERN.fullmatch(model):
            raise ValueError(
                f"models ({env_name('models')}) contains {model!r}; a model name is 1 to 64 characters "
                "from A-Z a-z 0-9 . _ - starting with a letter or digit"
            )
    if len(set(models)) != len(models):
        raise ValueError(f"models ({env_name('models')}) lists a model twice: {', '.join(models)}")
    if settings.default_model not in models:
        raise ValueError(
            f"default_model ({env_name('default_model')}) is {settings.default_model!r}, which is not among "
            f"models ({env_name('models')}): {', '.join(models)}"
        )


def _check_bounds(settings: GatewaySettings) -> None:
    """The timeouts in order, and every size and count at least its minimum."""
    _at_least(settings, "min_timeout_ms", 1)
    _at_least(settings, "default_timeout_ms", settings.min_timeout_ms)
    _at_least(settings, "max_timeout_ms", settings.default_timeout_ms, "default_timeout_ms")
    _at_least(settings, "max_input_chars", 1)
    _at_least(settings, "max_body_bytes", 64)
    _at_least(settings, "max_body_bytes_in_flight", settings.max_body_bytes)
    _at_least(settings, "max_inflight", 1)
    _at_least(settings, "max_watchers", 1)
    _at_least(settings, "max_watchers_per_client", 1)
    _at_least(settings, "max_poll_wait_s", 0)
    _at_least(settings, "retry_after_s", 1)
    _at_least(settings, "max_header_bytes", 1024)
    _at_least(settings, "max_connections", 1)
    _at_least(settings, "max_queue_depth", 0)
    _at_least(settings, "max_batch_tokens", 0)  # read as no budget, it would admit what the batchers budget
    if not 0 < settings.queue_fraction_low <= settings.queue_fraction_normal <= 1:
        raise ValueError(
            f"queue fractions must be 0 < queue_fraction_low ({settings.queue_fraction_low}, "
            f"{env_name('queue_fraction_low')}) <= queue_fraction_normal ({settings.queue_fraction_normal}, "
            f"{env_name('queue_fraction_normal')}) <= 1"
        )


def _check_durations(settings: GatewaySettings) -> None:
    """Intervals and timeouts positive and finite; the producer's delays within a second."""
    for name in (
        "sse_max_s",
        "sse_ping_s",
        "reply_recheck_s",
        "stream_recheck_s",
        "ready_timeout_s",
        "header_timeout_s",
        "body_timeout_s",
    ):
        value = getattr(settings, name)
        if not value > 0 or value == float("inf"):
            raise ValueError(f"{_named(name)} is {value}; it must be a positive finite number")
    if settings.sse_ping_s > MAX_SSE_PING_S:
        raise ValueError(
            f"{_named('sse_ping_s')} is {settings.sse_ping_s}; it must be at most {MAX_SSE_PING_S:g} s: a stream "
            "quiet for a minute is cut by common proxies and read as lost by batchwire's client"
        )
    if not settings.stall_s > 0:
        raise ValueError(f"stall_s must be > 0, got {settings.stall_s} ({env_name('stall_s')})")
    if not 0 <= settings.request_linger_ms <= 1000:
        name = "request_linger_ms"
        raise ValueError(
            f"{name} ({env_name(name)}) is {settings.request_linger_ms}; it must be within 0..1000 (milliseconds)"
        )


def _check_rate_limits(settings: GatewaySettings) -> None:
    _at_least(settings, "rate_limit_burst", 0)
    if not 0 <= settings.rate_limit_per_s < float("inf"):
        raise ValueError(
            f"rate_limit_per_s ({env_name('rate_limit_per_s')}) is {settings.rate_limit_per_s}; it must be a "
            "finite number, 0 to turn rate limits off"
        )


def _check_keys(settings: GatewaySettings) -> None:
    """API keys as sha256 digests, operator keys among them."""
    if not all(_DIGEST_PATTERN.fullmatch(digest) for digest in settings.api_keys):
        # The value is not shown: a plain key passed here by mistake must not reach a log.
        raise ValueError(
            f"api_keys ({env_name('api_keys')}) must hold sha256 hex digests; keys given as text are hashed "
            "by the CLI (gateway.edge.auth.load_api_keys)"
        )
    if not set(settings.operator_keys) <= set(settings.api_keys):
        raise ValueError(f"operator_keys must be among api_keys ({env_name('api_keys')}), as digests")
    if not {entry.partition(" ")[0] for entry in settings.key_tiers} <= set(settings.api_keys):
        raise ValueError(f"key_tiers must name keys among api_keys ({env_name('api_keys')}), as digests")


def _check_sharing(settings: GatewaySettings) -> None:
    """Deterministic models among the served ones, public ones among those; a finite cache TTL."""
    served = set(settings.models)
    for name, listed, among in (
        ("deterministic_models", settings.deterministic_models, served),
        ("public_models", settings.public_models, set(settings.deterministic_models)),
    ):
        if unknown := [model for model in listed if model not in among]:
            where = "models" if among is served else "deterministic_models"
            raise ValueError(
                f"{name} ({env_name(name)}) names {', '.join(unknown)}, not among {where} ({env_name(where)})"
            )
    if not 0 <= settings.cache_ttl_s < float("inf"):
        raise ValueError(
            f"cache_ttl_s ({env_name('cache_ttl_s')}) is {settings.cache_ttl_s}; it must be a finite number "
            "of seconds, 0 to turn the cache off"
        )
    if settings.cache_ttl_s > 0 and not settings.deterministic_models:
        # The cache keeps a deterministic model's answers only: without one it would be on in name alone.
        raise ValueError(
            f"cache_ttl_s ({env_name('cache_ttl_s')}) is {settings.cache_ttl_s}, but no model is deterministic "
            f"({env_name('deterministic_models')}), and only their answers are cached: name them, or set 0"
        )
