"""Readiness checks that answer, whatever the part being checked does."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

log = logging.getLogger(__name__)


async def probe(check: Awaitable[bool], timeout_s: float, part: str) -> bool:
    """``check``'s answer, or False (logged) when it raises or takes over ``timeout_s``: a sick
    dependency must turn /readyz red, not hang it or turn it into a 500."""
    try:
        async with asyncio.timeout(timeout_s):
            return bool(await check)
    except TimeoutError:
        log.warning("readiness check of %s took over %s s", part, timeout_s)
    except Exception:
        log.warning("readiness check of %s failed", part, exc_info=True)
    return False
