"""Tests of `infra/`: the local Kafka + Redis stack, topic creation, infra selection."""
