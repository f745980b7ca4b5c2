"""Backend calls for one group of inputs: up-front rejections, then bisection around failing inputs.

Each call runs on the backend's own thread (``runner.BackendRunner``); a plain exception splits the
inputs in halves until the failing ones are alone, so the healthy ones still get answers. A hung
call is not an input's failure: ``BackendHung`` goes up to the worker, which gives the batch back.
The up-front check (``input_errors``: a tokenizer's counts) of long inputs runs on a thread too, off the
event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import SupportsIndex

from gpu_worker.backends.base import Backend, InputError, PartialOutputs
from gpu_worker.runner import BackendExited, BackendHung, BackendRunner, NotStarted, Timing
from telemetry import metrics

LONG_CHECK_CHARS = 16_384
"""A batch whose inputs hold this many characters together is checked (``Backend.input_errors``: a
tokenizer's counts) on a thread; a shorter one costs less to check than the hop, which every batch
would pay, those of a backend that checks nothing (sim) included."""


class Failure:
    """Why one input got no output."""

    __slots__ = ("code", "message")

    def __init__(self, code: str, message: str) -> None:
        """A lone surrogate in ``message`` (from an exception's text) is escaped: the message goes into
        the task's state, which a string without a UTF-8 encoding would keep from being stored."""
        self.code = code
        self.message = message if message.isascii() else message.encode(errors="backslashreplace").decode()


OUTPUT_TOO_LARGE = "output_too_large"


def oversize(output: str, limit: int) -> Failure | None:
    """The failure of an output over ``limit`` UTF-8 bytes (0: no limit), else None; measured only
    when its length leaves a doubt (a UTF-8 character is 1 to 4 bytes)."""
    if not limit or 4 * len(output) <= limit:
        return None
    size = len(output) if output.isascii() else len(output.encode())
    if size <= limit:
        return None
    return Failure(
        OUTPUT_TOO_LARGE,
        f"the model's output is {size} bytes (UTF-8), over the limit of {limit} (BATCHWIRE_MAX_OUTPUT_BYTES); "
        "it was not stored",
    )


@dataclass(slots=True)
class GroupResult:
    """A group's outputs (or failures) by input index, and when its backend calls began and ended."""

    outputs: dict[int, str | Failure] = field(default_factory=dict)
    first: Timing = field(default_factory=Timing)
    """The first call's timing, set by the backend's thread when it starts (the worker reads it to
    time its next credit)."""
    started: float | None = None
    ended: float | None = None


def _malformed(errors: object) -> TypeError:
    return TypeError(f"input_errors returned {errors!r:.200}, not a dict of input indices to InputError")


def _check_failed(err: Exception) -> Failure:
    return Failure("backend_error", f"the model failed on this input: {err}")


def _outcome(output: object) -> str | Failure:
    """One input's output as the worker stores it: an answer that is not text (a backend's bug) fails its
    input alone, as an exception on it would, instead of raising out of the call and crashing the worker.
    So does text with a lone surrogate, which has no UTF-8 encoding: its task's state could not be
    encoded, and the store of the whole batch's results would fail the worker."""
    if isinstance(output, str):
        if output.isascii():
            return output
        try:
            output.encode()
        except UnicodeEncodeError as err:
            return Failure(
                "backend_error",
                f"the model returned text that is not valid Unicode for this input (a lone surrogate at "
                f"character {err.start}), which cannot be stored",
            )
        return output
    if isinstance(output, InputError):
        return Failure(output.code, str(output))
    return Failure("backend_error", f"the model returned a {type(output).__name__} for this input, not a string")


class BackendCalls:
    def __init__(
        self, backend: Backend, runner: BackendRunner, model: str, worker_id: str, distinct_only: bool = False
    ) -> None:
        """``distinct_only``: the model is deterministic, so the backend runs each distinct input of a
        group once and its output goes to every item that carries it."""
        self.backend = backend
        self.runner = runner
        self.model = model
        self.worker_id = worker_id
        self.distinct_only = distinct_only
        self._uncounted: list[Timing] = []
        """The calls submitted and not yet in the busy seconds: one runs at a time on the backend's thread."""
        metrics.WORKER_CALL_RUNNING.labels(worker=worker_id).set_function(self._running_s)
        # 0 from the start, not from the first call's end: sums and counts over workers include an idle one.
        metrics.WORKER_BUSY.labels(worker=worker_id)
        metrics.BACKEND_CPU.labels(worker=worker_id)

    def close(self) -> None:
        """Drops this worker's running-call gauge: the registry keeps the function that reads it, which would
        keep a replaced worker's backend (its model) alive for the process's life."""
        with contextlib.suppress(KeyError):
            metrics.WORKER_CALL_RUNNING.remove(self.worker_id)

    def _running_s(self) -> float:
        """How long the call on the backend's thread has run, while the busy seconds do not hold it yet."""
        now = self.runner.clock()
        return sum(
            (now if timing.ended is None else timing.ended) - timing.started
            for timing in self._uncounted
            if timing.started is not None
        )

    async def run(
        self, inputs: list[str], result: GroupResult | None = None, start_by: float | None = None
    ) -> GroupResult:
        """Outputs (or failures) by input index, filled into ``result`` (a new one by default).
        ``start_by``: the first call, not begun by then (the runner's clock), raises ``NotStarted``."""
        result = GroupResult() if result is None else result
        distinct = list(dict.fromkeys(inputs)) if self.distinct_only else inputs
        if len(distinct) < len(inputs):
            await self._run_each(distinct, result, start_by)
            position = {text: index for index, text in enumerate(distinct)}
            result.outputs = {index: result.outputs[position[text]] for index, text in enumerate(inputs)}
            return result
        return await self._run_each(inputs, result, start_by)

    async def _run_each(self, inputs: list[str], result: GroupResult, start_by: float | None) -> GroupResult:
        # Tokenizing a batch of long inputs takes long enough to stall every other task of the loop
        # (in one process: the HTTP server's, the heartbeats', the hang detection's).
        rejected = await self._check(inputs)
        for index, err in rejected.items():
            result.outputs[index] = err if isinstance(err, Failure) else Failure(err.code, str(err))
        todo = [index for index in range(len(inputs)) if index not in rejected]
        if todo:
            await self._bisect(inputs, todo, result, start_by)
        return result

    async def _check(self, inputs: list[str]) -> dict[int, InputError | Failure]:
        """``Backend.input_errors``; a check that raises is run again on each input alone, and an input
        whose own check raises fails as a call that raises on it does, not the whole call (and worker)."""
        try:
            return dict(await self._input_errors(inputs))
        except Exception as err:
            if len(inputs) == 1:
                return {0: _check_failed(err)}
        rejected: dict[int, InputError | Failure] = {}
        for index, text in enumerate(inputs):
            try:
                errors = await self._input_errors([text])
            except Exception as err:
                rejected[index] = _check_failed(err)
                continue
            if 0 in errors:
                rejected[index] = errors[0]
        return rejected

    async def _input_errors(self, inputs: list[str]) -> dict[int, InputError]:
        """The check's answer; one that raises ``SystemExit`` or ``KeyboardInterrupt`` (which would end the
        process) or that is not a mapping of this batch's indices to ``InputError`` raises an ``Exception``."""
        try:
            if sum(map(len, inputs)) < LONG_CHECK_CHARS:
                errors: object = self.backend.input_errors(inputs)
            else:
                errors = await asyncio.to_thread(self.backend.input_errors, inputs)
        except (SystemExit, KeyboardInterrupt) as err:
            raise BackendExited(err) from err
        if not isinstance(errors, Mapping):
            raise _malformed(errors)
        checked: dict[int, InputError] = {}
        for key, error in errors.items():
            # An integer of numpy's (a tokenizer's lengths in an array) names an input as an int does.
            index = key.__index__() if isinstance(key, SupportsIndex) and not isinstance(key, bool) else -1
            if not 0 <= index < len(inputs) or not isinstance(error, InputError):
                raise _malformed(errors)
            checked[index] = error
        return checked

    async def _bisect(
        self, inputs: list[str], indices: list[int], result: GroupResult, start_by: float | None = None
    ) -> None:
        try:
            outputs = await self._call([inputs[i] for i in indices], result, start_by)
        except (BackendHung, NotStarted):
            raise
        except Exception as err:
            if len(indices) == 1:
                result.outputs[indices[0]] = Failure("backend_error", f"the model failed on this input: {err}")
                return
            middle = len(indices) // 2
            await self._bisect(inputs, indices[:middle], result)
            await self._bisect(inputs, indices[middle:], result)
            return
        for index, output in zip(indices, outputs, strict=True):
            result.outputs[index] = _outcome(output)

    async def _call(self, inputs: list[str], result: GroupResult, start_by: float | None) -> Sequence[str | InputError]:
        timing = result.first if result.started is None else Timing()
        outputs: Sequence[str | InputError]
        self._uncounted.append(timing)
        try:
            outputs = await self.runner.call(self.backend.batchstring, inputs, timing=timing, start_by=start_by)
        except PartialOutputs as partial:  # the others' outputs stand: nothing to split
            outputs = partial.outputs
        finally:
            if timing.ended is not None or timing.started is None:  # a hung call's time keeps counting
                self._uncounted = [other for other in self._uncounted if other is not timing]
            if timing.started is not None and timing.ended is not None:  # thread times: not the queueing
                elapsed = timing.ended - timing.started
                metrics.BACKEND_CALL.labels(model=self.model, backend=self.backend.name).observe(elapsed)
                metrics.WORKER_BUSY.labels(worker=self.worker_id).inc(elapsed)
                metrics.BACKEND_CPU.labels(worker=self.worker_id).inc(timing.cpu_s or 0.0)
                metrics.BACKEND_ITEMS.labels(model=self.model).inc(len(inputs))
                result.started = timing.started if result.started is None else result.started
                result.ended = timing.ended
        if len(outputs) != len(inputs):
            raise RuntimeError(f"backend returned {len(outputs)} outputs for {len(inputs)} inputs")
        return outputs
