"""Runs one command with a local Kafka and Redis that every test in it shares: ``make test``'s runner.

``python -m tests.with_stack CMD ...`` starts one ``LocalStack`` (a broker and a Redis server on free
loopback ports), hands its addresses to CMD as the external infrastructure of ``infra.select``, and
stops it when CMD ends, passing on CMD's exit status. The parallel tier and the timing tier then
share one stack (each test keeps its own topics and key prefix), instead of one per pytest process.
Tests that stop or kill servers start private ones of their own.
"""

from __future__ import annotations

import os
import subprocess
import sys

from infra.local_stack import LocalStack
from infra.select import EXTERNAL_KAFKA_ENV, EXTERNAL_REDIS_ENV


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m tests.with_stack CMD [ARG ...]", file=sys.stderr)
        return 2
    with LocalStack() as stack:
        env = {**os.environ, EXTERNAL_KAFKA_ENV: stack.kafka_bootstrap, EXTERNAL_REDIS_ENV: stack.redis_url}
        return subprocess.call(argv, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
