"""Runs one command with a local Kafka and Redis that every test in it shares: ``make test``'s runner.

``python -m tests.with_stack CMD ...`` starts one ``LocalStack`` (a broker and a Redis server on free
loopback ports), hands its addresses to CMD as the external infrastructure of ``infra.select``, and
stops it when CMD ends, passing on CMD's exit status. The parallel tier and the timing tier then
share one stack (each test keeps its own topics and key prefix), instead of one per pytest process.
Tests that stop or kill servers start private ones of their own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from types import FrameType

from infra.local_stack import LocalStack
from infra.select import EXTERNAL_KAFKA_ENV, EXTERNAL_REDIS_ENV


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m tests.with_stack CMD [ARG ...]", file=sys.stderr)
        return 2
    children: list[subprocess.Popen[bytes]] = []
    # Signals that come while CMD is being started, before this process knows it: CMD may run by then
    # (and may have told whoever sent the signal), so it is asked to end once known.
    deferred: list[int] | None = None

    def on_sigterm(signum: int, _frame: FrameType | None) -> None:
        # A CI timeout or `kill` signals this process alone: by default it would die at once and leave
        # the servers and CMD running. CMD is asked to end instead, and the servers stop once it has.
        if children:
            children[0].send_signal(signum)
        elif deferred is not None:
            deferred.append(signum)
        else:
            raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    with LocalStack() as stack:
        env = {**os.environ, EXTERNAL_KAFKA_ENV: stack.kafka_bootstrap, EXTERNAL_REDIS_ENV: stack.redis_url}
        deferred = []
        # Not subprocess.call: on Ctrl-C it SIGKILLs CMD a quarter second later, cutting its own clean-up short.
        with subprocess.Popen(argv, env=env) as child:
            children.append(child)
            for signum in deferred:
                child.send_signal(signum)
            return child.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
