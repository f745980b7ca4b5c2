"""The contract every model backend keeps, whatever runs behind it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class BackendError(Exception):
    """The backend could not answer. ``retriable`` is False for errors that another try would repeat."""

    retriable = False


class BatchSizeError(BackendError):
    """0 inputs, or more than ``max_batch``."""


class InputError(BackendError):
    """One input cannot be processed (too long for the model, say); the rest of the batch can."""

    def __init__(self, index: int, code: str, message: str) -> None:
        super().__init__(message)
        self.index = index
        self.code = code


class Backend(Protocol):
    """``batchstring``: 1..max_batch inputs in, one output per input, in order.

    Implementations are blocking (a GPU call); the worker runs them in a dedicated thread, one
    call at a time. ``input_errors`` lets a backend reject single inputs up front (returned as
    per-request errors) so that one bad input does not fail a whole batch; the worker calls it on
    another thread, possibly while ``batchstring`` runs, so it must be safe there.
    """

    name: str
    max_batch: int

    def load(self) -> None:
        """Loads weights and warms up, once (a loaded backend's ``load`` does nothing); raises with a
        clear message when it cannot."""
        ...

    def input_errors(self, inputs: Sequence[str]) -> dict[int, InputError]: ...

    def batchstring(self, inputs: list[str]) -> list[str]: ...

    def close(self) -> None: ...
