"""Inputs drawn from a fixed set with Zipf popularity: the k-th most popular of ``distinct`` inputs
comes with probability proportional to 1 / k**s, as queries to a search box do.

Such load shows what request collapsing and the result cache save: every repeat of an input can be
answered without the GPU. ``--zipf 1000:1.1`` draws from 1,000 inputs with s = 1.1.
"""

from __future__ import annotations

import bisect
import itertools
import random
from dataclasses import dataclass

from batchwire.bench.schedule import InputFactory


@dataclass(frozen=True, slots=True)
class Zipf:
    distinct: int
    s: float

    @classmethod
    def parse(cls, text: str) -> Zipf:
        """``N:S`` as given to ``--zipf``."""
        count, sep, exponent = text.partition(":")
        try:
            zipf = cls(int(count), float(exponent))
        except ValueError:
            zipf = None
        if not sep or zipf is None or zipf.distinct < 1 or not zipf.s > 0:
            raise ValueError(f"--zipf takes DISTINCT:S with DISTINCT >= 1 and S > 0, such as 1000:1.1; got {text!r}")
        return zipf


class ZipfInputs(InputFactory):
    """An ``InputFactory`` whose inputs repeat: ``distinct`` unique inputs drawn by Zipf popularity."""

    def __init__(self, zipf: Zipf, size: int, rng: random.Random, field: str = "input", nonce: str = "") -> None:
        super().__init__(size, rng, field=field, nonce=nonce)
        self._choices = [InputFactory.next(self) for _ in range(zipf.distinct)]
        weights = (1.0 / rank**zipf.s for rank in range(1, zipf.distinct + 1))
        self._cumulative = list(itertools.accumulate(weights))
        self._draw = rng.random

    def next(self) -> tuple[str, bytes]:
        """An input of the set, the k-th with probability proportional to 1 / k**s."""
        total = self._cumulative[-1]
        return self._choices[bisect.bisect_left(self._cumulative, self._draw() * total)]
