"""TaskStore contract, idempotency keys re-bound: a retry of a task that ended without being computed
replaces the key's task, atomically, and never a binding that moved on."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.keys import idempotency
from schemas.records import TaskStatus
from tests.support.task_states import state
from tests.support.transport_kits import StoreFactory

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("status", "code"),
    [(TaskStatus.EXPIRED, "deadline_exceeded"), (TaskStatus.CANCELLED, "cancelled")],
    ids=["expired", "cancelled"],
)
async def test_a_key_whose_task_ended_uncomputed_is_rebound_to_the_new_task(
    make_store: StoreFactory, status: TaskStatus, code: str
) -> None:
    store = await make_store()
    assert (await store.claim_key("o", "k", "task-a", "fp")).task_id == "task-a"
    await store.create(state("task-a", TaskStatus.QUEUED))
    if status is TaskStatus.CANCELLED:
        assert await store.cancel("task-a", code, "by its owner") is not None
    else:
        assert await store.apply([state("task-a", status, error_code=code)]) == [True]
    ended = await store.get("task-a")
    assert ended is not None and idempotency.starts_anew(ended), f"{ended} must count as not computed"

    rebound = await store.rebind_key("o", "k", "task-a", "task-b", "fp")

    assert (rebound.task_id, rebound.fingerprint) == ("task-b", "fp")
    again = await store.claim_key("o", "k", "task-c", "fp")
    assert again.task_id == "task-b", "later claims must see the new binding"


async def test_a_rebind_is_refused_once_the_key_names_another_task(make_store: StoreFactory) -> None:
    """A retry that read an old binding loses to whatever the key names now."""
    store = await make_store()
    await store.claim_key("o", "k", "task-a", "fp")
    await store.rebind_key("o", "k", "task-a", "task-b", "fp")

    late = await store.rebind_key("o", "k", "task-a", "task-c", "fp")

    assert late.task_id == "task-b", f"a rebind of a binding that moved on must change nothing, got {late}"
    assert (await store.claim_key("o", "k", "task-d", "fp")).task_id == "task-b"


async def test_racing_rebinds_of_one_ended_task_make_one_new_binding(make_store: StoreFactory) -> None:
    stores = [await make_store() for _ in range(3)]
    await stores[0].claim_key("o", "raced", "task-old", "fp")

    claims = await asyncio.gather(
        *(stores[i % 3].rebind_key("o", "raced", "task-old", f"task-{i}", "fp") for i in range(30))
    )

    winners = {claim.task_id for claim in claims}
    assert len(winners) == 1, f"every racing retry must get the same new task, got {winners}"
    assert winners != {"task-old"}
    assert (await stores[1].claim_key("o", "raced", "task-late", "fp")).task_id in winners


async def test_a_rebind_of_a_key_that_was_released_binds_it(make_store: StoreFactory) -> None:
    store = await make_store()
    await store.claim_key("o", "k", "task-a", "fp")
    await store.release_key("o", "k", "task-a")

    assert (await store.rebind_key("o", "k", "task-a", "task-b", "fp")).task_id == "task-b"


async def test_rebinding_keeps_scopes_apart(make_store: StoreFactory) -> None:
    store = await make_store()
    await store.claim_key("owner-a", "same", "task-a", "fp")
    await store.claim_key("owner-b", "same", "task-b", "fp")

    await store.rebind_key("owner-a", "same", "task-a", "task-c", "fp")

    assert (await store.claim_key("owner-b", "same", "task-x", "fp")).task_id == "task-b"


@pytest.mark.parametrize("bound_by", ["claim", "rebind"])
async def test_a_key_is_kept_as_long_as_the_result_it_names(make_store: StoreFactory, bound_by: str) -> None:
    """A task ends up to its timeout after its key was bound, and its result is kept the TTL from that
    end: a retry in the result's last part must find the key, not compute the task again."""
    ttl_s = 2.0
    store = await make_store(ttl_s=ttl_s)
    bound_at_s = time.monotonic()
    deadline_ms = int(time.time() * 1000 + ttl_s * 1000)  # the longest timeout the TTL allows
    if bound_by == "rebind":
        await store.claim_key("o", "k", "task-0", "fp", deadline_ms)
        bound = await store.rebind_key("o", "k", "task-0", "task-a", "fp", deadline_ms)
    else:
        bound = await store.claim_key("o", "k", "task-a", "fp", deadline_ms)
    assert bound.task_id == "task-a"
    await store.create(state("task-a", TaskStatus.QUEUED))
    await asyncio.sleep(ttl_s * 0.75)  # the task waits most of its timeout, then ends
    assert await store.apply([state("task-a", TaskStatus.COMPLETED, output="done")]) == [True]
    await asyncio.sleep(max(0.0, bound_at_s + ttl_s + 0.25 - time.monotonic()))  # the TTL from the binding

    retry = await store.claim_key("o", "k", "task-b", "fp", deadline_ms + 3_000)

    assert await store.get("task-a") is not None, "the result must still be kept (its TTL runs from its end)"
    assert retry.task_id == "task-a", f"a retry while the result is kept must replay it, not bind {retry}"


async def test_a_key_outlives_the_ttl_while_its_task_may_still_end(make_store: StoreFactory) -> None:
    """A task may end up to its deadline after its key was bound, later than the TTL from the binding
    (a timeout longer than the result TTL): a retry meanwhile must find that task, not compute it again."""
    ttl_s = 1.0
    store = await make_store(ttl_s=ttl_s)
    deadline_ms = int(time.time() * 1000 + 4 * ttl_s * 1000)
    assert (await store.claim_key("o", "k", "task-a", "fp", deadline_ms)).task_id == "task-a"
    await store.create(state("task-a", TaskStatus.QUEUED))
    await asyncio.sleep(ttl_s * 1.5)  # past the TTL from the binding and the queued write, before the deadline
    await store.create(state("task-other", TaskStatus.QUEUED))  # a store may sweep what expired on a write

    retry = await store.claim_key("o", "k", "task-b", "fp", deadline_ms)

    assert retry.task_id == "task-a", f"a retry before the bound task's deadline must wait for it, not bind {retry}"
    assert await store.apply([state("task-a", TaskStatus.COMPLETED, output="done")]) == [True]
    again = await store.claim_key("o", "k", "task-c", "fp", deadline_ms)
    assert again.task_id == "task-a", f"a retry once the task ended must replay its result, not bind {again}"


@pytest.mark.parametrize(
    ("status", "fields"),
    [
        (TaskStatus.QUEUED, {}),
        (TaskStatus.BATCHED, {}),
        (TaskStatus.RUNNING, {}),
        (TaskStatus.COMPLETED, {"output": "done"}),
        (TaskStatus.FAILED, {"error_code": "backend_error"}),
        (TaskStatus.FAILED, {"error_code": "dead_lettered"}),
        (TaskStatus.FAILED, {"error_code": "output_too_large"}),
    ],
    ids=["queued", "batched", "running", "completed", "backend_error", "dead_lettered", "output_too_large"],
)
async def test_a_task_in_progress_or_computed_is_replayed_not_restarted(
    make_store: StoreFactory, status: TaskStatus, fields: dict[str, str]
) -> None:
    """The rule the gateway applies to what the store holds: only an uncomputed end starts anew."""
    store = await make_store()
    await store.create(state("task-a", TaskStatus.QUEUED))
    if status is not TaskStatus.QUEUED:
        assert await store.apply([state("task-a", status, **fields)]) == [True]
    stored = await store.get("task-a")
    assert stored is not None
    assert not idempotency.starts_anew(stored), f"{stored} must be replayed"


@pytest.mark.parametrize("code", sorted(idempotency.UNCOMPUTED_FAILURES))
async def test_a_failure_before_any_model_starts_anew(make_store: StoreFactory, code: str) -> None:
    store = await make_store()
    await store.create(state("task-a", TaskStatus.QUEUED))
    assert await store.apply([state("task-a", TaskStatus.FAILED, error_code=code)]) == [True]
    stored = await store.get("task-a")
    assert stored is not None and idempotency.starts_anew(stored)
