"""HDR histograms of durations, recorded in microseconds and summarised in milliseconds.

An HDR histogram keeps every percentile to 3 significant digits from 1 µs to 120 s in fixed
memory, so the tail (p99.9, max) is exact enough to publish, unlike averaged or sampled timings.
"""

from __future__ import annotations

from typing import Any

from hdrh.histogram import HdrHistogram

LOWEST_US = 1
HIGHEST_US = 120_000_000
SIGNIFICANT_DIGITS = 3

#: Percentiles every summary carries, keyed as they appear in results.json and the tables.
PERCENTILES: tuple[tuple[str, float], ...] = (
    ("p50", 50.0),
    ("p90", 90.0),
    ("p95", 95.0),
    ("p99", 99.0),
    ("p99.9", 99.9),
    ("p99.99", 99.99),
)


class DurationHistogram:
    """Durations in seconds in, millisecond percentiles out."""

    def __init__(self) -> None:
        self._hist: Any = HdrHistogram(LOWEST_US, HIGHEST_US, SIGNIFICANT_DIGITS)
        self._record = self._hist.record_value
        self.clamped = 0

    def record_s(self, seconds: float) -> None:
        """Records one duration; negative values (clock jitter) count as 0, overlong ones as 120 s."""
        micros = int(seconds * 1_000_000)
        if micros < 0:
            micros = 0
        elif micros > HIGHEST_US:
            micros = HIGHEST_US
            self.clamped += 1
        self._record(micros)

    @property
    def count(self) -> int:
        return int(self._hist.get_total_count())

    def value_ms(self, percentile: float) -> float:
        return float(self._hist.get_value_at_percentile(percentile)) / 1000.0

    def summary_ms(self) -> dict[str, float]:
        """count, mean, min, the standard percentiles and max, all durations in ms."""
        count = self.count
        out: dict[str, float] = {"count": float(count)}
        if count == 0:
            return out
        out["mean"] = round(float(self._hist.get_mean_value()) / 1000.0, 3)
        out["min"] = float(self._hist.get_min_value()) / 1000.0
        for key, percentile in PERCENTILES:
            out[key] = self.value_ms(percentile)
        out["max"] = float(self._hist.get_max_value()) / 1000.0
        return out

    def encode(self) -> str:
        """The whole histogram, compressed and base64 encoded (HdrHistogram's portable format)."""
        if self.count == 0:
            return ""
        encoded = self._hist.encode()
        return encoded.decode() if isinstance(encoded, bytes) else str(encoded)
