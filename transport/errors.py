"""Transport errors beyond the retriable ``TransportError`` (``transport.ports``): ones that retrying cannot fix
(a missing topic, a partition moved to another member) and a store that is full.
"""

from __future__ import annotations

from transport.ports import TransportError


class PermanentTransportError(TransportError):
    """A transport failure that will repeat until configuration or ownership changes."""

    retriable = False


class StoreFullError(TransportError):
    """The result store refused a write because its memory bound is reached (Redis ``OOM``).

    Retriable: stored states expire (``--result-ttl-s``) and free memory, or an operator raises the
    bound, and the same write then succeeds. Callers wait and retry; they never drop what they hold.
    """

    retriable = True
