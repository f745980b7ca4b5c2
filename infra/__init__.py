"""Local infrastructure for development and tests: a real Kafka broker and Redis server.

Kafka runs from jars fetched by Maven (no Docker needed), Redis from the system binary.
Entry points: `infra.local_stack.LocalStack` (in-process), `infra.stack.stack_up` (detached
`batchwire stack up|down|status`) and `infra.select.provide_infra` (test selection).
"""
