"""Reads of the request topic paced while every worker is busy, caught up before each seal.

Over Kafka every read is a fetch round trip that costs the batcher (and the broker) CPU whatever it
carries; read as records arrive, a fetch carries a few. While every worker is busy, a request waits
for a credit whatever the batcher does, and where it waits (on the broker or in the batcher) does
not matter until a batch is sealed: so the consume loop reads at most every ``pace_s`` then, and a
dispatcher that gets a credit first catches up (``catch_up``) so that everything produced before
the credit came goes into the batch, as if it had been read all along (its cost and gain:
``docs/performance.md``).
"""

from __future__ import annotations

import asyncio
import contextlib

CATCH_UP_READS = 2
"""The first read after a pause returns what the client fetched early in the pause (it fetches no
more while that waits); the second one's fetch left after the first returned, so it holds
everything produced up to about then."""


class ReadPacing:
    """The consume loop's pauses between reads, and the dispatchers' catch-ups that end them."""

    def __init__(self, pace_s: float) -> None:
        self.pace_s = pace_s
        self.reads = 0
        self.pauses = 0
        """Pauses so far: a dispatcher compares counts to learn whether reads paused during its claim."""
        self._catching_up = 0
        self._resume = asyncio.Event()
        self._read = asyncio.Event()

    async def after_read(self, all_busy: bool) -> None:
        """Called by the consume loop after each read; pauses up to ``pace_s`` while ``all_busy``
        (every worker busy: each model's dispatcher waits for a credit) and nobody catches up."""
        self.reads += 1
        if self._catching_up:  # wake the catch-ups (no event is made per read otherwise)
            read, self._read = self._read, asyncio.Event()
            read.set()
        if self.pace_s <= 0 or not all_busy or self._catching_up:
            return
        self.pauses += 1
        self._resume.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.pace_s):
                await self._resume.wait()

    async def catch_up(self, pauses_before: int, limit_s: float) -> None:
        """Returns once the reads caught up, if they paused since ``pauses`` read ``pauses_before``;
        waits at most ``limit_s`` (a read can block: no record may be coming)."""
        if self.pauses == pauses_before:
            return  # read continuously: every record produced is in the batcher already
        self._catching_up += 1
        self._resume.set()
        target = self.reads + CATCH_UP_READS
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(limit_s):
                    while self.reads < target:
                        await self._read.wait()
        finally:
            self._catching_up -= 1
