"""Admission after a fault: once the fault is over and the workers keep up with a steady flow, no
request that its deadline leaves room for is refused. A model of the Kafka deployment (request
partitions and their committed offsets, a batch count, workers' credits, this gateway's admissions
on their way to the bus) runs under a simulated clock around the real ``Admission``: no I/O. Credits
expire by the wall clock, which stands still here: a gone worker's last credit stands, as it does
for its time to live."""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field

import pytest

from gateway.admission.gate import ANONYMOUS, Admission, Caller
from gateway.errors import Overloaded
from gateway.settings import GatewaySettings
from gateway.unseen import Ticket
from schemas.records import Credit
from transport.ports import Backlog

STEP_S = 0.05
READ_EVERY_S = 0.15
"""The Kafka lag reader's refresh (``transport.kafka.lag``)."""
STALE_AFTER_S = 5.0
"""Its counters' life without a good read, after which they are unknown (None)."""
SAMPLE_EVERY_S = 0.2
"""Admission's sampler (``gateway.admission.gate.SAMPLE_EVERY_S``)."""
RATE_PER_S = 200
TIMEOUT_MS = 30_000
CAPACITY_PER_S = 2_000
RECOVERED_WITHIN_S = 10.0
FAULTS = (
    "counters_unreadable",  # a lag read that fails: the last figure stands, then none (the reader reconnects)
    "committed_minus_one",  # a partition's committed offset reads -1 for a moment: its whole log counts, then not
    "commits_stalled",  # the group's coordinator moves: commits hardly land, batches still go
    "worker_gone",  # a worker dies; a new one starts, with no call made yet
    "workers_hung",  # every worker hangs: no batch goes, the model stalls
    "bus_slow",  # produces land seconds late: admissions the counters do not hold yet
    "bus_refuses",  # produces fail: admissions that never reach the queue
    "batches_unreadable",  # the batch topic's end offsets are not read: the batch count stands still
    "burst",  # fifteen times the steady flow for a while
)


@dataclass
class Worker:
    worker_id: str
    max_batch: int
    call_s: float
    free_at_s: float = 0.0
    called: bool = True
    """Whether it has finished a call (its credit states its call time)."""


@dataclass
class Deployment:
    """Two request partitions, one batcher that sends a batch to each idle worker, the lag reader's
    counters and the workers' credits, as one gateway's admission sees them."""

    faults: dict[str, tuple[float, float]]
    workers: list[Worker]
    commit_delay_s: float
    rnd: random.Random
    now_s: float = 0.0
    produced: list[int] = field(default_factory=lambda: [0, 0])
    handed: list[int] = field(default_factory=lambda: [0, 0])
    """Per partition, requests handed to a worker or expired: committable once ``commit_delay_s`` passed."""
    committed: list[int] = field(default_factory=lambda: [0, 0])
    finishing: deque[tuple[float, int]] = field(default_factory=deque)
    waiting: deque[tuple[int, float]] = field(default_factory=deque)
    """Requests on the bus no worker took yet: partition, deadline."""
    on_the_way: list[tuple[float, Ticket | None, bool]] = field(default_factory=list)
    """Admitted requests not on the bus yet: when they land, their ticket, whether the bus takes them."""
    batches: int = 0
    shown: Backlog | None = None
    read_at_s: float = 0.0
    batches_read: int = 0
    credits: list[Credit] = field(default_factory=list)

    def on(self, fault: str) -> bool:
        span = self.faults.get(fault)
        return span is not None and span[0] <= self.now_s < span[1]

    # QueueDepth, read by admission
    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def depth(self) -> int | None:
        return None if self.shown is None else self.shown.depth

    def backlog(self, model: str) -> Backlog | None:
        return self.shown

    def clock(self) -> float:
        return self.now_s

    # CreditPool, as far as admission reads it
    async def offered(self, model: str) -> list[Credit]:
        return list(self.credits)

    def read_counters(self) -> None:
        if self.on("counters_unreadable"):
            if self.now_s - self.read_at_s > STALE_AFTER_S:
                self.shown = None
            return
        depth = left = 0
        for partition, end in enumerate(self.produced):
            committed = self.committed[partition]
            if partition == 0 and self.on("committed_minus_one"):
                committed = 0  # counted from the log's start (``transport.kafka.lag``, never committed)
            depth += end - committed
            left += committed
        if not self.on("batches_unreadable"):
            self.batches_read = self.batches
        self.shown = Backlog(depth, left, self.batches_read, self.now_s)
        self.read_at_s = self.now_s

    def send(self, ticket: Ticket | None) -> None:
        """One admitted request: on the bus now, later, or never."""
        lands_at = self.now_s + (self.rnd.uniform(0.5, 3.0) if self.on("bus_slow") else 0.0)
        self.on_the_way.append((lands_at, ticket, not self.on("bus_refuses")))

    def land(self) -> None:
        landed, self.on_the_way = (
            [item for item in self.on_the_way if item[0] <= self.now_s],
            [item for item in self.on_the_way if item[0] > self.now_s],
        )
        for _, ticket, taken in landed:
            if taken:
                partition = sum(self.produced) % 2  # round-robin over the model's partitions
                self.produced[partition] += 1
                self.waiting.append((partition, self.now_s + TIMEOUT_MS / 1000))
                if ticket is not None:
                    ticket.sent()
            if ticket is not None:
                ticket.close()

    def work(self) -> None:
        while self.waiting and self.waiting[0][1] <= self.now_s:  # the batcher ends expired requests
            self.finishing.append((self.now_s + self.commit_delay_s, self.waiting.popleft()[0]))
        hung = self.on("workers_hung")
        for worker in self.workers:
            if hung:
                worker.free_at_s = max(worker.free_at_s, self.now_s + STEP_S)
            elif worker.free_at_s <= self.now_s and self.waiting:
                for _ in range(min(worker.max_batch, len(self.waiting))):
                    self.finishing.append((self.now_s + self.commit_delay_s, self.waiting.popleft()[0]))
                self.batches += 1
                worker.free_at_s = self.now_s + worker.call_s
                worker.called = True
        while self.finishing and self.finishing[0][0] <= self.now_s:
            self.handed[self.finishing.popleft()[1]] += 1
        if not self.on("commits_stalled"):
            self.committed = list(self.handed)
        elif self.rnd.random() < 0.05:  # now and then the counters see a request leave
            partition = self.rnd.randrange(2)
            self.committed[partition] = min(self.handed[partition], self.committed[partition] + 1)
        now_ms = int(time.time() * 1000)  # admission reads credits' expiry by the wall clock
        self.credits = [
            Credit(
                worker.worker_id,
                "a",
                0,
                1,
                now_ms,
                now_ms + 60_000,
                max_batch=worker.max_batch,
                busy_ms=round(worker.call_s * 1000) if worker.called else 0,
            )
            for worker in self.workers
            if not hung and worker.free_at_s <= self.now_s
        ]


def faults_of(rnd: random.Random) -> dict[str, tuple[float, float]]:
    faults = {}
    for fault in rnd.sample(FAULTS, rnd.randint(1, 3)):
        start_s = rnd.uniform(1.0, 8.0)
        if fault == "committed_minus_one":
            length_s = rnd.choice([0.15, 0.3, 0.6])
        elif fault == "counters_unreadable":
            length_s = rnd.choice([0.5, 2.0, 4.0, 8.0, 12.0])  # past STALE_AFTER_S: unknown, and a reconnection
        else:
            length_s = rnd.choice([0.5, 1.0, 2.0, 4.0, 6.0, 8.0])
        faults[fault] = (start_s, start_s + length_s)
    return faults


async def refusals_after_recovery(
    seed: int, shape: tuple[float, int, float] | None = None, faults: dict[str, tuple[float, float]] | None = None
) -> tuple[str, list[str]]:
    """Runs one random deployment through its faults and a steady flow; returns what it was and the
    refusals that came ``RECOVERED_WITHIN_S`` or later after the last fault ended. ``shape`` (call
    seconds, workers, commit delay) and ``faults`` replace the seed's choices."""
    rnd = random.Random(seed)
    call_s = rnd.choice([0.02, 0.1, 0.5, 1.0])
    count = rnd.choice([1, 2, 4])
    commit_delay_s = rnd.choice([0.0, 0.1, 0.2])
    if shape is not None:
        call_s, count, commit_delay_s = shape
    max_batch = round(CAPACITY_PER_S * call_s / count)
    deployment = Deployment(
        faults_of(rnd) if faults is None else faults,
        [Worker(f"w{n}", max_batch, call_s) for n in range(count)],
        commit_delay_s=commit_delay_s,
        rnd=rnd,
    )
    caller = Caller(client="ip:192.0.2.1") if seed % 2 else ANONYMOUS  # with and without a fair share
    settings = GatewaySettings(models=("a",), default_model="a")
    admission = Admission(settings, deployment, None, deployment, clock=deployment.clock)  # type: ignore[arg-type]
    recovered_s = max(end for _, end in deployment.faults.values()) + RECOVERED_WITHIN_S
    refusals: list[str] = []
    next_read_s = next_sample_s = 0.0
    owed = 0.0
    gone: Worker | None = None
    while deployment.now_s < recovered_s + 2.0:
        now_s = deployment.now_s
        if now_s >= next_read_s:
            deployment.read_counters()
            next_read_s += READ_EVERY_S
        if deployment.on("worker_gone") and gone is None:
            gone = deployment.workers.pop(0)
        elif gone is not None and not deployment.on("worker_gone"):
            deployment.workers.append(Worker(gone.worker_id + "-new", gone.max_batch, gone.call_s, called=False))
            gone = None
        owed += RATE_PER_S * STEP_S * (15 if deployment.on("burst") else 1)
        while owed >= 1:
            owed -= 1
            try:
                ticket = await admission.admit(caller, "a", TIMEOUT_MS)
            except Overloaded as refused:
                if now_s >= recovered_s:
                    refusals.append(f"at {now_s:.2f} s: {refused.message}")
                continue
            deployment.send(ticket)
        deployment.land()
        deployment.work()
        if now_s >= next_sample_s:
            await admission.read_worker_rates()
            admission.models()
            next_sample_s += SAMPLE_EVERY_S
        deployment.now_s = round(now_s + STEP_S, 9)
    what = (
        f"{count} worker(s) of {max_batch} per {call_s} s call, commits {deployment.commit_delay_s} s after, "
        f"{'a fair share' if caller is not ANONYMOUS else 'no fair share'}, faults {deployment.faults}"
    )
    return what, refusals


@pytest.mark.parametrize("seed", range(12))
async def test_a_steady_flow_the_workers_keep_up_with_is_admitted_soon_after_a_fault(seed: int) -> None:
    """Whatever the fault left in admission's state (a drain rate measured while commits stalled or the
    bus was slow, a stall, admissions no read holds), 200 requests/s to workers that take 2,000 are
    admitted again within ``RECOVERED_WITHIN_S`` of its end."""
    what, refusals = await refusals_after_recovery(seed)
    assert not refusals, f"{what}: {len(refusals)} refused, the first {refusals[0]}"


async def test_a_lone_client_of_one_worker_of_long_calls_is_not_cut_down_by_its_fair_share_from_the_start() -> None:
    """No fault: one worker of one-second calls that takes all that waits, commits 0.2 s after each batch,
    one client with a fair share at 200 requests/s. The first busy window used to close before any
    batch's size was known, so a queue that only gathered arrivals measured a drain far below the
    client's rate; its fair share then held it there (a window that kept up measures only what the
    share let in)."""
    what, refusals = await refusals_after_recovery(1, shape=(1.0, 1, 0.2), faults={"bus_refuses": (0.0, 0.0)})
    assert not refusals, f"{what}: {len(refusals)} refused, the first {refusals[0]}"
