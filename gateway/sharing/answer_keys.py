"""Which requests may share an answer, and the key they share it under.

Two requests share an answer (a cached one, or one computation while both are in flight) only when
they ask a deterministic model the same input within the same scope. The scope is the API key's
owner, so one tenant never receives, nor can time, an answer computed for another; an operator may
declare a model's answers public, and then every caller shares them. Without API keys every caller
is in one scope.
"""

from __future__ import annotations

import hashlib

from gateway.settings import GatewaySettings

KEY_VERSION = "v1"
"""Changes when what a key covers changes, so that old entries are never read under new rules."""

PUBLIC_SCOPE = "public"
ANONYMOUS_SCOPE = "anonymous"


def answer_key(scope: str, model: str, input: str) -> str:
    """A fixed-size key for (scope, model, input): sha256 over the length-prefixed parts, so no two
    different triples share one (``"a|b", "c"`` and ``"a", "b|c"`` differ)."""
    digest = hashlib.sha256()
    for part in (KEY_VERSION, scope, model, input):
        raw = part.encode()
        digest.update(len(raw).to_bytes(8, "big"))
        digest.update(raw)
    return digest.hexdigest()


class AnswerKeys:
    """The sharing rule of one gateway's settings: ``key`` is None for a request that never shares."""

    def __init__(self, settings: GatewaySettings) -> None:
        self._deterministic = frozenset(settings.deterministic_models)
        self._public = frozenset(settings.public_models)

    @property
    def active(self) -> bool:
        """Whether any served model shares answers at all."""
        return bool(self._deterministic)

    def scope(self, owner: str | None, model: str) -> str:
        """``public`` for a public model, else the owner (one scope for every caller without keys)."""
        if model in self._public:
            return PUBLIC_SCOPE
        return f"owner:{owner}" if owner is not None else ANONYMOUS_SCOPE

    def key(self, owner: str | None, model: str, input: str) -> str | None:
        """The key this request shares its answer under, or None when its model is not deterministic."""
        if model not in self._deterministic:
            return None
        return answer_key(self.scope(owner, model), model, input)
