"""The open-loop sender: one event loop, one HTTP client, sends on a precomputed schedule.

A send never waits for an earlier answer (that would be a closed loop, which hides queueing by
slowing the offered load). When ``concurrency_limit`` requests are already outstanding a send is
counted as the error ``client_limit`` instead of being delayed, so the schedule stays honest.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from yarl import URL

from batchwire.bench.client import HttpClient, HttpProtocolError
from batchwire.bench.histogram import DurationHistogram
from batchwire.bench.schedule import InputFactory

Expect = Literal["reverse", "none"]

CLIENT_LIMIT = "client_limit"
TIMEOUT = "timeout"
CONNECTION = "connection"
WRONG_ANSWER = "wrong_answer"
BAD_BODY = "bad_body"
PROTOCOL = "protocol"
CLIENT_EXCEPTION = "client_exception"

#: Statuses that refuse a request at once (overloaded, rate limited): their latency is the
#: service's refusal time, kept apart from the answers' latency.
REFUSED_STATUSES = frozenset({429, 503})
DEADLINE_STATUS = 504


@dataclass(frozen=True, slots=True)
class Window:
    """Loop-clock bounds of the measurement window: requests scheduled in ``[start, end)`` count."""

    start: float
    end: float


@dataclass(slots=True)
class Tally:
    """What happened to the requests of one rate.

    Latency and error counts cover the requests *scheduled* inside the window; ``answers_in_window``
    counts answers *received* inside it, whoever sent them, which is the service's throughput.
    """

    scheduled: int = 0
    sent: int = 0
    ok: int = 0
    warmup_sent: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    answers_in_window: int = 0
    drained_answers: int = 0
    last_answer_after_window_s: float = 0.0
    unfinished: int = 0
    max_outstanding: int = 0
    first_exception: str | None = None
    latency: DurationHistogram = field(default_factory=DurationHistogram)
    latency_all: DurationHistogram = field(default_factory=DurationHistogram)
    lag: DurationHistogram = field(default_factory=DurationHistogram)
    sends: list[tuple[float, float]] = field(default_factory=list)
    """Each measured send: when it was due (seconds from the window's start) and how late it went."""
    warmup_sends: list[tuple[float, float]] = field(default_factory=list)
    """The same for the warm-up's sends (due before the window: negative)."""
    second_sums_s: list[float] = field(default_factory=list)
    second_counts: list[int] = field(default_factory=list)
    """Latency summed and answers counted (200s only) by the second of the window they were due in."""
    refused: DurationHistogram = field(default_factory=DurationHistogram)
    refused_from_send: DurationHistogram = field(default_factory=DurationHistogram)
    """Refusals timed from when the send ran: the refusal latency without the generator's lag."""
    answered_504: list[tuple[URL, str]] = field(default_factory=list)
    """(URL, task id) of each 504 answer, to ask after the run whether the task was computed anyway."""
    answered_504_without_id: int = 0

    def add_to_second(self, second: int, latency_s: float) -> None:
        """Counts one answer's latency in the second of the window it was due in."""
        grow = second + 1 - len(self.second_counts)
        if grow > 0:
            self.second_sums_s.extend([0.0] * grow)
            self.second_counts.extend([0] * grow)
        self.second_sums_s[second] += latency_s
        self.second_counts[second] += 1


class OpenLoopSender:
    """Sends one schedule of requests and tallies every outcome.

    ``offsets`` are seconds after ``t0`` (a loop-clock time); the caller picks ``t0`` so that it can
    sample server metrics exactly at the window bounds while the load runs.
    """

    def __init__(
        self,
        client: HttpClient,
        urls: Sequence[str],
        inputs: InputFactory,
        *,
        concurrency_limit: int,
        expect: Expect,
        drain_timeout_s: float,
    ) -> None:
        if not urls:
            raise ValueError("at least one target URL is needed")
        if concurrency_limit < 1:
            raise ValueError(f"concurrency limit must be at least 1, got {concurrency_limit}")
        self._client = client
        self._urls = tuple(URL(url) for url in urls)  # parsed once, not per request
        self._inputs = inputs
        self._limit = concurrency_limit
        self._expect: Expect = expect
        self._drain_timeout_s = drain_timeout_s
        self._loop = asyncio.get_running_loop()
        self._tasks: set[asyncio.Task[None]] = set()
        self._window = Window(0.0, 0.0)
        self._tally = Tally()

    async def run(self, t0: float, offsets: Sequence[float], window: Window) -> Tally:
        """Sends at ``t0 + offset`` for each offset, then waits for the answers (or their timeouts)."""
        self._window = window
        self._tally = tally = Tally()
        loop = self._loop
        clock = loop.time
        urls = self._urls
        n_urls = len(urls)
        try:
            for index, offset in enumerate(offsets):
                target = t0 + offset
                delay = target - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                self._launch(urls[index % n_urls], target)
            await self._drain()
        finally:
            await self._cancel_outstanding()
        return tally

    def _launch(self, url: URL, target: float) -> None:
        tally = self._tally
        measured = self._window.start <= target < self._window.end
        if measured:
            tally.scheduled += 1
        else:
            tally.warmup_sent += 1
        tasks = self._tasks
        if len(tasks) >= self._limit:
            if measured:
                tally.errors[CLIENT_LIMIT] += 1
                tally.lag.record_s(self._loop.time() - target)
            return
        if measured:
            tally.sent += 1
        task = self._loop.create_task(self._one(url, target, measured))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        if len(tasks) > tally.max_outstanding:
            tally.max_outstanding = len(tasks)

    async def _one(self, url: URL, target: float, measured: bool) -> None:
        clock = self._loop.time
        tally = self._tally
        started = clock()
        if measured:
            # Taken when the task runs, not when it was created, so a congested loop shows as lag.
            tally.lag.record_s(started - target)
        (tally.sends if measured else tally.warmup_sends).append((target - self._window.start, started - target))
        text, body = self._inputs.next()
        answer = await self._exchange(url, body)
        done = clock()  # before checking the answer: the check is the client's time, not the server's
        if isinstance(answer, str):
            kind: str | None = answer
        elif answer[0] != 200:
            kind = f"http_{answer[0]}"
        else:
            kind = None if self._expect == "none" else check_reverse(answer[1], text)
        window = self._window
        if kind is None and window.start <= done < window.end:
            tally.answers_in_window += 1
        if not measured:
            return
        elapsed = done - target
        tally.latency_all.record_s(elapsed)
        if kind is None:
            tally.ok += 1
            tally.latency.record_s(elapsed)
            tally.add_to_second(int(target - window.start), elapsed)
            if done >= window.end:
                tally.drained_answers += 1
        else:
            tally.errors[kind] += 1
            if not isinstance(answer, str):
                self._note_error_answer(url, answer, elapsed, done - started)
        if done >= window.end:
            tally.last_answer_after_window_s = max(tally.last_answer_after_window_s, done - window.end)

    def _note_error_answer(self, url: URL, answer: tuple[int, bytes], elapsed_s: float, from_send_s: float) -> None:
        tally = self._tally
        status, payload = answer
        if status in REFUSED_STATUSES:
            tally.refused.record_s(elapsed_s)
            tally.refused_from_send.record_s(from_send_s)
        elif status == DEADLINE_STATUS:
            task_id = _error_task_id(payload)
            if task_id is None:
                tally.answered_504_without_id += 1
            else:
                tally.answered_504.append((url, task_id))

    async def _exchange(self, url: URL, body: bytes) -> tuple[int, bytes] | str:
        """One request: the status and body, or the kind of error that prevented an answer."""
        try:
            return await self._client.post(url, body)
        except TimeoutError:  # before OSError, of which it is a subclass
            return TIMEOUT
        except OSError:
            return CONNECTION
        except HttpProtocolError:
            return PROTOCOL
        except Exception as err:  # one odd request must not end the run; it is counted and reported
            if self._tally.first_exception is None:
                self._tally.first_exception = repr(err)
            return CLIENT_EXCEPTION

    async def _drain(self) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self._drain_timeout_s)

    async def _cancel_outstanding(self) -> None:
        pending = [task for task in self._tasks if not task.done()]
        self._tally.unfinished += len(pending)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


def check_reverse(payload: bytes, text: str) -> str | None:
    """The sim backend answers the reversed input; anything else is a wrong (or unreadable) answer."""
    try:
        document = json.loads(payload)
    except ValueError:
        return BAD_BODY
    if not isinstance(document, dict) or not isinstance(document.get("output"), str):
        return BAD_BODY
    return None if document["output"] == text[::-1] else WRONG_ANSWER


def _error_task_id(payload: bytes) -> str | None:
    """``error.task_id`` of a batchwire error body, if it has one."""
    try:
        document = json.loads(payload)
    except ValueError:
        return None
    error = document.get("error") if isinstance(document, dict) else None
    task_id = error.get("task_id") if isinstance(error, dict) else None
    return task_id if isinstance(task_id, str) and task_id else None
