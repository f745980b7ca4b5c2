"""The curve file: a backend's call latency by batch size (p50 and p99), as JSON.

``batchwire profile`` writes it; ``simulate`` and ``plan`` read it. Between measured sizes the
latency is interpolated linearly; sizes are bounded by the largest one measured (the max batch).
A model's call also grows with its inputs' length, so an hf profile adds one curve per input
length in tokens (``by_tokens``); ``Curve.at_tokens`` gives the curve for the traffic's length.
"""

from __future__ import annotations

import itertools
import json
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CURVE_VERSION = 1
NOT_MONOTONE_TOLERANCE = 0.02
"""A larger batch faster than a smaller one by less than this share of its latency is timer noise."""


class CurveError(ValueError):
    """The curve file cannot be used; the message says what to fix."""


class CurveWarning(UserWarning):
    """The curve is usable but suspicious (a larger batch that is faster than a smaller one)."""


@dataclass(frozen=True, slots=True)
class CurvePoint:
    size: int
    p50_ms: float
    p99_ms: float


@dataclass(frozen=True, slots=True)
class TokenCurve:
    """The call latency by batch size with every input ``tokens`` long (special tokens included)."""

    tokens: int
    points: tuple[CurvePoint, ...]


@dataclass(frozen=True, slots=True)
class Curve:
    """Latency of one backend call by batch size, sorted by size; ``by_tokens`` by input length too."""

    points: tuple[CurvePoint, ...]
    backend: str = "unknown"
    meta: Mapping[str, Any] = field(default_factory=dict)
    by_tokens: tuple[TokenCurve, ...] = ()

    def __post_init__(self) -> None:
        if not self.points:
            raise CurveError("the curve has no points: it needs at least one {size, p50_ms, p99_ms}")
        lengths = [t.tokens for t in self.by_tokens]
        if lengths != sorted(set(lengths)) or (lengths and lengths[0] < 1):
            raise CurveError(f"by_tokens lengths must be distinct, ascending and at least 1, got {lengths}")
        sizes = [p.size for p in self.points]
        if sizes != sorted(set(sizes)):
            raise CurveError(f"curve sizes must be distinct and ascending, got {sizes}")
        for point in self.points:
            if point.size < 1 or not point.p50_ms > 0 or point.p99_ms < point.p50_ms:
                raise CurveError(f"bad curve point {point}: size >= 1, p50_ms > 0 and p99_ms >= p50_ms are required")
        for before, after in itertools.pairwise(self.points):
            if after.p50_ms < before.p50_ms * (1 - NOT_MONOTONE_TOLERANCE):
                warnings.warn(
                    f"curve is not monotone in size: {after.size} items take {after.p50_ms} ms, "
                    f"{before.size} take {before.p50_ms} ms; using it as measured",
                    CurveWarning,
                    stacklevel=3,
                )
                break

    @classmethod
    def flat(cls, latency_ms: float, max_batch: int, backend: str = "sim") -> Curve:
        """A backend that takes ``latency_ms`` for any batch of 1 to ``max_batch`` (like the sim backend)."""
        sizes = sorted({1, max_batch})
        return cls(tuple(CurvePoint(s, latency_ms, latency_ms) for s in sizes), backend)

    @property
    def max_batch(self) -> int:
        return self.points[-1].size

    def latency_ms(self, size: int, quantile: str = "p50") -> float:
        """The call latency for ``size`` items, interpolated between measured sizes.

        Below the smallest size measured the smallest's latency applies; above the largest, an error.
        """
        if size > self.max_batch:
            raise CurveError(f"batch of {size} is above the curve's max batch {self.max_batch}")
        points = self.points
        values = [p.p99_ms if quantile == "p99" else p.p50_ms for p in points]
        if size <= points[0].size:
            return values[0]
        for (low, low_ms), (high, high_ms) in itertools.pairwise(zip(points, values, strict=True)):
            if size <= high.size:
                return low_ms + (size - low.size) / (high.size - low.size) * (high_ms - low_ms)
        return values[-1]

    def at_tokens(self, tokens: int) -> Curve:
        """The curve for inputs ``tokens`` long, interpolated linearly between the lengths profiled.

        Below the shortest length profiled the shortest applies (a call has a floor); above the
        longest, an error: a longer input's cost is not known.
        """
        if not self.by_tokens:
            raise CurveError(
                "the curve was profiled at one input length only; "
                "run batchwire profile --lengths N1,N2,... on an hf model to use --tokens"
            )
        if tokens > self.by_tokens[-1].tokens:
            raise CurveError(
                f"inputs of {tokens} tokens are longer than the curve's longest ({self.by_tokens[-1].tokens}); "
                f"profile with --lengths up to {tokens}"
            )
        high = next(t for t in self.by_tokens if t.tokens >= tokens)
        low = max((t for t in self.by_tokens if t.tokens <= tokens), key=lambda t: t.tokens, default=high)
        below, above = Curve(low.points, self.backend), Curve(high.points, self.backend)
        share = 0.0 if high.tokens == low.tokens else (tokens - low.tokens) / (high.tokens - low.tokens)
        largest = min(below.max_batch, above.max_batch)
        sizes = sorted({p.size for p in (*low.points, *high.points) if p.size <= largest})

        def mix(size: int, quantile: str) -> float:
            near, far = below.latency_ms(size, quantile), above.latency_ms(size, quantile)
            return round(near + share * (far - near), 3)

        points = tuple(CurvePoint(s, mix(s, "p50"), max(mix(s, "p99"), mix(s, "p50"))) for s in sizes)
        return Curve(points, self.backend, {**self.meta, "input_tokens": tokens}, self.by_tokens)

    def best_rate_per_worker(self, max_batch: int | None = None) -> tuple[float, int]:
        """The most requests/s one worker can serve (full batches back to back), and at which size; batches
        of at most ``max_batch`` when given (a policy's smaller max batch)."""
        top = self.max_batch if max_batch is None else min(max_batch, self.max_batch)
        best = max(range(1, top + 1), key=lambda s: s / self.latency_ms(s))
        return best * 1000.0 / self.latency_ms(best), best

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "version": CURVE_VERSION,
            "backend": self.backend,
            "meta": dict(self.meta),
            "points": _points_json(self.points),
        }
        if self.by_tokens:
            data["by_tokens"] = [{"tokens": t.tokens, "points": _points_json(t.points)} for t in self.by_tokens]
        return data

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")


def _points_json(points: Sequence[CurvePoint]) -> list[dict[str, Any]]:
    return [{"size": p.size, "p50_ms": p.p50_ms, "p99_ms": p.p99_ms} for p in points]


def from_json(data: Any) -> Curve:
    """A curve from its JSON object; raises ``CurveError`` naming what is missing or wrong."""
    if not isinstance(data, dict) or not isinstance(data.get("points"), list):
        raise CurveError('a curve is a JSON object with a "points" list of {size, p50_ms, p99_ms}')
    by_tokens: list[TokenCurve] = []
    for raw in data.get("by_tokens") or []:
        if not isinstance(raw, dict) or not isinstance(raw.get("points"), list):
            raise CurveError(f'bad by_tokens entry {raw!r}: it needs "tokens" and a "points" list')
        try:
            tokens = _count(raw["tokens"])
        except (KeyError, TypeError, ValueError) as err:
            raise CurveError(
                f'bad by_tokens entry: "tokens" must be a whole number, got {raw.get("tokens")!r}'
            ) from err
        by_tokens.append(TokenCurve(tokens, from_json({"points": raw["points"]}).points))  # checked as a curve
    meta = data.get("meta") if isinstance(data.get("meta"), dict) else {}
    by_length = tuple(sorted(by_tokens, key=lambda t: t.tokens))
    return Curve(_points_from(data["points"]), str(data.get("backend", "unknown")), meta or {}, by_length)


def _points_from(raws: list[Any]) -> tuple[CurvePoint, ...]:
    points: list[CurvePoint] = []
    for raw in raws:
        try:
            p50 = float(raw["p50_ms"])
            p99 = float(raw.get("p99_ms", p50))
            point = CurvePoint(_count(raw["size"]), p50, p99)
        except (KeyError, TypeError, ValueError) as err:
            raise CurveError(
                f"bad curve point {raw!r}: it needs size and p50_ms (and p99_ms), the size a whole number"
            ) from err
        if not (math.isfinite(point.p50_ms) and math.isfinite(point.p99_ms)):
            raise CurveError(f"bad curve point {raw!r}: latencies must be finite")
        points.append(point)
    return tuple(sorted(points, key=lambda p: p.size))


def _count(value: Any) -> int:
    """A whole number from JSON: ``int`` alone would read 1.7 items or tokens as 1."""
    count = int(value)
    if count != float(value):
        raise ValueError(f"{value!r} is not a whole number")
    return count


def load(path: str | Path) -> Curve:
    """Reads a curve file written by ``batchwire profile`` (or by hand)."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise CurveError(f"cannot read the curve file {path}: {err.strerror}") from err
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise CurveError(f"the curve file {path} is not JSON: {err}") from err
    return from_json(data)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q`` (0..1) quantile of already sorted values, nearest rank."""
    if not sorted_values:
        return math.nan
    rank = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[rank]
