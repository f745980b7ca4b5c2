"""The embedded task store's byte budget: ended tasks go oldest-ended first, live ones stay, and
``full`` speaks once only live tasks (and queued inputs) are left. Its age and count limits hold for
every write."""

from __future__ import annotations

import asyncio

import pytest

from batchwire.embedded import EmbeddedSettings
from batchwire.settings import SettingsError
from gpu_worker.settings import WorkerSettings
from schemas.records import InferenceRequest, TaskStatus
from tests.support.task_states import state
from transport.memory.requests import MemoryRequestBus, request_bytes
from transport.memory.store import ENTRY_BYTES, MemoryTaskStore, state_bytes
from transport.routing import Partitioner

pytestmark = pytest.mark.timeout(30)

OUTPUT = "x" * 10_000
RESULT_BYTES = state_bytes(state("t", TaskStatus.COMPLETED, output=OUTPUT))


async def _complete(store: MemoryTaskStore, task_id: str) -> None:
    await store.create(state(task_id, TaskStatus.QUEUED))
    assert await store.apply([state(task_id, TaskStatus.COMPLETED, output=OUTPUT)]) == [True]


async def test_ended_tasks_go_oldest_ended_first_and_live_ones_stay() -> None:
    store = MemoryTaskStore(max_bytes=5 * RESULT_BYTES)
    await store.create(state("live", TaskStatus.QUEUED))  # created first: the oldest entry of all
    for index in range(8):
        await _complete(store, f"done-{index}")

    assert store.held_bytes <= 5 * RESULT_BYTES, f"held {store.held_bytes} over the budget"
    assert await store.get("live") is not None, "a live task is never dropped for bytes"
    kept = [index for index in range(8) if await store.get(f"done-{index}") is not None]
    assert kept == list(range(8 - len(kept), 8)) and kept, f"the newest results must stay, kept {kept}"
    assert store.full("alpha") is None, "ended results can still make room"


async def test_a_store_held_exactly_at_its_budget_by_ended_tasks_makes_room_rather_than_refuse() -> None:
    store = MemoryTaskStore(max_bytes=3 * RESULT_BYTES)  # three results fill it to the byte
    for index in range(3):
        await _complete(store, f"done-{index}")
    assert store.held_bytes <= 3 * RESULT_BYTES

    assert store.full("alpha") is None, "an ended result can make room: nothing is refused"
    assert await store.get("done-2") is not None, "the newest result stays"


async def test_the_order_is_when_a_task_ended_not_when_it_was_created() -> None:
    store = MemoryTaskStore(max_bytes=2 * RESULT_BYTES + 4 * ENTRY_BYTES)
    await store.create(state("early", TaskStatus.QUEUED))
    await _complete(store, "a")
    await _complete(store, "b")
    assert await store.apply([state("early", TaskStatus.COMPLETED, output=OUTPUT)]) == [True]

    assert await store.get("a") is None, "the task that ended first goes first"
    assert await store.get("early") is not None and await store.get("b") is not None


async def _commit_all(bus: MemoryRequestBus) -> None:
    """What the batcher does once it sent the requests on in batches."""
    consumer = bus.consumer()

    async def ignore(_: frozenset[int]) -> None:
        return None

    await consumer.start(ignore, ignore)
    await consumer.commit({p: bus.log.end(p) for p in range(bus.partitioner.partitions)})


def _request(task_id: str, model: str = "alpha", size: int = 100_000) -> InferenceRequest:
    return InferenceRequest(task_id, model, "y" * size, 1, 2)


async def test_full_once_only_live_tasks_and_queued_inputs_are_left() -> None:
    bus = MemoryRequestBus(Partitioner(("alpha",), 1))
    store = MemoryTaskStore(max_bytes=400_000, queued=bus)
    await _complete(store, "old")
    for index in range(3):
        await bus.producer().send(_request(f"q{index}"))
    assert store.full("alpha") is None
    assert bus.queued_bytes() == 3 * request_bytes(_request("q0"))

    await bus.producer().send(_request("q3"))
    refusal = store.full("alpha")

    assert await store.get("old") is None, "an ended result makes room before anything is refused"
    assert refusal is not None and "BATCHWIRE_MAX_STORE_BYTES = 400000" in refusal, refusal
    await _commit_all(bus)
    assert bus.queued_bytes() == 0
    assert store.full("alpha") is None, "inputs the batcher took no longer count"


async def test_a_model_whose_queue_fills_its_share_does_not_shut_out_the_others() -> None:
    """A model that cannot keep up (hung, or flooded) is refused alone; the budget is split by model."""
    bus = MemoryRequestBus(Partitioner(("alpha", "beta"), 4))
    store = MemoryTaskStore(max_bytes=400_000, queued=bus)
    for index in range(2):
        await bus.producer().send(_request(f"a{index}"))
    assert store.full("alpha") is not None
    refusal = store.full("alpha")
    assert refusal is not None and "'alpha'" in refusal and "over 2 models" in refusal, refusal
    assert store.full("beta") is None, "the other model keeps its share"
    assert bus.queued_bytes("beta") == 0 and bus.queued_bytes() == bus.queued_bytes("alpha")


async def test_a_key_goes_with_its_task() -> None:
    """A retry after the task was dropped starts anew instead of waiting for a state that is gone."""
    store = MemoryTaskStore(max_bytes=2 * RESULT_BYTES)
    await store.claim_key("o", "k", "t0", "fp")
    await _complete(store, "t0")
    for index in range(1, 4):
        await _complete(store, f"t{index}")
    assert await store.get("t0") is None

    assert (await store.claim_key("o", "k", "fresh", "fp")).task_id == "fresh"


async def test_keys_count_against_the_budget() -> None:
    store = MemoryTaskStore(max_bytes=10 * ENTRY_BYTES)
    for index in range(20):
        await store.claim_key("o", f"k{index}", f"t{index}", "fp")
    assert store.full("alpha") is not None, "keys of live tasks hold memory too"
    for index in range(20):
        await store.release_key("o", f"k{index}", f"t{index}")
    assert store.held_bytes == 0 and store.full("alpha") is None


async def test_a_task_written_again_after_its_result_expired_is_live_not_dropped_for_bytes() -> None:
    """A missing task takes any state (as in Redis): one that ended, expired and is then written short
    of its end (a batch delivered again) is live, and a live task is never dropped to make room."""
    ttl_s = 0.5
    store = MemoryTaskStore(ttl_s, max_bytes=3 * RESULT_BYTES)
    await _complete(store, "again")
    await asyncio.sleep(ttl_s * 1.5)  # its result expires
    assert await store.apply([state("again", TaskStatus.RUNNING)]) == [True]
    for index in range(4):
        await _complete(store, f"done-{index}")

    running = await store.get("again")
    assert running is not None and running.status is TaskStatus.RUNNING, f"a live task was dropped: {running}"


async def test_the_count_limit_drops_ended_tasks_first_and_keeps_a_live_one_and_its_key() -> None:
    """A task waiting in a backlog was written before the results that ended since: the count limit
    drops those, the oldest-ended first, not the live task (a 404 for a queued task, its key freed)."""
    store = MemoryTaskStore(max_tasks=3)
    await store.claim_key("o", "k", "live", "fp")
    await store.create(state("live", TaskStatus.QUEUED))
    for index in range(4):
        await _complete(store, f"done-{index}")

    assert await store.get("live") is not None, "a live task is never dropped while ended ones can go"
    assert (await store.claim_key("o", "k", "retry", "fp")).task_id == "live"
    assert await store.get("done-0") is None and await store.get("done-3") is not None, "the oldest-ended go first"


@pytest.mark.parametrize("max_bytes", [None, 1 << 30], ids=["no budget", "budget"])
async def test_at_the_count_limit_of_live_tasks_full_refuses_and_no_live_task_is_dropped(max_bytes: int | None) -> None:
    """With only live tasks left the count limit has nothing it may drop: ``full`` refuses the next
    submit (503), as it does at the byte budget, instead of the store dropping the oldest live task
    (a 404 for a queued task, its key freed for a second computation)."""
    store = MemoryTaskStore(max_tasks=3, max_bytes=max_bytes)
    await store.claim_key("o", "k", "live-0", "fp")
    for index in range(3):
        await store.create(state(f"live-{index}", TaskStatus.QUEUED))

    refusal = store.full("alpha")
    assert refusal is not None and "3 tasks not yet ended" in refusal, (
        f"expected a refusal at the count, got {refusal!r}"
    )
    assert await store.get("live-0") is not None
    await _complete(store, "done")  # a write that ``full`` does not hold back (a worker's result)
    assert await store.get("live-0") is not None, "a live task is never dropped for the count"
    assert (await store.claim_key("o", "k", "retry", "fp")).task_id == "live-0", "its key stays bound"


async def test_live_tasks_past_the_count_are_kept_when_no_ended_task_can_go() -> None:
    """Submits that passed ``full`` together (or a keyed retry's resend, which ``full`` does not check) may
    store more live tasks than the count: the next write drops none of them (a queued task's poll would
    404, its key freed for a second computation)."""
    store = MemoryTaskStore(max_tasks=3)
    await store.claim_key("o", "k", "live-0", "fp")
    for index in range(5):
        await store.create(state(f"live-{index}", TaskStatus.QUEUED))
    assert await store.apply([state("live-4", TaskStatus.RUNNING)]) == [True]

    kept = [index for index in range(5) if await store.get(f"live-{index}") is not None]
    assert kept == [0, 1, 2, 3, 4], f"expected every live task kept, kept live-{kept}"
    assert (await store.claim_key("o", "k", "retry", "fp")).task_id == "live-0", "its key stays bound"


async def test_claims_past_the_count_free_no_live_tasks_key() -> None:
    """At the count of live tasks, keyed submits still claim their keys before ``full`` refuses them (and
    they release them): two at once held one more key than the count, which freed the oldest, a live
    task's, so a retry with it started a second computation."""
    store = MemoryTaskStore(max_tasks=3)
    for index in range(3):
        await store.claim_key("o", f"k{index}", f"live-{index}", "fp")
        await store.create(state(f"live-{index}", TaskStatus.QUEUED))
    for index in (3, 4):  # two submits at once, each refused by ``full`` once it has claimed
        await store.claim_key("o", f"k{index}", f"refused-{index}", "fp")
    for index in (3, 4):
        await store.release_key("o", f"k{index}", f"refused-{index}")

    retry = await store.claim_key("o", "k0", "retry", "fp")
    assert retry.task_id == "live-0", f"expected the key bound to its live task live-0, got {retry.task_id}"


async def test_without_a_budget_nothing_is_dropped_for_bytes() -> None:
    store = MemoryTaskStore()
    for index in range(50):
        await _complete(store, f"t{index}")
    assert await store.get("t0") is not None
    assert store.full("alpha") is None


@pytest.mark.parametrize(("ttl_s", "max_tasks"), [(3600.0, 10), (1e-9, 200_000)], ids=["count", "age"])
async def test_synchronous_results_written_only_at_their_end_are_held_to_the_limits(
    ttl_s: float, max_tasks: int
) -> None:
    """A plain synchronous task is never created: the worker's terminal write is its only one."""
    store = MemoryTaskStore(ttl_s, max_tasks)
    for index in range(100):
        result = state(f"t{index}", TaskStatus.COMPLETED, output=OUTPUT, reply_to="gateway-1")
        assert await store.apply([result]) == [True]
    assert store.held_bytes <= 10 * RESULT_BYTES, f"{store.held_bytes} bytes held for 100 results"


def test_a_budget_that_cannot_hold_one_result_is_refused_naming_both_settings() -> None:
    with pytest.raises(SettingsError, match=r"BATCHWIRE_MAX_STORE_BYTES.*BATCHWIRE_MAX_OUTPUT_BYTES"):
        EmbeddedSettings(max_store_bytes=1000, worker=WorkerSettings(max_output_bytes=2000))
    with pytest.raises(SettingsError, match="BATCHWIRE_MAX_STORE_BYTES"):
        EmbeddedSettings(max_store_bytes=-1)
    assert EmbeddedSettings(max_store_bytes=0).max_store_bytes == 0, "0: no limit"
