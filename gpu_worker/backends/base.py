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


class PartialOutputs(BackendError):
    """A call computed every input, but some outputs are unusable (an embedding that is not finite): those
    inputs fail alone with their ``InputError``; the others' outputs stand. ``outputs``: one per input."""

    def __init__(self, outputs: Sequence[str | InputError]) -> None:
        errors = [output for output in outputs if isinstance(output, InputError)]
        first = f"; the first: {errors[0]}" if errors else ""
        super().__init__(f"{len(errors)} of {len(outputs)} inputs failed{first}")
        self.outputs = outputs


def answered(outputs: Sequence[str | InputError]) -> list[str]:
    """``outputs`` as they are when every input has one, else ``PartialOutputs``."""
    texts = [output for output in outputs if isinstance(output, str)]
    if len(texts) < len(outputs):
        raise PartialOutputs(outputs)
    return texts


class Backend(Protocol):
    """``batchstring``: 1..max_batch inputs in, one output per input, in order.

    Implementations are blocking (a GPU call); the worker runs them in a dedicated thread, one
    call at a time. ``input_errors`` lets a backend reject single inputs up front (returned as
    per-request errors) so that one bad input does not fail a whole batch; the worker calls it on
    another thread, possibly while ``batchstring`` runs, so it must be safe there. An output that
    only the call finds unusable is ``batchstring``'s ``PartialOutputs``.
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
