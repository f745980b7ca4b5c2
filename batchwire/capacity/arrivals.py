"""Arrival processes for the simulation: Poisson at a rate (seeded), or a recorded trace."""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path


class TraceError(ValueError):
    """The trace file cannot be read as arrival timestamps."""


def poisson(rate: float, count: int, seed: int = 0) -> list[float]:
    """``count`` arrival times (seconds from 0) of a Poisson process at ``rate`` per second."""
    if rate <= 0 or count < 1:
        raise ValueError(f"a Poisson arrival process needs rate > 0 and count >= 1, got {rate} and {count}")
    draw = random.Random(seed).expovariate
    return list(itertools.accumulate(draw(rate) for _ in range(count)))


def load_trace(path: str | Path) -> list[float]:
    """Arrival timestamps in seconds: a JSON list, or one number a line; shifted to start at 0, sorted."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise TraceError(f"cannot read the trace {path}: {err.strerror}") from err
    try:
        raw = json.loads(text) if text.lstrip().startswith("[") else [float(x) for x in text.split()]
        times = [float(t) for t in raw]
    except (ValueError, TypeError) as err:
        raise TraceError(f"the trace {path} must hold timestamps in seconds (a JSON list or one a line)") from err
    if not all(math.isfinite(t) for t in times):
        raise TraceError(f"the trace {path} holds a timestamp that is not a finite number (NaN or an infinity)")
    times.sort()
    if not times:
        raise TraceError(f"the trace {path} holds no timestamps")
    return [t - times[0] for t in times]
