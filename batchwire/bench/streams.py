"""The streams of a ``batchwire bench --mix``: parsing only, cheap to import (the CLI parses with it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

TIERS = ("high", "normal", "low")


@dataclass(frozen=True, slots=True)
class Stream:
    """One kind of request in a mix: its model (None: the default), tier and offered rate."""

    model: str | None
    tier: str
    rate_rps: float

    @property
    def name(self) -> str:
        return f"{self.model}/{self.tier}" if self.model else self.tier


def parse_mix(text: str) -> list[Stream]:
    """``high:200,low:6000`` or ``a/normal:6000,b/normal:1000`` as streams; ValueError says what is wrong."""
    streams: list[Stream] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        head, sep, rate = part.rpartition(":")
        model, _, tier = head.rpartition("/")
        if not sep or tier not in TIERS:
            raise ValueError(f"a mix stream is [model/]tier:rate with tier one of {', '.join(TIERS)}; got {part!r}")
        try:
            rate_rps = float(rate)
        except ValueError:
            raise ValueError(f"the rate of {part!r} is not a number") from None
        if rate_rps <= 0:
            raise ValueError(f"the rate of {part!r} must be above 0")
        streams.append(Stream(model or None, tier, rate_rps))
    if not streams:
        raise ValueError(f"a mix needs at least one stream, got {text!r}")
    return streams


def mix_models(mixes: Sequence[Sequence[Stream]]) -> tuple[str, ...]:
    """The models the mixes name, in order of first mention (empty: the default model only)."""
    return tuple(dict.fromkeys(s.model for mix in mixes for s in mix if s.model is not None))
