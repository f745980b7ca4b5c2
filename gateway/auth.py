"""Optional API keys: ``Authorization: Bearer <key>`` on every route but the probes and the API docs.

Only sha256 digests of the keys are held (the CLI hashes keys given as text, or takes digests as
``sha256:<hex>`` so that plain keys need not be stored anywhere). A presented key is hashed and
compared with every digest in constant time. A key's *owner* (the first 16 hex digits of its
digest) is what tasks are stored under: a task is visible only to the key that created it.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.handlers import error_response
from gateway.settings import env_name

# Open without a key: liveness and readiness probes (load balancers hold no keys) and the API's
# own description. /metrics is protected: Prometheus sends a bearer token (``authorization``).
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
OWNER_HEX = 16
_MIN_KEY_CHARS = 16
_HEX = re.compile(r"[0-9a-fA-F]{64}")
_PREFIX = "sha256:"


def digest_of(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def owner_of(digest: str) -> str:
    """The owner id stored with tasks: enough of the digest to tell keys apart, never the key."""
    return digest[:OWNER_HEX]


def load_api_keys(keys: str | None, keys_file: str | None) -> tuple[str, ...]:
    """Digests of the keys in ``keys`` (comma-separated) and ``keys_file`` (one a line, ``#`` comments).

    Each entry is a key (at least 16 characters) or ``sha256:<64 hex digits>``. Error messages
    name the entry by position, never by value.
    """
    entries: list[tuple[str, str]] = []
    if keys:
        entries.extend((f"entry {n} of {env_name('api_keys')}", e) for n, e in enumerate(keys.split(","), 1))
    if keys_file:
        try:
            text = Path(keys_file).read_text()
        except OSError as err:
            raise ValueError(f"cannot read {env_name('api_keys_file')} {keys_file}: {err.strerror}") from err
        entries.extend((f"line {n} of {keys_file}", line) for n, line in enumerate(text.splitlines(), 1))
    digests: list[str] = []
    for where, raw in entries:
        entry = raw.strip()
        if not entry or entry.startswith("#"):
            continue
        if entry.startswith(_PREFIX):
            hexdigest = entry[len(_PREFIX) :]
            if not _HEX.fullmatch(hexdigest):
                raise ValueError(f"{where}: after 'sha256:' come the 64 hex digits of the key's sha256")
            digests.append(hexdigest.lower())
        elif len(entry) < _MIN_KEY_CHARS:
            raise ValueError(f"{where}: an API key must have at least {_MIN_KEY_CHARS} characters")
        else:
            digests.append(digest_of(entry))
    return tuple(dict.fromkeys(digests))


class ApiKeys:
    """The accepted keys, as digests."""

    def __init__(self, digests: tuple[str, ...]) -> None:
        if not digests:
            raise ValueError("ApiKeys needs at least one digest")
        self._digests = [bytes.fromhex(digest) for digest in digests]

    def owner(self, authorization: str | None) -> str | None:
        """The owner of the key in an ``Authorization`` header value, or None if it is not accepted."""
        if authorization is None:
            return None
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        presented = hashlib.sha256(key.strip().encode()).digest()
        found = False
        for digest in self._digests:  # no early exit: the time taken does not say which key matched
            found |= hmac.compare_digest(presented, digest)
        return owner_of(presented.hex()) if found else None


class AuthMiddleware:
    """Answers 401 ``unauthorized`` without an accepted key; else hands the owner on in
    ``scope["state"]["owner"]`` (``request.state.owner``)."""

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        authorization: str | None = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
                break
        owner = self.keys.owner(authorization)
        if owner is None:
            challenge = 'Bearer realm="batchwire"' + ("" if authorization is None else ', error="invalid_token"')
            message = (
                "this gateway needs an API key: send 'Authorization: Bearer <key>'"
                if authorization is None
                else "the API key in the Authorization header is not accepted here"
            )
            response = error_response(401, "unauthorized", message, headers={"WWW-Authenticate": challenge})
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})["owner"] = owner
        await self.app(scope, receive, send)
