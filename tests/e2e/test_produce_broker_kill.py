"""The broker that leads the batch topic killed (-9) while the batcher produces to it: every request
is answered once, with its own answer, and every task a client was answered for reached a worker.
And a gateway's lag read after the group coordinator moved to another broker stays true.

A stack of its own (`batchwire stack up --brokers 3`, a plain Redis) in a state dir of its own;
topics with RF 3 and min ISR 2, so an acked write is on two brokers. The batch topic has one
partition, so every batch in flight at the kill goes to the killed broker, and a worker gets a batch
only from that topic. A client retries a 503 with the same
Idempotency-Key (the gateway's own request produce may hit the killed broker too), so each request
is one task however often it is sent.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition  # type: ignore[import-untyped, unused-ignore]
from aiokafka.admin import AIOKafkaAdminClient  # type: ignore[import-untyped, unused-ignore]
from aiokafka.admin.config_resource import (  # type: ignore[import-untyped, unused-ignore]
    ConfigResource,
    ConfigResourceType,
)
from aiokafka.errors import KafkaError  # type: ignore[import-untyped, unused-ignore]

from infra.kafka_cluster import OFFSETS_TOPIC
from infra.process import ServiceProcess
from infra.stack import ENV_FILE_NAME, KAFKA_ENV, REDIS_ENV, read_env_file
from schemas.codec import decode_batch
from schemas.records import Batch
from schemas.wire import Names
from tests.support.bus_records import partition_values
from tests.support.cluster_checks import group_offsets
from tests.support.eventually import eventually_sync
from tests.support.http_calls import many_at_once
from tests.support.processes import TerminalEvents, launch, stopped_after, task_states
from tests.support.stack_cli import discard_stack
from tests.support.stack_cli import stack_cli as _cli
from tests.support.transport_kits import ensure_topics
from transport.kafka.lag import KafkaQueueDepth, LagUnreadable

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.timeout(300)]

RATE_PER_S = 25.0
BEFORE_KILL_S = 2.0
AFTER_KILL_S = 8.0
RETRY_S = 0.2
REQUEST_DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("broker-kill") / "state"
    started = time.monotonic()
    done = _cli(path, "up", "--brokers", "3", "--redis-replicas", "0")
    try:
        assert done.returncode == 0, f"stack up exited {done.returncode}:\n{done.stderr}"
        print(f"\nstack up in {time.monotonic() - started:.1f} s")
        yield path
    finally:
        discard_stack(path)


@dataclass
class Asked:
    """One client request: sent (with one Idempotency-Key) until a final answer."""

    text: str
    sent_at: float
    attempts: int = 0
    refusals: Counter[str] = field(default_factory=Counter)
    status: int = 0
    body: dict[str, Any] = field(default_factory=dict)


async def ask(client: httpx.AsyncClient, url: str, asked: Asked) -> None:
    deadline = asked.sent_at + REQUEST_DEADLINE_S
    while True:
        asked.attempts += 1
        response = await client.post(
            f"{url}/v1/inference",
            json={"input": asked.text, "timeout_ms": 20_000},
            headers={"Idempotency-Key": asked.text},
        )
        asked.status, asked.body = response.status_code, response.json()
        if response.status_code != 503 or time.monotonic() > deadline:
            return
        asked.refusals[asked.body["error"]["code"]] += 1
        await asyncio.sleep(RETRY_S)  # a client's back-off before it retries a 503, not synchronization


async def load(url: str, stop: asyncio.Event, asked: list[Asked]) -> None:
    """Open loop at ``RATE_PER_S`` until ``stop``; returns once every request has its final answer."""
    async with httpx.AsyncClient(timeout=40, limits=many_at_once(500)) as client:
        tasks = []
        while not stop.is_set():
            one = Asked(f"broker-kill-{len(asked)}", time.monotonic())
            asked.append(one)
            tasks.append(asyncio.create_task(ask(client, url, one)))
            await asyncio.sleep(1 / RATE_PER_S)  # pacing the load, not synchronization
        await asyncio.gather(*tasks)


async def topic_replication(bootstrap: str, topic: str) -> tuple[list[list[int]], str]:
    """Each partition's replicas, and the topic's min.insync.replicas."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    await admin.start()
    try:
        [described] = await admin.describe_topics([topic])
        [configs] = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
    finally:
        await admin.close()
    entries = {entry[0]: entry[1] for entry in configs.resources[0][4]}
    return [list(p["replicas"]) for p in described["partitions"]], str(entries["min.insync.replicas"])


async def batch_records(bootstrap: str, topic: str) -> list[Batch]:
    """Every record on ``topic``[0], from the first offset to the end."""
    return [decode_batch(value) for value in await partition_values(bootstrap, topic)]


def leader_of(state_dir: Path, topic: str) -> dict[str, Any]:
    done = _cli(state_dir, "status", "--json")
    report = json.loads(done.stdout)
    leaders = [s for s in report["servers"] if s["kind"] == "kafka" and 0 in s["leads"].get(topic, [])]
    assert len(leaders) == 1, f"one broker leads {topic}[0]: {report['servers']}"
    server: dict[str, Any] = leaders[0]
    return server


def kill9(pid: int) -> None:
    process = ServiceProcess.attach(pid, [])
    assert process is not None, f"process {pid} is not running"
    os.kill(pid, signal.SIGKILL)
    assert process.wait_exit(10.0), f"process {pid} survived SIGKILL"


async def test_a_lag_read_at_a_broker_that_no_longer_coordinates_the_group_keeps_the_true_figure(
    state_dir: Path,
) -> None:
    """What a gateway meets once the batchers' group coordinator moved (a broker killed, restarted, and
    given its partitions back by the preferred-leader election): its cached coordinator, asked for the
    group's committed offsets, answers none, without an error. The lag must not read as every record
    the topic keeps (the outage this guards against: every request refused as overloaded)."""
    bootstrap = read_env_file(state_dir / ENV_FILE_NAME)[KAFKA_ENV]
    names = Names(f"t{uuid.uuid4().hex[:10]}")
    partitions = 4
    await ensure_topics(bootstrap, {names.request_topic: partitions})
    tps = [TopicPartition(names.request_topic, p) for p in range(partitions)]
    # acks=all: each record is replicated when sent, so the end offsets (the high watermark) hold it
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for n in range(40):
            await producer.send_and_wait(names.request_topic, b"r", partition=n % partitions)
    finally:
        await producer.stop()
    batcher = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=names.batcher_group, enable_auto_commit=False)
    await batcher.start()
    try:
        batcher.assign(tps)
        await batcher.commit(dict.fromkeys(tps, 8))  # 2 of each partition's 10 records still wait
    finally:
        await batcher.stop()

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    await admin.start()
    try:
        coordinator = await admin.find_coordinator(names.batcher_group)
        others = [b["node_id"] for b in (await admin.describe_cluster())["brokers"] if b["node_id"] != coordinator]
        assert others, "a three-broker stack has brokers besides the coordinator"
        answer = await admin.list_consumer_group_offsets(
            names.batcher_group, group_coordinator_id=others[0], partitions=tps
        )
    finally:
        await admin.close()
    assert answer == {}, f"Kafka's answer from a broker that is not the coordinator (no error raised): {answer}"

    deadline = time.monotonic() + 20
    while (true_lag := await _true_lag(bootstrap, names.request_topic, names.batcher_group)) != 8:
        assert time.monotonic() < deadline, f"the cluster never showed 2 waiting on each of 4 partitions: {true_lag}"
        await asyncio.sleep(0.2)  # polling the cluster until every record and commit shows, which nothing signals
    depth = KafkaQueueDepth(bootstrap, names, partitions, refresh_s=60)
    await depth.start()
    try:
        assert await depth.depth() == 8, "the true lag: 2 waiting on each of 4 partitions"
        depth._coordinator = others[0]  # the cached coordinator, after the role moved away from it
        with pytest.raises(LagUnreadable, match="no committed offset for 4 of the 4 partitions"):
            await depth.refresh()
        assert await depth.depth() == 8, "the last good figure stands, not the 40 records the topic keeps"
        assert await depth.refresh() == 8, "the next read finds the coordinator again"
    finally:
        await depth.close()


async def test_killing_the_batch_topics_leader_under_load_loses_no_batch_and_answers_each_request_once(
    state_dir: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    env = read_env_file(state_dir / ENV_FILE_NAME)
    bootstrap, redis_url = env[KAFKA_ENV], env[REDIS_ENV]
    settings = {
        "BATCHWIRE_BATCH_PARTITIONS": "1",
        "BATCHWIRE_REPLICATION_FACTOR": "3",
        "BATCHWIRE_MIN_INSYNC_REPLICAS": "2",
    }
    started = launch(tmp_path, bootstrap, redis_url, workers=1, sim_latency_ms=30, extra_env=settings)
    with stopped_after(request, started) as cluster:
        topic = Names(cluster.namespace).batch_topic("sim")
        replicas, min_isr = await topic_replication(bootstrap, topic)
        assert [len(r) for r in replicas] == [3] and min_isr == "2", f"{topic}: replicas {replicas}, min ISR {min_isr}"
        leader = leader_of(state_dir, topic)

        asked: list[Asked] = []
        stop = asyncio.Event()
        with TerminalEvents(redis_url, cluster.namespace) as events:
            loader = asyncio.create_task(load(cluster.gateway_urls[0], stop, asked))
            await asyncio.sleep(BEFORE_KILL_S)  # steady load before the kill
            batches_before = len(cluster.journal())
            assert batches_before > 0, f"no batch ran in {BEFORE_KILL_S:g} s of load:\n{cluster.logs()}"
            await asyncio.to_thread(kill9, leader["pid"])
            killed_at = time.monotonic()
            await asyncio.sleep(AFTER_KILL_S)  # the load goes on while the partition moves
            stop.set()
            await loader
            answered = [a for a in asked if a.status == 200]
            task_ids = [a.body["task_id"] for a in answered]
            await asyncio.to_thread(
                eventually_sync,
                lambda: all(t in events.states for t in task_ids),
                "each terminal event",
                timeout_s=15,
            )
            twice = events.twice()

        wrong = [a for a in asked if a.status != 200 or a.body.get("output") != a.text[::-1]]
        assert not wrong, (
            f"{len(wrong)} of {len(asked)} requests without their own answer, e.g. "
            f"{[(a.text, a.status, a.body) for a in wrong[:3]]}"
        )
        assert len(set(task_ids)) == len(asked), "each request is one task, whatever its retries"
        assert not twice, f"tasks that ended more than once: {twice}"
        ran = {task for batch in cluster.journal() if batch["outcome"] == "ok" for task in batch["task_ids"]}
        lost = [t for t in task_ids if t not in ran]
        assert not lost, f"answered tasks no worker ran: {task_states(redis_url, cluster.namespace, lost[:5])}"
        kept = await batch_records(bootstrap, topic)
        on_topic = {item.task_id for batch in kept for item in batch.items}
        missing = [t for t in task_ids if t not in on_topic]
        assert not missing, f"{len(missing)} answered tasks in no batch record on {topic}, e.g. {missing[:5]}"
        after = [a for a in asked if a.sent_at > killed_at]
        assert after, "requests were sent after the kill"
        for proc in cluster.procs:
            assert proc.alive(), f"{proc.name} died when the broker was killed:\n{proc.tail()}"

        batcher_log = (cluster.base / "batcher0.log").read_text(errors="replace")
        failed_produces = batcher_log.count("aiokafka.producer.sender: Got error produce response")
        assert failed_produces, "the batcher had a produce to the killed broker in flight (or sent one to it)"
        refusals = sum((a.refusals for a in asked), Counter[str]())
        slowest = max((a.attempts, a.text) for a in asked)
        copies = Counter(batch.batch_id for batch in kept)
        print(
            f"\nkilled broker {leader['node_id']} (leader of {topic}[0]) after {batches_before} batches; "
            f"{len(asked)} requests, all answered once; 503 retries {dict(refusals)} (most attempts: {slowest}); "
            f"batcher: {failed_produces} produce attempts failed at the client, "
            f"{batcher_log.count('replaced the producer')} producer replacements, "
            f"{batcher_log.count('could not hand batch')} batch sends retried; {len(kept)} batch records, "
            f"{sum(n > 1 for n in copies.values())} batches written twice"
        )


async def _coordinator(bootstrap: str, group: str) -> int | None:
    """The group's coordinator as the cluster tells it now; None while it cannot tell (a broker down)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5_000)
    try:
        await admin.start()
        node: int = await admin.find_coordinator(group)
        return node
    except KafkaError:
        return None
    finally:
        await admin.close()


def _offsets_partition(group: str, partitions: int) -> int:
    """The offsets-topic partition whose leader coordinates ``group``: Kafka's
    ``Utils.abs(group.hashCode()) % partitions``, Java's String hash over UTF-16 code units."""
    units = group.encode("utf-16-be")
    code = 0
    for at in range(0, len(units), 2):
        code = (31 * code + int.from_bytes(units[at : at + 2], "big")) & 0xFFFFFFFF
    return (code & 0x7FFFFFFF) % partitions


async def _preferred_coordinator(bootstrap: str, group: str) -> int:
    """The broker the controller's preferred-leader election gives ``group``'s coordinator role."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5_000)
    try:
        await admin.start()
        [described] = await admin.describe_topics([OFFSETS_TOPIC])
    finally:
        await admin.close()
    partitions = {p["partition"]: p["replicas"] for p in described["partitions"]}
    preferred: int = partitions[_offsets_partition(group, len(partitions))][0]
    return preferred


async def _coordinated_by(bootstrap: str, group: str, broker: int, *, timeout_s: float = 60.0) -> None:
    """Wait until ``broker`` coordinates ``group`` (the test stack's election runs every few seconds)."""
    deadline = time.monotonic() + timeout_s
    while (now := await _coordinator(bootstrap, group)) != broker:
        assert time.monotonic() < deadline, f"the coordinator role never came to broker {broker} (at {now})"
        await asyncio.sleep(0.5)  # polling the cluster's state, which nothing signals


async def _true_lag(bootstrap: str, topic: str, group: str) -> int:
    """End offsets minus the group's committed offsets, asked of the group's coordinator now."""
    committed, ends = await group_offsets(bootstrap, group, topic)
    return sum(ends[p] - committed[p] for p in ends)


def _gauge(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    line = next(line for line in text.splitlines() if line.startswith("batchwire_request_topic_lag "))
    return float(line.split()[1])


async def _wedge(state_dir: Path, bootstrap: str, group: str, down: int) -> tuple[int, int | None, float]:
    """Under load: kill -9 the group's coordinator (and `down` - 1 more brokers), bring them back
    and wait until the role is home again. (victim, where the role went, when the cluster was whole)"""
    await asyncio.sleep(2.0)  # steady load first
    victim = await _coordinator(bootstrap, group)
    assert victim is not None, "the cluster names the group's coordinator"
    status = await asyncio.to_thread(_cli, state_dir, "status", "--json")  # the load's loop goes on meanwhile
    brokers = [s for s in json.loads(status.stdout)["servers"] if s["kind"] == "kafka"]
    victims = sorted(brokers, key=lambda s: s["node_id"] != victim)[:down]  # the coordinator first
    for broker in victims:
        await asyncio.to_thread(kill9, broker["pid"])
    if down == 1:
        deadline = time.monotonic() + 60
        while (moved_to := await _coordinator(bootstrap, group)) in (victim, None):  # the role moves away
            assert time.monotonic() < deadline, f"the coordinator role never left the killed broker {victim}"
            await asyncio.sleep(0.5)  # polling the cluster's state, which nothing signals
        await asyncio.sleep(2.0)  # load against the new coordinator, which the gateway finds
    else:
        # Two of three KRaft voters down: no quorum, so no leader moves until they are back.
        await asyncio.sleep(10.0)  # the fault's length, under load
        moved_to = await _coordinator(bootstrap, group)
    assert (await asyncio.to_thread(_cli, state_dir, "up", "--brokers", "3", "--redis-replicas", "0")).returncode == 0
    await _coordinated_by(bootstrap, group, victim)
    whole_at = time.monotonic()
    await asyncio.sleep(12.0)  # the load goes on past the 10 s the service has to be normal again
    return victim, moved_to, whole_at


WEDGE_RATE_PER_S = 200.0


# timing: it bounds how soon admission is normal again, which a machine shared with other tests can delay
@pytest.mark.timing
@pytest.mark.parametrize("down", [1, 2], ids=["coordinator", "coordinator and another for 10 s"])
async def test_the_group_coordinator_killed_and_given_back_leaves_the_gateway_admitting(
    state_dir: Path, tmp_path: Path, request: pytest.FixtureRequest, down: int
) -> None:
    """The outage this guards against: kill -9 the broker that coordinates the batchers' group (and,
    in the second case, one more for 10 s); the role moves to another broker, which the gateway's lag
    reader then asks. The brokers come back and the preferred-leader election (every few seconds in
    the test stack) gives the role back: the broker the gateway asks now answers no offsets. That must
    not read as every record the topic keeps (every request refused 503 ``overloaded``, for good)."""
    assert (
        _cli(state_dir, "up", "--brokers", "3", "--redis-replicas", "0").returncode == 0
    )  # whole, whatever ran before
    env = read_env_file(state_dir / ENV_FILE_NAME)
    bootstrap, redis_url = env[KAFKA_ENV], env[REDIS_ENV]
    settings = {"BATCHWIRE_REPLICATION_FACTOR": "3", "BATCHWIRE_MIN_INSYNC_REPLICAS": "2"}
    started = launch(tmp_path, bootstrap, redis_url, workers=2, sim_latency_ms=30, extra_env=settings)
    with stopped_after(request, started) as cluster:
        names = Names(cluster.namespace)
        url = cluster.gateway_urls[0]
        answers: list[tuple[float, int, str, bool]] = []  # (sent, status, error code, Retry-After)
        why: dict[float, str] = {}  # a refusal's or a failed call's message, by when it was sent
        stop = asyncio.Event()

        async def one(client: httpx.AsyncClient, n: int) -> None:
            sent = time.monotonic()
            try:
                response = await client.post(f"{url}/v1/inference", json={"input": f"wedge-{n}"})
            except httpx.TransportError as err:  # counted, and failed below, without ending the load
                answers.append((sent, 0, type(err).__name__, False))
                why[sent] = f"{err!r}, from {err.__context__!r}, after {time.monotonic() - sent:.2f} s"
                return
            code = response.json().get("error", {}).get("code", "") if response.status_code != 200 else ""
            answers.append((sent, response.status_code, code, "retry-after" in response.headers))
            if code:
                why[sent] = response.json()["error"]["message"]

        async def load() -> None:
            limits = many_at_once(200)
            async with httpx.AsyncClient(timeout=40, limits=limits) as client:
                tasks: list[asyncio.Task[None]] = []
                started = time.monotonic()
                while not stop.is_set():
                    tasks.append(asyncio.create_task(one(client, len(tasks))))
                    # open loop: request n goes at n / WEDGE_RATE_PER_S, however long the answers take
                    await asyncio.sleep(max(0.0, started + len(tasks) / WEDGE_RATE_PER_S - time.monotonic()))
                await asyncio.gather(*tasks)

        group = names.batcher_group
        # The role starts at its preferred broker, which the election gives it back to after the kill.
        await _coordinated_by(bootstrap, group, await _preferred_coordinator(bootstrap, group))
        async with asyncio.TaskGroup() as owner:
            loader = owner.create_task(load())
            try:
                victim, moved_to, whole_at = await _wedge(state_dir, bootstrap, group, down)
            finally:
                stop.set()
            await loader

        def shown(picked: list[tuple[float, int, str, bool]]) -> str:
            """The first and last of them, each sent how long after the cluster was whole, and why."""
            ends = picked[:1] + picked[-1:] if len(picked) > 1 else picked
            return "; ".join(f"sent at {sent - whole_at:+.2f} s: {why.get(sent, '')}" for sent, *_ in ends)

        late = [a for a in answers if a[0] > whole_at + 10]
        assert late, "requests were sent after the cluster was whole"
        refused = [a for a in late if a[1] != 200]
        refused_late = Counter((status, code) for _, status, code, _ in refused)
        assert not refused_late, (
            f"10 s after the cluster was whole, requests are still refused: {refused_late}; {shown(refused)}"
        )
        wrong = [a for a in answers if a[1] != 200 and not (a[1] == 503 and a[3])]
        bad = Counter((status, code) for _, status, code, _ in wrong)
        assert not bad, f"answers neither 200 nor 503 with Retry-After: {bad}; {shown(wrong)}"
        true_lag = await _true_lag(bootstrap, names.request_topic, group)
        await asyncio.to_thread(
            eventually_sync,
            lambda: _gauge(url) == true_lag,
            f"the gateway's lag gauge to read the group's true lag ({true_lag})",
            timeout_s=10,
        )
        print(
            f"\ncoordinator {victim} killed ({down} broker(s) down), role moved to {moved_to} and back; "
            f"{len(answers)} requests: "
            f"{Counter(status for _, status, _, _ in answers)}; true lag {true_lag}"
        )
