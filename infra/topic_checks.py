"""What a topic must be (partitions, replication factor, min.insync.replicas) and what is wrong with one.

Pure: the facts come from the brokers' metadata (``infra.topics``), the answers are messages that
say what the topic has, what was asked and the command that fixes it. Every topic is checked
before any is created, so a refused start leaves nothing half-made.
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.errors import InfraError

DEFAULT_MAX_REPLICATION_FACTOR = 3
RF_SETTING = "--replication-factor / BATCHWIRE_REPLICATION_FACTOR"
MIN_ISR_SETTING = "--min-insync-replicas / BATCHWIRE_MIN_INSYNC_REPLICAS"


class TopicError(InfraError):
    """A topic could not be created, or does not have what was asked of it."""


class TopicConfigError(TopicError):
    """What was asked cannot be had, or an existing topic has less: retrying cannot fix it."""


@dataclass(frozen=True, slots=True)
class Durability:
    """The replication asked for; ``None`` takes the default from the cluster's size."""

    replication_factor: int | None = None
    min_insync_replicas: int | None = None

    def resolve(self, brokers: int, bootstrap: str) -> Replication:
        """RF defaults to the smaller of 3 and ``brokers``; min ISR to RF - 1, at least 1."""
        if self.replication_factor is not None and self.replication_factor < 1:
            raise TopicConfigError(
                f"the replication factor must be at least 1, got {self.replication_factor} ({RF_SETTING})"
            )
        if self.min_insync_replicas is not None and self.min_insync_replicas < 1:
            raise TopicConfigError(
                f"min.insync.replicas must be at least 1, got {self.min_insync_replicas} ({MIN_ISR_SETTING})"
            )
        if brokers < 1:
            raise TopicConfigError(f"the Kafka cluster at {bootstrap} reports no brokers in its metadata")
        rf = self.replication_factor or min(DEFAULT_MAX_REPLICATION_FACTOR, brokers)
        if rf > brokers:
            raise TopicConfigError(
                f"replication factor {rf} is larger than the {brokers} broker(s) the Kafka cluster at {bootstrap} "
                f"reports: ask for at most {brokers} ({RF_SETTING}) or start more brokers"
            )
        min_isr = self.min_insync_replicas or max(1, rf - 1)
        if min_isr > rf:
            raise TopicConfigError(
                f"min.insync.replicas {min_isr} is larger than the replication factor {rf}: no write could succeed "
                f"(ask for at most {rf}, {MIN_ISR_SETTING})"
            )
        return Replication(rf, min_isr)


@dataclass(frozen=True, slots=True)
class Replication:
    replication_factor: int
    min_insync_replicas: int


@dataclass(frozen=True, slots=True)
class ExistingTopic:
    """An existing topic as metadata shows it; ``replication_factor`` is its least replicated partition's."""

    name: str
    partitions: int
    replication_factor: int
    min_insync_replicas: int | None

    def problems(
        self, partitions: int, asked: Replication, bootstrap: str, setting: tuple[str, str] | None = None
    ) -> list[str]:
        """Why this topic cannot serve as asked; empty when it can (more than asked is fine). ``setting``:
        the flag and variable the count came from, named with both fixes (grow the topic, or ask less)."""
        found: list[str] = []
        if self.partitions < partitions and setting is not None:
            flag, variable = setting
            found.append(
                f"topic {self.name!r} exists with {self.partitions} partitions, and {flag} ({variable}) is "
                f"{partitions}: `batchwire topics grow {flag} {partitions}` adds partitions; or start this role "
                f"with {flag} {self.partitions}"
            )
        elif self.partitions < partitions:
            found.append(
                f"topic {self.name!r} exists with {self.partitions} partitions; wanted {partitions} "
                f"(`batchwire topics grow` adds partitions; or configure {self.partitions})"
            )
        if self.replication_factor < asked.replication_factor:
            found.append(
                f"topic {self.name!r} has replication factor {self.replication_factor}; "
                f"{asked.replication_factor} was asked ({RF_SETTING}): raise it with kafka-reassign-partitions.sh "
                f"--bootstrap-server {bootstrap} --reassignment-json-file PLAN.json --execute (PLAN.json lists "
                f"{asked.replication_factor} brokers for each partition), or ask for {self.replication_factor}"
            )
        if self.min_insync_replicas is not None and self.min_insync_replicas < asked.min_insync_replicas:
            found.append(
                f"topic {self.name!r} has min.insync.replicas {self.min_insync_replicas}; "
                f"{asked.min_insync_replicas} was asked ({MIN_ISR_SETTING}): raise it with kafka-configs.sh "
                f"--bootstrap-server {bootstrap} --alter --entity-type topics --entity-name {self.name} "
                f"--add-config min.insync.replicas={asked.min_insync_replicas}"
            )
        return found
