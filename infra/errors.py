"""Errors raised by `infra`: one base so callers can catch infrastructure trouble as a whole."""

from __future__ import annotations


class InfraError(Exception):
    """Base of every infra failure.

    `retriable` says whether the same call may succeed if tried again (a port taken between
    choosing and binding it, a slow machine), as opposed to a missing tool or bad setup.
    """

    retriable: bool = False


class ShapeError(InfraError):
    """A stack shape no stack can have (``--brokers 0``): a setting to change, not a start that failed."""


class ToolMissingError(InfraError):
    """A program the stack needs (java, mvn, redis-server) is not installed."""


class FetchError(InfraError):
    """Maven could not fetch the Kafka jars."""

    retriable = True


class ServiceStartError(InfraError):
    """A service process exited early or did not serve before its deadline."""

    retriable = True


class StartTimeoutError(ServiceStartError):
    """A service process was still starting at its deadline: a slow or busy machine, not a broken setup."""


class PortTakenError(ServiceStartError):
    """Another process answered on a port the server was to listen on: it bound the port first."""


class ServiceStopError(InfraError):
    """A service process survived SIGKILL (should not happen; a stuck kernel task)."""


class NotSupportedError(InfraError):
    """The chosen infrastructure cannot do this (e.g. restarting an external broker)."""
