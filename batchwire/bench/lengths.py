"""Inputs of log-normal lengths in words: ``--lengths 16:256`` gives a median of 16 words and a 99th
percentile of 256, the spread of real prompts and documents (most short, a few long), which is what
makes padding costly and a token budget worth having (docs/operations.md, the token budget).

Each word is a common English word of one WordPiece or BPE token in most vocabularies, so a length
in words is close to a length in tokens for real tokenizers (a byte-level one counts the letters).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from batchwire.bench.schedule import InputFactory

_WORD_LIST = (
    "the of and to in is was for on that with as by at from his it an were are which this be or has had "
    "one first their its new after who they two her she been other when there all during into school time "
    "may years more most only over city some world would where later up such used many can state about "
    "national out known university united then made"
)
WORDS = tuple(_WORD_LIST.split())
"""Words of one token in BERT's and GPT-2's vocabularies alike."""

Z99 = 2.3263478740408408
"""The standard normal's 99th percentile."""


@dataclass(frozen=True, slots=True)
class Lengths:
    median: int
    p99: int

    @classmethod
    def parse(cls, text: str) -> Lengths:
        """``MEDIAN:P99`` as given to ``--lengths``."""
        median, sep, p99 = text.partition(":")
        try:
            lengths = cls(int(median), int(p99))
        except ValueError:
            lengths = None
        if not sep or lengths is None or not 1 <= lengths.median <= lengths.p99:
            raise ValueError(
                f"--lengths takes MEDIAN:P99 in words with 1 <= MEDIAN <= P99, such as 16:256; got {text!r}"
            )
        return lengths

    @property
    def sigma(self) -> float:
        return math.log(self.p99 / self.median) / Z99


class LengthInputs(InputFactory):
    """An ``InputFactory`` whose inputs are ``<nonce><counter>.`` and a log-normal number of words,
    at most 1.5 times the 99th percentile (a few in a thousand are cut to it)."""

    def __init__(self, lengths: Lengths, rng: random.Random, field: str = "input", nonce: str = "") -> None:
        super().__init__(0, rng, field=field, nonce=nonce)
        self._lengths = lengths
        self._mu = math.log(lengths.median)

    def next(self) -> tuple[str, bytes]:
        head, _ = InputFactory.next(self)
        drawn = round(self._rng.lognormvariate(self._mu, self._lengths.sigma))
        count = min(3 * self._lengths.p99 // 2, max(1, drawn))
        text = head + " " + " ".join(self._rng.choices(WORDS, k=count))
        return text, self._prefix + text.encode() + self._suffix
