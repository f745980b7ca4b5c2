"""File descriptors for HTTP connections: how many the gateway may hold, within ``ulimit -n``.

Every open connection holds one descriptor, and a process that runs out can accept nothing, not
even to refuse: the cap on connections and the refusals that wait at it are sized here, against the
process's limit, with ``FD_RESERVE`` kept for everything else.
"""

from __future__ import annotations

import logging
import resource

from gateway.settings import env_name

log = logging.getLogger(__name__)

FD_RESERVE = 256
"""Descriptors kept for everything but HTTP connections (listening socket, Kafka, Redis, logs)."""


def connection_cap(max_connections: int) -> int:
    """``max_connections``, after raising the soft descriptor limit to the hard one when it is too low
    for that many; lowered, with a warning, when even the hard limit leaves too few descriptors."""
    needed = max_connections + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as err:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, err)
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return max_connections
    cap = max(1, soft - FD_RESERVE)
    log.warning(
        "max_connections (%s) is %d, but the process may open only %d files (ulimit -n; %d kept for other "
        "uses): serving at most %d connections; raise the hard limit or lower %s",
        env_name("max_connections"),
        max_connections,
        soft,
        FD_RESERVE,
        cap,
        env_name("max_connections"),
    )
    return cap


def refusal_budget(max_connections: int) -> int:
    """Refusals at the cap that may wait at once: as many as the cap, within the descriptors that the
    cap and ``FD_RESERVE`` leave (``connection_cap`` has raised the soft limit already)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return max_connections
    return max(0, min(max_connections, soft - max_connections - FD_RESERVE))
