"""Readiness checks that answer, whatever the part being checked does, and say why a part is down."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Down:
    """A part that is not ready, as /readyz's 503 shows it: a state and a short reason."""

    state: Literal["down", "failing over"]
    reason: str


Ready = bool | Down
"""A part's readiness: True, False (down, nothing more known), or ``Down`` (down, and why)."""


async def probe(check: Awaitable[bool], timeout_s: float, part: str) -> bool:
    """``check``'s answer, or False (logged) when it raises or takes over ``timeout_s``: a sick
    dependency must turn /readyz red, not hang it or turn it into a 500."""
    try:
        async with asyncio.timeout(timeout_s):
            return bool(await check)
    except TimeoutError:
        log.warning("readiness check of %s took over %s s", part, timeout_s)
    except Exception as err:  # one line: a probe of a dependency that is down fails every few seconds
        log.warning("readiness check of %s failed: %s: %s", part, type(err).__name__, err)
    return False


def not_ready(checks: Mapping[str, Ready]) -> dict[str, Down]:
    """Each part that is not ready, with its state and reason (a bare False is plainly "down")."""
    return {
        part: check if isinstance(check, Down) else Down("down", "its readiness check failed")
        for part, check in checks.items()
        if check is not True
    }
