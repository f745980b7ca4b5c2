"""A deterministic model's batch: each distinct input runs once, and every item gets its own input's output."""

from __future__ import annotations

from gpu_worker.calls import BackendCalls, Failure
from gpu_worker.runner import BackendRunner


class Recording:
    """Reverses each input, records what it was handed, and fails on inputs starting ``bad``."""

    name = "recording"

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def load(self) -> None:
        return None

    def input_errors(self, inputs: object) -> dict[int, object]:
        return {}

    def batchstring(self, inputs: list[str]) -> list[str]:
        self.calls.append(list(inputs))
        if any(text.startswith("bad") for text in inputs):
            raise RuntimeError("the model failed")
        return [text[::-1] for text in inputs]


async def test_duplicates_run_once_and_each_item_gets_its_inputs_output(runner: BackendRunner) -> None:
    backend = Recording()
    calls = BackendCalls(backend, runner, "sim", "w", distinct_only=True)  # type: ignore[arg-type]
    inputs = ["ab", "cd", "ab", "ef", "cd", "ab"]
    result = await calls.run(inputs)
    assert backend.calls == [["ab", "cd", "ef"]], "each distinct input handed to the backend once"
    assert result.outputs == {i: text[::-1] for i, text in enumerate(inputs)}


async def test_a_failing_duplicate_fails_every_item_that_carries_it(runner: BackendRunner) -> None:
    backend = Recording()
    calls = BackendCalls(backend, runner, "sim", "w", distinct_only=True)  # type: ignore[arg-type]
    result = await calls.run(["bad1", "ok", "bad1"])
    assert result.outputs[1] == "ko"
    assert all(isinstance(result.outputs[i], Failure) for i in (0, 2)), result.outputs


async def test_a_model_not_deterministic_runs_every_item(runner: BackendRunner) -> None:
    backend = Recording()
    calls = BackendCalls(backend, runner, "gen", "w")  # type: ignore[arg-type]
    result = await calls.run(["x", "x"])
    assert backend.calls == [["x", "x"]] and result.outputs == {0: "x", 1: "x"}
