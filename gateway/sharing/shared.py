"""Answers that requests share: from the result cache, or from one computation of identical requests.

Only a deterministic model's requests share (``gateway.sharing.answer_keys`` says which, and under which
key). A synchronous request is looked up in the cache (when ``cache_ttl_s`` is set), then joins the
computation of an identical request in flight (``gateway.sharing.collapsing``). An asynchronous request is
looked up in the cache only: its task must survive this gateway, so it goes on the bus as its own.
"""

from __future__ import annotations

from gateway.answers.replies import Replies
from gateway.answers.waiters import Watch
from gateway.clock import Clock
from gateway.publisher import TaskPublisher
from gateway.settings import GatewaySettings
from gateway.sharing.answer_keys import AnswerKeys
from gateway.sharing.collapsing import Collapser, Computed
from gateway.sharing.result_cache import CachedAnswers
from gateway.submission import Submission
from schemas.records import TaskState
from transport.ports import ResultCache, TaskStore


class SharedAnswers:
    """The gateway's cache look-ups and collapsed computations, behind one ``key`` rule."""

    def __init__(
        self,
        settings: GatewaySettings,
        store: TaskStore,
        publisher: TaskPublisher,
        replies: Replies,
        clock: Clock,
        cache: ResultCache | None,
        *,
        computed: Computed | None = None,
    ) -> None:
        """Without ``cache`` (or with ``cache_ttl_s`` 0) only collapsing applies. ``computed`` hears
        each completed computation's model and duration (the admission's service time)."""
        self.keys = AnswerKeys(settings)
        self._cached: CachedAnswers | None = None
        if cache is not None and settings.cache_ttl_s > 0:
            self._cached = CachedAnswers(cache, store, clock, ttl_s=settings.cache_ttl_s)
        keep = self._cached.keep if self._cached is not None else None
        self.collapser = Collapser(
            store, publisher, replies, clock, gateway_id=settings.gateway_id, keep=keep, computed=computed
        )

    @property
    def alive(self) -> bool:
        return self.collapser.alive

    async def start(self) -> None:
        await self.collapser.start()

    async def close(self) -> None:
        await self.collapser.close()

    async def cached(self, key: str, request: Submission, *, wait: bool) -> TaskState | None:
        """The request's task, ended ``completed`` from the cache, or None (no cache, a miss, a bypass)."""
        if self._cached is None:
            return None
        return await self._cached.answer(key, request.task_id, request.model, request.owner, wait=wait)

    def joins(self, key: str, request: Submission) -> bool:
        """Whether a synchronous request would now join an identical computation in flight (``computed``
        attaches it, unless that computation ended meanwhile)."""
        return self.collapser.joins(key, request)

    async def computed(self, key: str, request: Submission, disconnected: Watch | None) -> TaskState:
        """A synchronous request's end state, from the computation it shares (see ``Collapser.answer``)."""
        return await self.collapser.answer(key, request, disconnected)
