"""What to send and when: a precomputed Poisson schedule and unique request inputs.

The schedule is computed before the first send so the hot loop only compares clocks; inputs are
unique per request so no cache or de-duplication in the server under test can flatter the numbers.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Mapping


def poisson_offsets(rate_rps: float, duration_s: float, rng: random.Random) -> list[float]:
    """Send times in seconds from the start, with exponential gaps of mean ``1 / rate_rps``.

    Poisson arrivals are what independent users produce; a fixed interval would understate
    queueing because bursts never happen.
    """
    if rate_rps <= 0:
        raise ValueError(f"rate must be above 0 req/s, got {rate_rps}")
    if duration_s <= 0:
        return []
    offsets: list[float] = []
    append = offsets.append
    expovariate = rng.expovariate
    t = expovariate(rate_rps)
    while t < duration_s:
        append(t)
        t += expovariate(rate_rps)
    return offsets


_ALPHABET = string.ascii_letters + string.digits
_POOL_CHARS = 1 << 16


class InputFactory:
    """Builds unique inputs of about ``size`` characters and their JSON request bodies.

    Each input is ``<run nonce><counter>.`` followed by random filler cut from a pre-drawn pool,
    which costs a slice per request instead of ``size`` random draws.
    """

    def __init__(
        self,
        size: int,
        rng: random.Random,
        field: str = "input",
        nonce: str = "",
        extra: Mapping[str, str] | None = None,
    ) -> None:
        """``extra``: more string fields every body carries (a mix's ``model`` and ``priority``)."""
        if size < 0:
            raise ValueError(f"input size must be 0 or more characters, got {size}")
        self.size = size
        self._rng = rng
        self._nonce = nonce
        self._counter = 0
        pool_len = max(_POOL_CHARS, 2 * size)
        self._pool = "".join(rng.choices(_ALPHABET, k=pool_len))
        # The filler is ASCII letters and digits, so only the field name needs JSON escaping.
        self._prefix = b"{" + json.dumps(field).encode() + b':"'
        fields = b"".join(
            b"," + json.dumps(k).encode() + b":" + json.dumps(v).encode() for k, v in (extra or {}).items()
        )
        self._suffix = b'"' + fields + b"}"

    def next(self) -> tuple[str, bytes]:
        """The next input text and the request body that carries it."""
        self._counter += 1
        head = f"{self._nonce}{self._counter:x}."
        fill = self.size - len(head)
        if fill > 0:
            start = self._rng.randrange(len(self._pool) - fill)
            text = head + self._pool[start : start + fill]
        else:
            text = head
        return text, self._prefix + text.encode() + self._suffix
