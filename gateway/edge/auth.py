"""Optional API keys: ``Authorization: Bearer <key>`` on every route but the probes and the API docs.

Only sha256 digests of the keys are held (the CLI hashes keys given as text, or takes digests as
``sha256:<hex>`` so that plain keys need not be stored anywhere). A presented key is hashed and
compared with every digest in constant time. A key's *owner* (the first 16 hex digits of its
digest) is what tasks are stored under: a task is visible only to the key that created it.

An entry may end with ``priority=<tier>`` (the tier its requests get without asking) and
``ceiling=<tier>`` (the highest they may ask for; above it, 403 ``priority_above_ceiling``), in
either order: ``gateway.admission.priority``. Without ``priority=`` the default is normal, or the ceiling if
that is lower.

Keys are of two classes. A *tenant* key (an entry as it is) uses the API. An *operator* key (an
entry written ``operator <key>``) also reads the deployment-wide ``OPERATOR_PATHS`` (``/metrics``,
``/v1/fleet``, ``/dashboard/events``), which a tenant key is refused with 403 ``forbidden``: they show
every tenant's traffic.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.admission.priority import KeyTiers, tier_named
from gateway.edge.handlers import error_response
from gateway.errors import shown
from gateway.settings import env_name
from schemas.records import Priority

# Open without a key: liveness and readiness probes (load balancers hold no keys), the API's own
# description, and the dashboard's page (code only: the figures it shows come from
# /dashboard/events, which its script reads with the key). /metrics is protected: Prometheus sends
# a bearer token (``authorization``).
OPEN_PATHS = frozenset(
    {"/healthz", "/readyz", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc", "/dashboard"}
)
# Deployment-wide views: with API keys on, only an operator key reads them.
OPERATOR_PATHS = frozenset({"/metrics", "/v1/fleet", "/dashboard/events"})
OPERATOR = "operator"
OWNER_HEX = 16
_MIN_KEY_CHARS = 16
_HEX = re.compile(r"[0-9a-fA-F]{64}")
_PREFIX = "sha256:"


@dataclass(frozen=True, slots=True)
class LoadedKeys:
    """The accepted keys as sha256 hex digests, and which of them are operator keys."""

    digests: tuple[str, ...] = ()
    operators: tuple[str, ...] = ()
    tiers: tuple[str, ...] = ()
    """``KeyTiers.encode`` of each key the entries give tiers."""


@dataclass(frozen=True, slots=True)
class KeyHolder:
    """Who presented an accepted key: the owner id its tasks are stored under, and its class."""

    owner: str
    operator: bool
    tiers: KeyTiers | None = None


def digest_of(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def owner_of(digest: str) -> str:
    """The owner id stored with tasks: enough of the digest to tell keys apart, never the key."""
    return digest[:OWNER_HEX]


def load_api_keys(keys: str | None, keys_file: str | None) -> LoadedKeys:
    """Digests of the keys in ``keys`` (comma-separated) and ``keys_file`` (one a line, ``#`` comments).

    Each entry is a key (at least 16 characters, no spaces) or ``sha256:<64 hex digits>``, either
    one after ``operator `` for an operator key. A key listed twice with other options is refused:
    which entry wins would be a guess. Error messages name the entry by position, never by value.
    """
    entries: list[tuple[str, str]] = []
    if keys:
        entries.extend((f"entry {n} of {env_name('api_keys')}", e) for n, e in enumerate(keys.split(","), 1))
    if keys_file:
        try:
            text = Path(keys_file).read_text()
        except OSError as err:
            raise ValueError(f"cannot read {env_name('api_keys_file')} {keys_file}: {err.strerror}") from err
        except UnicodeDecodeError as err:  # the bytes are not shown: they may be a key
            raise ValueError(f"{env_name('api_keys_file')} {keys_file} is not UTF-8 text") from err
        entries.extend((f"line {n} of {keys_file}", line) for n, line in enumerate(text.splitlines(), 1))
    digests: list[str] = []
    operators: list[str] = []
    tiers: dict[str, KeyTiers] = {}
    first: dict[str, tuple[str, bool, KeyTiers]] = {}
    for where, raw in entries:
        entry = raw.strip()
        if not entry or entry.startswith("#"):
            continue
        words, key_tiers = _tier_options(where, entry.split())
        entry = " ".join(words)
        if len(words) == 2 and words[0] == OPERATOR:
            digest = _digest_of_entry(where, words[1])
            operators.append(digest)
        elif len(words) == 1:
            digest = _digest_of_entry(where, entry)
        else:
            raise ValueError(
                f"{where}: an entry is one key (no spaces) or sha256:<hex>, or '{OPERATOR} ' and one of them, "
                "then optionally priority=<tier> and ceiling=<tier>"
            )
        options = (len(words) == 2, key_tiers or KeyTiers())
        seen = first.setdefault(digest, (where, *options))
        if seen[1:] != options:
            raise ValueError(
                f"{where}: the same key as {seen[0]}, with other options (operator, priority=, ceiling=); "
                "list each key once"
            )
        digests.append(digest)
        if key_tiers is not None:
            tiers[digest] = key_tiers
    if (keys or keys_file) and not digests:
        # An empty file (a secret that was not mounted) must not turn authentication off unnoticed.
        given = f"{env_name('api_keys_file')} {keys_file}" if keys_file else env_name("api_keys")
        raise ValueError(
            f"{given} holds no API key, and the gateway would take requests without one: add keys, or unset "
            f"{env_name('api_keys')} and {env_name('api_keys_file')} to run without keys"
        )
    encoded = tuple(t.encode(digest) for digest, t in tiers.items())
    return LoadedKeys(tuple(dict.fromkeys(digests)), tuple(dict.fromkeys(operators)), encoded)


_TIER_OPTIONS = ("priority=", "ceiling=")


def _tier_options(where: str, words: list[str]) -> tuple[list[str], KeyTiers | None]:
    """An entry's words without its ``priority=`` and ``ceiling=`` options, and the tiers they give."""
    options = {w.partition("=")[0]: w.partition("=")[2] for w in words if w.startswith(_TIER_OPTIONS)}
    rest = [w for w in words if not w.startswith(_TIER_OPTIONS)]
    if not options:
        return rest, None
    ceiling = tier_named(options.get("ceiling", "high"), where)
    lowest_default = ceiling if ceiling.rank > Priority.NORMAL.rank else Priority.NORMAL
    default = tier_named(options["priority"], where) if "priority" in options else lowest_default
    try:
        return rest, KeyTiers(default, ceiling)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def _digest_of_entry(where: str, entry: str) -> str:
    if entry.startswith(_PREFIX):
        hexdigest = entry[len(_PREFIX) :]
        if not _HEX.fullmatch(hexdigest):
            raise ValueError(f"{where}: after 'sha256:' come the 64 hex digits of the key's sha256")
        return hexdigest.lower()
    if len(entry) < _MIN_KEY_CHARS:
        raise ValueError(f"{where}: an API key must have at least {_MIN_KEY_CHARS} characters")
    if not (entry.isascii() and entry.isprintable()):
        # A client sends the key's bytes in the header, which the server reads as Latin-1: no other
        # character could ever match.
        raise ValueError(f"{where}: an API key is printable ASCII (a bearer token); this one has other characters")
    return digest_of(entry)


class ApiKeys:
    """The accepted keys, as digests, each marked tenant or operator."""

    def __init__(self, digests: tuple[str, ...], operators: tuple[str, ...] = (), tiers: tuple[str, ...] = ()) -> None:
        if not digests:
            raise ValueError("ApiKeys needs at least one digest")
        if not set(operators) <= set(digests):
            raise ValueError("every operator digest must be among the accepted digests")
        marked = set(operators)
        self._digests = [(bytes.fromhex(digest), digest in marked) for digest in digests]
        self._tiers = dict(KeyTiers.decode(entry) for entry in tiers)

    def holder(self, authorization: str | None) -> KeyHolder | None:
        """Who holds the key in an ``Authorization`` header value, or None if it is not accepted."""
        if authorization is None:
            return None
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        presented = hashlib.sha256(key.strip().encode()).digest()
        found = operator = False
        for digest, is_operator in self._digests:  # no early exit: the time taken does not say which key matched
            matched = hmac.compare_digest(presented, digest)
            found |= matched
            operator |= matched and is_operator
        if not found:
            return None
        return KeyHolder(owner_of(presented.hex()), operator, self._tiers.get(presented.hex()))


class AuthMiddleware:
    """Answers 401 ``unauthorized`` without an accepted key, and 403 ``forbidden`` to a tenant key on
    ``OPERATOR_PATHS``; else hands the owner on in ``scope["state"]["owner"]`` (``request.state.owner``)."""

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = [value for name, value in scope["headers"] if name == b"authorization"]
        if len(given) > 1:
            # A singleton header (RFC 9110): which key would speak depends on the order, which a proxy
            # that appends its own header instead of replacing the client's leaves to the client.
            message = f"this request has {len(given)} Authorization headers; send one Authorization header"
            challenge = 'Bearer realm="batchwire"'  # RFC 6750's error="invalid_request" goes with a 400
            await error_response(401, "unauthorized", message, headers={"WWW-Authenticate": challenge})(
                scope, receive, send
            )
            return
        authorization = given[0].decode("latin-1") if given else None
        holder = self.keys.holder(authorization)
        if holder is None:
            challenge = 'Bearer realm="batchwire"' + ("" if authorization is None else ', error="invalid_token"')
            message = (
                "this gateway needs an API key: send 'Authorization: Bearer <key>'"
                if authorization is None
                else "the API key in the Authorization header is not accepted here"
            )
            response = error_response(401, "unauthorized", message, headers={"WWW-Authenticate": challenge})
            await response(scope, receive, send)
            return
        if not holder.operator and _normalized(scope["path"]) in OPERATOR_PATHS:
            message = (
                f"{shown(scope['path'])} shows the whole deployment and needs an operator key; this is a tenant key. "
                f"Mark an operator's key as '{OPERATOR} <key>' in {env_name('api_keys_file')} or {env_name('api_keys')}"
            )
            await error_response(403, "forbidden", message)(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["owner"] = holder.owner
        if holder.tiers is not None:
            state["tiers"] = holder.tiers
        await self.app(scope, receive, send)


def _normalized(path: str) -> str:
    """``path`` without repeated or trailing slashes, so that no spelling of an operator path gets past."""
    return "/" + "/".join(part for part in path.split("/") if part)
