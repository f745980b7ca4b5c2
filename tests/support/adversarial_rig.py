"""The attack rig: a real service process, a normal client beside the attacker, and the bounds.

Every adversarial test attacks a real process (``batchwire up``, or a Kafka-mode gateway with its
batcher and workers over the session's Kafka and Redis) through real sockets, while a :class:`Probe`
plays a normal client. :func:`unharmed` states what "one client must not hurt anyone else" means:
the normal client's sync p99 stays within ``P99_SLACK_MS`` (three quarters of a model call) of its
value without the attack and none of its requests fails, the process's RSS grows by at most
``RSS_GROWTH_BYTES``, and its file descriptors come back down once the attack ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from tests.support.eventually import eventually_sync
from tests.support.processes import Cluster, Proc

P99_SLACK_MS = 75.0
"""Three quarters of a sim call: the harms guarded against (a normal request waiting behind an
attacker's work, or for a slot it holds) cost a call (100 ms) or more, while a shared 2-core
machine's own stalls, met by an attack that hurts no one, reach half a call."""
RSS_GROWTH_BYTES = 50 * 1024 * 1024
ONE_PER_CALL: dict[str, float] = {"rate_per_s": 10.0, "baseline_s": 4.0, "min_during_s": 5.0}
"""The normal client at one request per sim call, for attacks whose own work a faster probe would meet
more often on two shared cores: a stuck model's flood, three times a model's capacity, a thousand event
streams opening."""
FD_SLACK = 20
"""Descriptors a gateway may hold beyond its baseline once an attack ended (pooled connections)."""


@dataclass
class Service:
    """A running service under attack; ``pid`` is the process that serves HTTP."""

    mode: str
    url: str
    proc: Proc
    cluster: Cluster | None = None

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"

    @property
    def port(self) -> int:
        port = urlsplit(self.url).port
        assert port is not None
        return port

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_bytes(self) -> int:
        """Resident memory of the serving process (VmRSS)."""
        with open(f"/proc/{self.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError(f"no VmRSS for pid {self.pid}")

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def alive(self) -> bool:
        return self.proc.alive()

    def tail(self, lines: int = 40) -> str:
        if self.cluster is not None:
            return self.cluster.logs()
        return self.proc.tail(lines)


ServiceFactory = Callable[..., Service]
"""Starts a service with extra flags (the ``*_service_factory`` fixtures)."""


def attacker_output(module: str, *args: str, timeout_s: float) -> str:
    """Runs an attack in a process of its own (``python -m module args``; the module lowers its own
    CPU priority: on a small test machine the attacker's CPU use would otherwise be what the probe
    measures, not the service's) and returns what it printed; fails with its stderr if it failed."""
    done = subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout_s, check=False
    )
    assert done.returncode == 0, f"the attacker's process failed: {done.stderr[-2000:]}"
    return done.stdout


@dataclass
class ProbeStats:
    latencies_ms: list[float]
    failures: list[str]

    @property
    def count(self) -> int:
        return len(self.latencies_ms) + len(self.failures)

    def percentile(self, q: float) -> float:
        """The ``q`` quantile (a whole percent), interpolated between ranks as numpy does by default.
        A window holds some 30 to 150 answers: nearest rank would make its p99 the one slowest answer,
        so one scheduler stall of the shared test machine would decide the bound alone."""
        if len(self.latencies_ms) < 2:
            return self.latencies_ms[0] if self.latencies_ms else float("inf")
        return statistics.quantiles(self.latencies_ms, n=100, method="inclusive")[round(q * 100) - 1]

    @property
    def p50_ms(self) -> float:
        return self.percentile(0.50)

    @property
    def p99_ms(self) -> float:
        return self.percentile(0.99)

    def __str__(self) -> str:
        return (
            f"{self.count} requests, p50 {self.p50_ms:.1f} ms, p99 {self.p99_ms:.1f} ms, "
            f"{len(self.failures)} failed {self.failures[:3]}"
        )


@dataclass
class Probe:
    """A normal client: synchronous submits at a steady rate, each checked against its own input.

    It runs in a process of its own (``python -m tests.support.adversarial_rig``), so that neither the
    attacker's Python code nor the test's threads share its interpreter lock: its latencies are the
    service's. At the default 10 requests/s with two 100 ms sim workers every request finds an idle
    worker, so an attack's harm shows in full. The test's side samples the service's RSS and open
    descriptors, so the peak during an attack is seen.
    """

    service: Service
    rate_per_s: float = 10.0
    timeout_s: float = 10.0
    model: str | None = None
    peak_rss_bytes: int = 0
    peak_fds: int = 0
    _latencies: list[float] = field(default_factory=list)
    _failures: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _done: threading.Event = field(default_factory=threading.Event)

    @contextmanager
    def running(self) -> Iterator[Probe]:
        args = [sys.executable, "-m", "tests.support.adversarial_rig", self.service.url, str(self.rate_per_s)]
        args += [str(self.timeout_s), self.model or ""]
        child = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        reader = threading.Thread(target=self._read, args=(child,), name="probe-reader", daemon=True)
        sampler = threading.Thread(target=self._sample_until_done, name="probe-sampler", daemon=True)
        reader.start()
        sampler.start()
        try:
            yield self
        finally:
            assert child.stdin is not None
            child.stdin.close()  # the probe's signal to stop: it lets its last requests finish
            try:
                child.wait(self.timeout_s + 5)
            finally:
                if child.poll() is None:
                    child.kill()
                self._done.set()
                reader.join(5)
                sampler.join(5)
                assert child.stdout is not None
                child.stdout.close()

    def stats(self) -> ProbeStats:
        """What the probe saw since it started (or since the last ``restart_window``)."""
        with self._lock:
            return ProbeStats(list(self._latencies), list(self._failures))

    def restart_window(self) -> None:
        with self._lock:
            self._latencies.clear()
            self._failures.clear()
            self.peak_rss_bytes = 0
            self.peak_fds = 0

    def _read(self, child: subprocess.Popen[str]) -> None:
        assert child.stdout is not None
        for line in child.stdout:
            kind, _, rest = line.rstrip("\n").partition(" ")
            with self._lock:
                if kind == "ok":
                    self._latencies.append(float(rest))
                else:
                    self._failures.append(rest)

    def _sample_until_done(self) -> None:
        while not self._done.wait(0.1):
            try:
                rss, fds = self.service.rss_bytes(), self.service.open_fds()
            except (OSError, AssertionError):
                continue  # the process is gone: the probe's requests fail and say so
            with self._lock:
                self.peak_rss_bytes = max(self.peak_rss_bytes, rss)
                self.peak_fds = max(self.peak_fds, fds)


async def _probe(url: str, rate_per_s: float, timeout_s: float, model: str) -> None:
    """The probe process: requests at a steady rate until its stdin closes; one line per outcome."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_reader(sys.stdin.fileno(), lambda: stop.set() if not sys.stdin.readline() else None)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=16)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        tasks: set[asyncio.Task[None]] = set()
        next_at = time.monotonic()
        n = 0
        while not stop.is_set():
            n += 1
            body: dict[str, object] = {"input": f"probe-{n}-{os.urandom(3).hex()}"}
            if model:
                body["model"] = model
            task = asyncio.create_task(_probe_one(client, body))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            next_at += 1.0 / rate_per_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, next_at - time.monotonic()))
        if tasks:
            await asyncio.wait(tasks)


async def _probe_one(client: httpx.AsyncClient, body: dict[str, object]) -> None:
    started = time.monotonic()
    try:
        response = await client.post("/v1/inference", json=body)
    except httpx.HTTPError as err:
        print(f"fail {type(err).__name__}: {err}".replace("\n", " "), flush=True)
        return
    elapsed_ms = (time.monotonic() - started) * 1000
    if response.status_code != 200:
        print(f"fail {response.status_code} {response.text[:200]}".replace("\n", " "), flush=True)
    elif response.json().get("output") != str(body["input"])[::-1]:
        print(f"fail wrong output {response.text[:200]}".replace("\n", " "), flush=True)
    else:
        print(f"ok {elapsed_ms:.3f}", flush=True)


@dataclass
class Harm:
    """What a normal client saw without and with the attack, and what the process used."""

    baseline: ProbeStats
    during: ProbeStats
    rss_before: int
    rss_peak: int
    fds_before: int
    fds_peak: int
    fds_after: int

    def p99_rose(self, slack_ms: float = P99_SLACK_MS) -> bool:
        """Whether the normal client's p99 during the attack passed its baseline p99 plus ``slack_ms``."""
        return self.during.p99_ms > self.baseline.p99_ms + slack_ms

    def __str__(self) -> str:
        return (
            f"baseline: {self.baseline}; during: {self.during}; RSS {self.rss_before >> 20} -> peak "
            f"{self.rss_peak >> 20} MiB; fds {self.fds_before} -> peak {self.fds_peak} -> {self.fds_after}"
        )


def unharmed(
    service: Service,
    attack: Callable[[], object],
    *,
    baseline_s: float = 2.0,
    min_during_s: float = 2.5,
    rate_per_s: float = 20.0,
    model: str | None = None,
    p99_slack_ms: float = P99_SLACK_MS,
    check_p99: bool = True,
    rss_growth_bytes: int = RSS_GROWTH_BYTES,
    fds_settle_s: float = 30.0,
) -> Harm:
    """Runs ``attack`` (blocking, from this thread) while a :class:`Probe` plays a normal client, and
    asserts the bounds of the module docstring. The probe keeps going until ``min_during_s`` passed,
    so a short attack is still measured over enough requests: what makes a p99 trustworthy is the
    count of answers in a window (40 and 50 by default), not its length."""
    probe = Probe(service, rate_per_s=rate_per_s, model=model)
    with probe.running():
        eventually_sync(lambda: probe.stats().count >= 5, "the probe's first answers", timeout_s=15)
        probe.restart_window()
        fds_before = service.open_fds()
        rss_before = service.rss_bytes()
        until = time.monotonic() + baseline_s
        eventually_sync(lambda: time.monotonic() > until, "the baseline window", timeout_s=baseline_s + 5)
        baseline = probe.stats()
        probe.restart_window()
        started = time.monotonic()
        attack()
        eventually_sync(
            lambda: time.monotonic() - started >= min_during_s, "the attack window", timeout_s=min_during_s + 5
        )
        during = probe.stats()
        rss_peak, fds_peak = max(probe.peak_rss_bytes, service.rss_bytes()), probe.peak_fds
    try:
        eventually_sync(
            lambda: service.open_fds() <= fds_before + FD_SLACK, "descriptors to come back down", timeout_s=fds_settle_s
        )
    except AssertionError as err:
        raise AssertionError(f"{err}: {fds_before} before the attack, {service.open_fds()} now") from None
    harm = Harm(baseline, during, rss_before, rss_peak, fds_before, fds_peak, service.open_fds())
    assert service.alive(), f"the service died under attack: {harm}\n{service.tail()}"
    assert baseline.failures == [], f"the baseline already failed: {harm}"
    assert during.failures == [], f"a normal client's requests failed during the attack: {harm}"
    assert during.count >= min_during_s * rate_per_s * 0.8, f"the probe could not keep its rate: {harm}"
    if check_p99:
        assert not harm.p99_rose(p99_slack_ms), f"the normal client's p99 rose too much: {harm}"
    assert rss_peak - rss_before <= rss_growth_bytes, f"RSS grew too much: {harm}"
    return harm


if __name__ == "__main__":
    asyncio.run(_probe(sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]))
