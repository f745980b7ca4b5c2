import threading

import pytest

from gpu_worker.backends.base import BatchSizeError
from gpu_worker.backends.sim import ReentryError, SimBackend


def test_answers_each_input_reversed_in_order() -> None:
    backend = SimBackend(latency_ms=0)
    assert backend.batchstring(["abc", "", "héllo"]) == ["cba", "", "olléh"]


@pytest.mark.parametrize("size", [0, 101])
def test_rejects_empty_and_oversized_batches(size: int) -> None:
    with pytest.raises(BatchSizeError, match="1 to 100 inputs"):
        SimBackend(latency_ms=0).batchstring(["x"] * size)


def test_fails_loudly_when_entered_twice_at_once() -> None:
    backend = SimBackend(latency_ms=300)
    inside = threading.Event()
    original = backend.batchstring

    errors: list[BaseException] = []

    def first() -> None:
        inside.set()
        original(["a"])

    thread = threading.Thread(target=first)
    thread.start()
    assert inside.wait(5)
    while not backend._busy.locked():  # the first call has taken the guard
        pass
    try:
        backend.batchstring(["b"])
    except ReentryError as err:
        errors.append(err)
    thread.join()
    assert errors, "a second concurrent call must raise ReentryError"
