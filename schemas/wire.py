"""Every name that crosses a process boundary: topics, consumer groups, Redis keys and channels, headers.

A *namespace* prefixes all of them so that several deployments (or tests) can share one Kafka
cluster and one Redis server without seeing each other's traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_NAMESPACE = "batchwire"
DEFAULT_REQUEST_PARTITIONS = 12
DEFAULT_BATCH_PARTITIONS = 8

IDEMPOTENCY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"
"""On an answer (its output or its error) that a retry got from the task its Idempotency-Key names."""
TRACEPARENT_HEADER = "traceparent"
"""W3C trace context: on HTTP requests, and on the Kafka records of requests and batches."""


@dataclass(frozen=True, slots=True)
class Names:
    """Wire names for one namespace."""

    namespace: str = DEFAULT_NAMESPACE

    # Kafka ---------------------------------------------------------------
    @property
    def request_topic(self) -> str:
        return f"{self.namespace}.requests"

    def batch_topic(self, model: str) -> str:
        return f"{self.namespace}.batches.{model}"

    @property
    def dead_letter_topic(self) -> str:
        return f"{self.namespace}.dead-letter"

    @property
    def batcher_group(self) -> str:
        return f"{self.namespace}.batchers"

    def worker_group(self, model: str) -> str:
        return f"{self.namespace}.workers.{model}"

    # Redis ---------------------------------------------------------------
    def task_key(self, task_id: str) -> str:
        return f"{self.namespace}:task:{{{task_id}}}"

    def task_channel(self, task_id: str) -> str:
        """In the task key's hash slot (the id is the hash tag of both): on Redis Cluster, the
        script that writes a task publishes its channel on the node that holds the task."""
        return f"{self.namespace}:events:{{{task_id}}}"

    def reply_channel(self, gateway_id: str) -> str:
        return f"{self.namespace}:reply:{gateway_id}"

    def credit_queue(self, model: str) -> str:
        """Idle workers' credits: a sorted set scored by when each worker frees."""
        return f"{self.namespace}:idle:{model}"

    def idempotency_key(self, scope: str, key: str) -> str:
        """A client's ``Idempotency-Key``, within its owner's ``scope``: names the task it created."""
        return f"{self.namespace}:idem:{scope}:{key}"

    def cached_answer(self, key: str) -> str:
        """A completed answer in the result cache, under its scoped key (``gateway.sharing.answer_keys``)."""
        return f"{self.namespace}:answer:{key}"

    def delivery_record(self, batch_id: str) -> str:
        """A batch that came back: its deliveries and what was in flight at each worker death (a hash)."""
        return f"{self.namespace}:deliveries:{batch_id}"

    def rate_bucket(self, client: str) -> str:
        """One client's token bucket, shared by every gateway."""
        return f"{self.namespace}:rate:{client}"

    @property
    def fleet(self) -> str:
        """Every process's last heartbeat: a hash of member name to beat."""
        return f"{self.namespace}:fleet"

    @property
    def replication_mark(self) -> str:
        """Written just before a worker's Redis ``WAIT``, so the wait covers results already stored."""
        return f"{self.namespace}:replication-mark"

    def replication_mark_of(self, task_id: str) -> str:
        """``replication_mark`` in ``task_id``'s hash slot: on a Redis Cluster, on the primary holding the task."""
        return f"{self.replication_mark}:{{{task_id}}}"
