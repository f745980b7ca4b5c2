"""Where a lost task's trail ends on Kafka: for a failing e2e test's message, read before teardown.

Reads every record of the request topic and of a model's batch topic, and the batcher and worker
groups' committed offsets, and says for each task id which request records and batches hold it and
whether their offsets were committed: a request never produced, one read and committed but never
batched, or a batch produced and never run each point at a different part of the pipeline.
"""

from __future__ import annotations

import asyncio

from aiokafka import AIOKafkaConsumer, TopicPartition  # type: ignore[import-untyped, unused-ignore]
from aiokafka.admin import AIOKafkaAdminClient  # type: ignore[import-untyped, unused-ignore]

from schemas.codec import decode_batch
from schemas.wire import Names

READ_TIMEOUT_S = 30.0


async def _holding(
    bootstrap: str, topic: str, partitions: int, task_ids: list[str]
) -> dict[str, list[tuple[int, int, bytes]]]:
    """Per task id, the (partition, offset, value) of every record of ``topic`` whose value names it."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    found: dict[str, list[tuple[int, int, bytes]]] = {task: [] for task in task_ids}
    try:
        assigned = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(assigned)
        await consumer.seek_to_beginning(*assigned)
        ends = await consumer.end_offsets(assigned)
        left = {tp for tp in assigned if ends[tp] > 0}
        async with asyncio.timeout(READ_TIMEOUT_S):
            while left:
                for tp, records in (await consumer.getmany(timeout_ms=1000)).items():
                    for record in records:
                        for task in task_ids:
                            if record.value is not None and task.encode() in record.value:
                                found[task].append((tp.partition, record.offset, record.value))
                        if record.offset + 1 >= ends[tp]:
                            left.discard(tp)
    finally:
        await consumer.stop()
    return found


async def _layout(
    bootstrap: str, topics: list[str], groups: list[str]
) -> tuple[dict[str, int], dict[tuple[str, int], int]]:
    """(Each topic's partition count, every group's committed offsets by topic and partition.)"""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    await admin.start()
    try:
        described = await admin.describe_topics(topics)
        committed = {}
        for group in groups:
            for tp, meta in (await admin.list_consumer_group_offsets(group)).items():
                committed[(tp.topic, tp.partition)] = meta.offset
    finally:
        await admin.close()
    return {t["topic"]: len(t["partitions"]) for t in described}, committed


async def _trail(bootstrap: str, names: Names, model: str, task_ids: list[str]) -> list[str]:
    request_topic, batch_topic = names.request_topic, names.batch_topic(model)
    partitions, committed = await _layout(
        bootstrap, [request_topic, batch_topic], [names.batcher_group, names.worker_group(model)]
    )
    requests = await _holding(bootstrap, request_topic, partitions[request_topic], task_ids)
    batches = await _holding(bootstrap, batch_topic, partitions[batch_topic], task_ids)
    lines = []
    for task in task_ids:
        parts = [
            f"request p{p}@{o} (batchers committed {committed.get((request_topic, p))})" for p, o, _ in requests[task]
        ]
        for p, o, value in batches[task]:
            batch, done = decode_batch(value), committed.get((batch_topic, p))
            parts.append(f"batch {batch.batch_id} ({batch.flush_reason}) p{p}@{o} (workers committed {done})")
        lines.append(f"{task}: " + ("; ".join(parts) if parts else "on no request record and in no batch"))
    return lines


def trail(bootstrap: str, names: Names, model: str, task_ids: list[str]) -> list[str]:
    """One line per task id: the request records and batches on Kafka that hold it."""
    try:
        return asyncio.run(_trail(bootstrap, names, model, task_ids))
    except Exception as err:  # a diagnosis, never the failure itself
        return [f"could not read the trail: {type(err).__name__}: {err}"]
