"""The backbone chaos test's client, a process of its own so that its CPU never stalls the test.

Open loop over every gateway in turn: synchronous request n leaves at ``t0 + n / sync_rate`` and
asynchronous task m at ``t0 + m / async_rate``, however long the answers take. Every request
carries an ``Idempotency-Key`` and a unique input; a ``503`` with ``Retry-After`` is sent again
with the same key after that delay; any other answer ends the request. An async task is then
long-polled on the other gateway until it ends. When the load has ended, every task id that any
answer named is read once more. Writes one JSON document to ``--out``: each request's record and
the client's own figures (the rate it offered, how late its sends left, the CPU it used).

Run: ``python -m tests.e2e.chaos_client --gateways URL,URL --out FILE --t0-file FILE``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import aiohttp

SYNC_TIMEOUT_S = 40.0  # past the gateway's longest timeout_ms (30 s): its 504 comes first
POLL_WAIT_S = 20.0
GIVE_UP_S = 150.0  # a request that has no answer this long after it left is recorded unfinished
# Below the gateway's keep-alive (uvicorn's 5 s): a connection the server is closing as idle is never
# reused, as a request written into it would fail without being read.
KEEPALIVE_S = 2.0
READ_BACK_CONCURRENCY = 32


@dataclass
class Attempt:
    at_s: float
    """When it was sent, seconds from t0."""
    took_s: float
    status: int
    """HTTP status; 0: no answer (the connection failed or the client timed out)."""
    code: str | None = None
    retry_after: str | None = None
    task_id: str | None = None
    output: str | None = None
    state: str | None = None
    """A result read's task status."""
    gateway: int = 0


@dataclass
class Record:
    kind: str
    """``sync`` (POST /v1/inference) or ``async`` (POST /v1/tasks, then GET /v1/result)."""
    n: int
    input: str
    key: str
    gateway: int
    due_s: float
    """When the schedule sent it, seconds from t0."""
    sent_s: float = 0.0
    lag_s: float = 0.0
    attempts: list[Attempt] = field(default_factory=list)
    reads: list[Attempt] = field(default_factory=list)
    """An async task's result reads, until it ended."""
    task_id: str | None = None
    output: str | None = None
    done_s: float | None = None
    """When its answer (sync) or its terminal state (async) came, seconds from t0."""


class Client:
    def __init__(self, session: aiohttp.ClientSession, gateways: list[str], t0: float) -> None:
        self.session = session
        self.gateways = gateways
        self.t0 = t0

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def call(self, method: str, gateway: int, path: str, **kwargs: Any) -> Attempt:
        at = self.now()
        try:
            async with self.session.request(method, self.gateways[gateway] + path, **kwargs) as response:
                raw = await response.read()
                attempt = Attempt(at, self.now() - at, response.status, gateway=gateway)
                attempt.retry_after = response.headers.get("Retry-After")
        except (aiohttp.ClientError, TimeoutError) as err:
            return Attempt(at, self.now() - at, 0, code=f"{type(err).__name__}: {err}", gateway=gateway)
        try:
            body = json.loads(raw)
        except ValueError:
            attempt.code = f"not JSON: {raw[:200]!r}"
            return attempt
        error = body.get("error")
        if isinstance(error, dict):
            attempt.code = error.get("code")
            attempt.task_id = error.get("task_id")
        else:
            attempt.task_id = body.get("task_id")
            attempt.output = body.get("output")
            attempt.state = body.get("status")
        return attempt

    async def submit(self, record: Record, path: str, timeout_s: float) -> Attempt:
        """POSTs until an answer that is not a 503 with Retry-After (sent again after it, same key)."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        headers = {"Idempotency-Key": record.key}
        while True:
            attempt = await self.call(
                "POST", record.gateway, path, json={"input": record.input}, headers=headers, timeout=timeout
            )
            record.attempts.append(attempt)
            if attempt.status != 503 or attempt.retry_after is None or self.now() - record.sent_s > GIVE_UP_S:
                return attempt
            await asyncio.sleep(float(attempt.retry_after))  # what the answer asked for

    async def sync(self, record: Record) -> None:
        record.sent_s = self.now()
        record.lag_s = record.sent_s - record.due_s
        answer = await self.submit(record, "/v1/inference", SYNC_TIMEOUT_S)
        if answer.status == 200:
            record.task_id, record.output, record.done_s = answer.task_id, answer.output, self.now()

    async def task(self, record: Record) -> None:
        record.sent_s = self.now()
        record.lag_s = record.sent_s - record.due_s
        accepted = await self.submit(record, "/v1/tasks", SYNC_TIMEOUT_S)  # queueing waits up to timeout_ms too
        if accepted.status != 202 or accepted.task_id is None:
            return
        record.task_id = accepted.task_id
        other = (record.gateway + 1) % len(self.gateways)
        timeout = aiohttp.ClientTimeout(total=POLL_WAIT_S + 10)
        while self.now() - record.sent_s < GIVE_UP_S:
            read = await self.call(
                "GET", other, f"/v1/result/{record.task_id}", params={"wait": str(POLL_WAIT_S)}, timeout=timeout
            )
            record.reads.append(read)
            if read.status == 503 and read.retry_after is not None:
                await asyncio.sleep(float(read.retry_after))
            elif read.status != 200 or read.state in ("completed", "failed", "expired", "cancelled"):
                break
        last = record.reads[-1] if record.reads else None
        if last is not None and last.status == 200 and last.state == "completed":
            record.output, record.done_s = last.output, self.now()

    async def read_back(self, task_id: str) -> Attempt:
        """A task's state at the end, read from the first gateway (503s read again after Retry-After)."""
        deadline = self.now() + 30
        while True:
            read = await self.call("GET", 0, f"/v1/result/{task_id}", timeout=aiohttp.ClientTimeout(total=10))
            if read.status != 503 or read.retry_after is None or self.now() > deadline:
                return read
            await asyncio.sleep(float(read.retry_after))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    gateways: list[str] = args.gateways.split(",")
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.monotonic()
        # CLOCK_MONOTONIC: the same clock in every process, so the test schedules its faults on it
        await asyncio.to_thread(Path(args.t0_file).write_text, repr(t0))
        client = Client(session, gateways, t0)
        records: list[Record] = []
        pending: list[asyncio.Task[None]] = []
        n_sync = n_async = 0
        while True:
            due_sync = n_sync / args.sync_rate
            due_async = n_async / args.async_rate
            due = min(due_sync, due_async)
            if due >= args.duration_s:
                break
            await asyncio.sleep(max(0.0, due - client.now()))  # the schedule, open loop
            tag = uuid.uuid4().hex[:12]
            if due_sync <= due_async:
                record = Record("sync", n_sync, f"sync-{n_sync}-{tag}", uuid.uuid4().hex, n_sync % 2, due_sync)
                pending.append(asyncio.create_task(client.sync(record)))
                n_sync += 1
            else:
                record = Record("async", n_async, f"async-{n_async}-{tag}", uuid.uuid4().hex, n_async % 2, due_async)
                pending.append(asyncio.create_task(client.task(record)))
                n_async += 1
            records.append(record)
        load_end_s = client.now()
        await asyncio.gather(*pending)
        answered_s = client.now()
        # Every task id any answer named, refused attempts' included: what the store holds for it now.
        task_ids = sorted({a.task_id for r in records for a in (*r.attempts, *r.reads) if a.task_id})
        reading = asyncio.Semaphore(READ_BACK_CONCURRENCY)  # a few connections, not one per task

        async def read_back(task_id: str) -> Attempt:
            async with reading:
                return await client.read_back(task_id)

        finals = await asyncio.gather(*(read_back(task_id) for task_id in task_ids))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "t0": t0,
        "load_end_s": load_end_s,
        "answered_s": answered_s,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "records": [asdict(record) for record in records],
        "final_reads": {task_id: asdict(read) for task_id, read in zip(task_ids, finals, strict=True)},
    }


def spawn(
    gateways: list[str],
    *,
    sync_rate: float,
    async_rate: float,
    duration_s: float,
    out: Path,
    t0_file: Path,
    log: IO[bytes],
) -> subprocess.Popen[bytes]:
    """Starts this client in a process of its own (a test's CPU never stalls it), writing to ``log``."""
    argv = [sys.executable, "-m", "tests.e2e.chaos_client", "--gateways", ",".join(gateways)]
    argv += ["--sync-rate", str(sync_rate), "--async-rate", str(async_rate), "--duration-s", str(duration_s)]
    argv += ["--out", str(out), "--t0-file", str(t0_file)]
    return subprocess.Popen(argv, cwd=Path(__file__).resolve().parents[2], stdout=log, stderr=subprocess.STDOUT)


def succeeded(record: dict[str, Any]) -> bool:
    """A request of the client's output that ended with its own answer."""
    return record["done_s"] is not None and record["output"] == record["input"][::-1]


def missing_afterwards(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The requests answered with their own output whose task does not read back completed with that
    output once the load has ended (a committed result lost)."""
    finals: dict[str, dict[str, Any]] = result["final_reads"]
    return [
        record
        for record in result["records"]
        if succeeded(record)
        and not (
            (final := finals.get(record["task_id"])) is not None
            and final["status"] == 200
            and final["state"] == "completed"
            and final["output"] == record["output"]
        )
    ]


@dataclass
class Verdict:
    """A run's records against the promise: each request ends with its own answer, once, from its own
    task, which reads back completed afterwards; a refusal is a 503 with Retry-After and an allowed code."""

    lost: list[dict[str, Any]]
    refusals: list[dict[str, Any]]
    wrong: list[dict[str, Any]]
    twice: list[dict[str, Any]]
    missing: list[dict[str, Any]]
    allowed: frozenset[str]

    def failures(self) -> list[str]:
        """What broke the promise (empty when nothing did)."""
        failures = []
        if self.lost:
            failures.append(f"{len(self.lost)} requests did not end with their own answer, e.g.: {self.lost[:5]}")
        if self.wrong:
            kinds = Counter((a["status"], a["code"], bool(a["retry_after"])) for a in self.wrong)
            allowed = "/".join(sorted(self.allowed))
            failures.append(f"{len(self.wrong)} refusals other than 503 {allowed} with Retry-After: {dict(kinds)}")
        if self.twice:
            failures.append(f"{len(self.twice)} requests answered twice or by another task, e.g.: {self.twice[:3]}")
        if self.missing:
            failures.append(
                f"{len(self.missing)} answered tasks do not read back completed afterwards, e.g.: {self.missing[:3]}"
            )
        return failures


def verdict(result: dict[str, Any], allowed_refusals: frozenset[str]) -> Verdict:
    records: list[dict[str, Any]] = result["records"]
    refusals = [a for r in records for a in (*r["attempts"], *r["reads"]) if a["status"] not in (200, 202)]
    twice = [
        r
        for r in records
        if succeeded(r)
        and (
            [a["task_id"] for a in r["attempts"] if a["status"] in (200, 202)] != [r["task_id"]]
            or any(a["status"] == 200 and a["task_id"] != r["task_id"] for a in r["reads"])
        )
    ]
    return Verdict(
        lost=[r for r in records if not succeeded(r)],
        refusals=refusals,
        wrong=[a for a in refusals if a["status"] != 503 or a["code"] not in allowed_refusals or not a["retry_after"]],
        twice=twice,
        missing=missing_afterwards(result),
        allowed=allowed_refusals,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--gateways", required=True, help="comma-separated base URLs")
    parser.add_argument("--sync-rate", type=float, default=150.0)
    parser.add_argument("--async-rate", type=float, default=20.0)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--t0-file", required=True, help="gets the load's start (time.monotonic()) as it begins")
    args = parser.parse_args()
    try:
        import uvloop
    except ImportError:
        result = asyncio.run(run(args))
    else:
        result = uvloop.run(run(args))
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
