"""A request's priority tier: what it asks for, within what its API key allows.

A body may carry ``"priority"``: ``"high"``, ``"normal"`` or ``"low"``. Without one, the request
takes its API key's default tier (``normal`` without keys, or for a key the keys file gives none).
A key may also carry a *ceiling*: a request that asks for a tier above it is refused with 403
``priority_above_ceiling``, never silently lowered, so a caller learns at once that it did not get
what it asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.errors import InvalidPriority, PriorityAboveCeiling, shown
from gateway.settings import env_name
from schemas.records import Priority

TIER_NAMES = tuple(tier.value for tier in Priority)
"""``high``, ``normal``, ``low``: the names clients and checks rely on."""

_ALLOWED = ", ".join(f"'{name}'" for name in TIER_NAMES)


@dataclass(frozen=True, slots=True)
class KeyTiers:
    """An API key's tiers: what its requests get without asking, and the highest they may ask for."""

    default: Priority = Priority.NORMAL
    ceiling: Priority = Priority.HIGH

    def __post_init__(self) -> None:
        if self.default.rank < self.ceiling.rank:
            raise ValueError(f"a key's default tier ({self.default}) must not be above its ceiling ({self.ceiling})")

    def encode(self, digest: str) -> str:
        """The settings' form (``GatewaySettings.key_tiers``): ``<digest> <default> <ceiling>``."""
        return f"{digest} {self.default} {self.ceiling}"

    @staticmethod
    def decode(entry: str) -> tuple[str, KeyTiers]:
        digest, default, ceiling = entry.split()
        return digest, KeyTiers(Priority(default), Priority(ceiling))


NO_KEY = KeyTiers()


def tier_named(name: str, where: str) -> Priority:
    """``name`` as a tier, for the keys file: ``where`` names the entry in the error."""
    try:
        return Priority(name)
    except ValueError:
        raise ValueError(f"{where}: {name!r} is not a priority tier; the tiers are {_ALLOWED}") from None


def request_tier(asked: str | None, tiers: KeyTiers | None) -> Priority:
    """The tier a request runs at: the one it asks for, else its key's default.

    Raises ``InvalidPriority`` (422) for a name that is no tier and ``PriorityAboveCeiling`` (403)
    for a tier above its key's ceiling.
    """
    tiers = tiers or NO_KEY
    if asked is None:
        return tiers.default
    try:
        tier = Priority(asked)
    except ValueError:
        raise InvalidPriority(
            f"priority is {shown(asked)}; send one of {_ALLOWED}, or leave it out for {tiers.default.value!r}"
        ) from None
    if tier.rank < tiers.ceiling.rank:
        raise PriorityAboveCeiling(
            f"priority {shown(asked)} is above this API key's ceiling, {tiers.ceiling.value!r}; send "
            f"{tiers.ceiling.value!r} or lower, or leave it out for {tiers.default.value!r} (the operator sets a "
            f"key's tiers in {env_name('api_keys_file')})"
        )
    return tier
