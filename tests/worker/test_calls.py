"""Where a batch's up-front input check runs: on the event loop while it is short, on a thread once long."""

from __future__ import annotations

import threading

from gpu_worker.backends.base import InputError
from gpu_worker.calls import LONG_CHECK_CHARS, BackendCalls, Failure
from gpu_worker.runner import BackendRunner
from telemetry import metrics


class CheckedOn:
    """Reverses each input, and records the thread each ``input_errors`` ran on."""

    name = "checked-on"

    def __init__(self) -> None:
        self.threads: list[int] = []

    def load(self) -> None:
        return None

    def input_errors(self, inputs: object) -> dict[int, object]:
        self.threads.append(threading.get_ident())
        return {}

    def batchstring(self, inputs: list[str]) -> list[str]:
        return [text[::-1] for text in inputs]


async def test_a_short_batch_is_checked_on_the_loop_without_a_thread_hop(runner: BackendRunner) -> None:
    """Every batch of a backend that checks nothing (sim) would pay the hop: it costs more than the check."""
    backend = CheckedOn()
    calls = BackendCalls(backend, runner, "m", "w")  # type: ignore[arg-type]
    result = await calls.run(["abc"] * 100)
    assert result.outputs == {index: "cba" for index in range(100)}
    assert backend.threads == [threading.get_ident()], "a short batch was checked on another thread"


async def test_a_long_batch_is_checked_off_the_loop(runner: BackendRunner) -> None:
    backend = CheckedOn()
    calls = BackendCalls(backend, runner, "m", "w")  # type: ignore[arg-type]
    inputs = ["x" * (LONG_CHECK_CHARS // 4)] * 4
    result = await calls.run(inputs)
    assert len(result.outputs) == 4
    assert len(backend.threads) == 1 and backend.threads[0] != threading.get_ident(), (
        "a long batch was checked on the event loop"
    )


class CheckFails(CheckedOn):
    """Its input check raises on an input containing "bad" (a tokenizer that cannot read it), as does its call."""

    def input_errors(self, inputs: object) -> dict[int, object]:
        if any("bad" in text for text in inputs):  # type: ignore[attr-defined]
            raise ValueError("cannot tokenize")
        return {}

    def batchstring(self, inputs: list[str]) -> list[str]:
        if any("bad" in text for text in inputs):
            raise ValueError("cannot tokenize")
        return super().batchstring(inputs)


async def test_an_input_whose_check_raises_fails_alone_and_the_others_are_answered(runner: BackendRunner) -> None:
    """An exception from the up-front check is the input's failure, as one from the call is: it must not
    fail the whole call (which fails the worker, and every redelivery's worker after it)."""
    calls = BackendCalls(CheckFails(), runner, "m", "w")  # type: ignore[arg-type]
    result = await calls.run(["abc", "bad", "xyz"])
    assert result.outputs[0] == "cba" and result.outputs[2] == "zyx", result.outputs
    failure = result.outputs[1]
    assert isinstance(failure, Failure) and failure.code == "backend_error", failure
    assert "cannot tokenize" in failure.message, failure.message


async def test_a_lone_input_whose_check_raises_fails(runner: BackendRunner) -> None:
    result = await BackendCalls(CheckFails(), runner, "m", "w").run(["bad"])  # type: ignore[arg-type]
    failure = result.outputs[0]
    assert isinstance(failure, Failure) and failure.code == "backend_error", failure


class AnswersNotText(CheckedOn):
    """Answers an input containing "none" with None and one containing "bytes" with bytes (a backend bug)."""

    def batchstring(self, inputs: list[str]) -> list[str]:
        answers: list[object] = [
            None if "none" in text else text.encode() if "bytes" in text else text[::-1] for text in inputs
        ]
        return answers  # type: ignore[return-value]


async def test_an_output_that_is_not_text_fails_its_input_and_the_others_are_answered(runner: BackendRunner) -> None:
    """An output that is neither a string nor an ``InputError`` is that input's failure: read as an
    ``InputError`` it raised out of the call, which crashed the worker and every replacement it had until
    the whole batch was dead-lettered as if the process had died."""
    calls = BackendCalls(AnswersNotText(), runner, "m", "w")  # type: ignore[arg-type]
    result = await calls.run(["abc", "none", "bytes", "xyz"])
    assert result.outputs[0] == "cba" and result.outputs[3] == "zyx", result.outputs
    for index, kind in ((1, "NoneType"), (2, "bytes")):
        failure = result.outputs[index]
        assert isinstance(failure, Failure) and failure.code == "backend_error", failure
        assert kind in failure.message and "not a string" in failure.message, failure.message


class RaisesExit(CheckedOn):
    """Raises SystemExit on an input containing "exit" and KeyboardInterrupt on one containing "interrupt"
    (model code that calls ``sys.exit``, or a library that turns a native error into either)."""

    def batchstring(self, inputs: list[str]) -> list[str]:
        if any("exit" in text for text in inputs):
            raise SystemExit("the model's code called sys.exit")
        if any("interrupt" in text for text in inputs):
            raise KeyboardInterrupt
        return super().batchstring(inputs)


async def test_a_call_that_raises_system_exit_fails_its_input_and_the_process_goes_on(runner: BackendRunner) -> None:
    """A backend's SystemExit or KeyboardInterrupt is its call's failure: raised in the event loop it ended
    the process (in embedded mode the gateway and every model with it), and no process was asked to end."""
    calls = BackendCalls(RaisesExit(), runner, "m", "w")  # type: ignore[arg-type]
    try:
        result = await calls.run(["abc", "exit", "interrupt", "xyz"])
    except BaseException as err:
        raise AssertionError(f"the call raised {err!r} out of the worker") from None
    assert result.outputs[0] == "cba" and result.outputs[3] == "zyx", result.outputs
    for index, kind in ((1, "SystemExit"), (2, "KeyboardInterrupt")):
        failure = result.outputs[index]
        assert isinstance(failure, Failure) and failure.code == "backend_error", failure
        assert kind in failure.message, failure.message


class AnswersLoneSurrogates(CheckedOn):
    """Answers an input containing "half" with text holding a lone surrogate: what a backend that decodes
    token bytes with ``errors="surrogateescape"`` returns for a cut UTF-8 sequence (a backend bug)."""

    def batchstring(self, inputs: list[str]) -> list[str]:
        return [text[::-1] + ("\udcc3" if "half" in text else "") for text in inputs]


async def test_an_output_that_is_not_valid_unicode_fails_its_input_and_the_others_are_answered(
    runner: BackendRunner,
) -> None:
    """A string with a lone surrogate has no UTF-8 encoding, so its task's state cannot be encoded
    (``encode_state`` raises): kept as an answer, it failed the store of the whole batch's results and
    crashed the worker, and every replacement that ran the batch again."""
    calls = BackendCalls(AnswersLoneSurrogates(), runner, "m", "w")  # type: ignore[arg-type]
    result = await calls.run(["abc", "half é", "xyz"])
    assert result.outputs[0] == "cba" and result.outputs[2] == "zyx", result.outputs
    failure = result.outputs[1]
    assert isinstance(failure, Failure) and failure.code == "backend_error", f"expected a failure, got {failure!r}"
    assert "surrogate" in failure.message, failure.message


class RaisesWithLoneSurrogate(CheckedOn):
    """Raises on an input containing "half" with a message holding a lone surrogate (the text a
    ``surrogateescape`` decode left), as an ``InputError`` from its check and as an error from its call."""

    def input_errors(self, inputs: object) -> dict[int, object]:
        texts: list[str] = inputs  # type: ignore[assignment]
        return {i: InputError(i, "input_too_long", "cannot read \udcc3") for i, t in enumerate(texts) if "check" in t}

    def batchstring(self, inputs: list[str]) -> list[str]:
        if any("half" in text for text in inputs):
            raise ValueError("cannot decode \udcc3 here")
        return super().batchstring(inputs)


async def test_a_failure_whose_message_is_not_valid_unicode_is_stored_with_the_surrogate_escaped(
    runner: BackendRunner,
) -> None:
    """An error message goes into the task's state as an output does: one with a lone surrogate could
    not be encoded, and failed the store of the whole batch's results (and the worker)."""
    calls = BackendCalls(RaisesWithLoneSurrogate(), runner, "m", "w")  # type: ignore[arg-type]
    result = await calls.run(["abc", "half", "check"])
    assert result.outputs[0] == "cba", result.outputs
    for index in (1, 2):
        failure = result.outputs[index]
        assert isinstance(failure, Failure), failure
        failure.message.encode()  # raises UnicodeEncodeError on a lone surrogate
        assert "\\udcc3" in failure.message, failure.message


class CheckExits(CheckedOn):
    """Its input check raises SystemExit on an input containing "exit" and KeyboardInterrupt on one containing
    "interrupt"; one containing "long" makes it return each malformed answer a buggy check could give."""

    def __init__(self, answer: object = None) -> None:
        super().__init__()
        self.answer = answer

    def input_errors(self, inputs: object) -> dict[int, object]:
        texts = list(inputs)  # type: ignore[call-overload]
        if any("exit" in text for text in texts):
            raise SystemExit("the tokenizer's code called sys.exit")
        if any("interrupt" in text for text in texts):
            raise KeyboardInterrupt
        if any("long" in text for text in texts):
            return self.answer  # type: ignore[return-value]
        return {}


async def test_a_check_that_raises_system_exit_fails_its_input_and_the_process_goes_on(runner: BackendRunner) -> None:
    """The up-front check of a short batch runs on the event loop: a SystemExit or KeyboardInterrupt from it
    ended the process, as the call's did before it was caught."""
    calls = BackendCalls(CheckExits(), runner, "m", "w")  # type: ignore[arg-type]
    for inputs in (["abc", "exit", "interrupt", "xyz"], ["abc", "exit", "interrupt", "xyz" * LONG_CHECK_CHARS]):
        try:
            result = await calls.run(inputs)
        except BaseException as err:
            raise AssertionError(f"the check raised {err!r} out of the worker") from None
        assert result.outputs[0] == "cba" and isinstance(result.outputs[3], str), result.outputs
        for index, kind in ((1, "SystemExit"), (2, "KeyboardInterrupt")):
            failure = result.outputs[index]
            assert isinstance(failure, Failure) and failure.code == "backend_error", failure
            assert kind in failure.message, failure.message


async def test_a_check_that_answers_malformed_fails_the_inputs_it_names_and_the_others_are_answered(
    runner: BackendRunner,
) -> None:
    """A check's answer that is not a mapping of input indices to ``InputError`` (a backend bug) is read as a
    check that raised: it crashed the worker (or named inputs the batch does not have)."""
    malformed: list[object] = [
        {1: "too long"},
        {7: InputError(1, "input_too_long", "too long")},
        [(1, InputError(1, "input_too_long", "too long"))],
        {"1": InputError(1, "input_too_long", "too long")},
        None,
    ]
    for answer in malformed:
        calls = BackendCalls(CheckExits(answer), runner, "m", "w")  # type: ignore[arg-type]
        try:
            result = await calls.run(["abc", "long", "xyz"])
        except Exception as err:
            raise AssertionError(f"{answer!r}: the check's answer raised {err!r} out of the worker") from None
        assert result.outputs[0] == "cba" and result.outputs[2] == "zyx", (answer, result.outputs)
        failure = result.outputs[1]
        assert isinstance(failure, Failure) and failure.code == "backend_error", (answer, failure)
        assert "input_errors" in failure.message, failure.message


class NumpyIndex:
    """An index as numpy gives one (``np.int64``: an integer by ``__index__``, not an ``int``)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value

    def __hash__(self) -> int:
        return hash(self.value)

    def __eq__(self, other: object) -> bool:
        return other == self.value


async def test_a_check_that_names_its_inputs_by_numpy_indices_rejects_them_with_their_own_errors(
    runner: BackendRunner,
) -> None:
    """A tokenizer's lengths in an array give indices of numpy's integer types: they name the batch's inputs as
    well as ints do, and the input keeps its own error (``input_too_long``), not a failed check's."""
    too_long = InputError(1, "input_too_long", "too long")
    calls = BackendCalls(CheckExits({NumpyIndex(1): too_long}), runner, "m", "w")  # type: ignore[arg-type]
    result = await calls.run(["abc", "long", "xyz"])
    assert result.outputs[0] == "cba" and result.outputs[2] == "zyx", result.outputs
    failure = result.outputs[1]
    assert isinstance(failure, Failure) and failure.code == "input_too_long", failure


async def test_a_worker_exports_its_busy_and_cpu_seconds_from_its_start(runner: BackendRunner) -> None:
    """A worker that has run no call yet is idle, and says so: without its series (0) until its first call
    ends, a sum or count over workers (the dashboard's idle workers) leaves it out."""
    BackendCalls(CheckedOn(), runner, "m", "fresh-worker")  # type: ignore[arg-type]
    for family in ("batchwire_worker_busy_seconds_total", "batchwire_backend_cpu_seconds_total"):
        value = metrics.REGISTRY.get_sample_value(family, {"worker": "fresh-worker"})
        assert value == 0.0, f"a worker that ran no call yet exports {family} {value}, not 0"
