"""Transport errors that retrying cannot fix (a missing topic, a partition moved to another member).

``TransportError`` (base.py) is retriable by default; this subclass says "change something first".
"""

from __future__ import annotations

from batchwire.transport.base import TransportError


class PermanentTransportError(TransportError):
    """A transport failure that will repeat until configuration or ownership changes."""

    retriable = False
