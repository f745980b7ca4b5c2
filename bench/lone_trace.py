"""Where a lone request's time goes over Kafka, read from its spans.

Starts the local stack (``batchwire stack up``; a broker that has run a while answers faster than a
fresh one, so a running stack is reused), an OTLP receiver (``tests.support.otlp_receiver``), and one
gateway, one batcher and two sim workers (100 ms a call) that export every span to it. Sends
``--requests`` synchronous requests one at a time, ``--gap-ms`` apart (after 5 unmeasured ones), and
prints the client's p50, then each span's median start and end in ms after the gateway accepted the
request: ``bus.wait`` (the request on Kafka, from its enqueue to the batcher's read), ``batcher.queue``
(read to sealed), ``batch.formed`` (the batch's send), ``worker.run``, ``backend`` (the call),
``result.store`` and ``reply``. Times that come from a record's millisecond field (the start of
``bus.wait`` and of ``worker.run``) are whole milliseconds.

    .venv/bin/python bench/lone_trace.py [--requests 30] [--env BATCHWIRE_REQUEST_LINGER_MS=0 ...]

The roles stop when it ends; the stack stays up (``batchwire stack down``).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from batchwire.settings import STACK_ENV, stack_env  # noqa: E402  (the repository's root is put on the path first)
from tests.support.otlp_receiver import OtlpReceiver  # noqa: E402
from tests.support.processes import launch  # noqa: E402
from tests.support.trace_checks import SpanRecord  # noqa: E402

WARM_UP = 5


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=30, help="lone requests measured (default 30)")
    parser.add_argument("--gap-ms", type=float, default=300.0, help="idle time before each request (default 300)")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for every role (repeatable)")
    args = parser.parse_args()
    extra = dict(item.split("=", 1) for item in args.env)
    subprocess.run([sys.executable, "-m", "batchwire.cli", "stack", "up"], cwd=REPO, check=True, capture_output=True)
    stack = stack_env(REPO / STACK_ENV)
    receiver = OtlpReceiver().start()
    latencies: list[float] = []
    deployment = launch(
        Path(tempfile.mkdtemp(prefix="lone-trace-")),
        stack["BATCHWIRE_KAFKA_BOOTSTRAP"],
        stack["BATCHWIRE_REDIS_URL"],
        workers=2,
        extra_env={"BATCHWIRE_OTLP_ENDPOINT": receiver.url, **extra},
    )
    try:
        url = f"{deployment.gateway_urls[0]}/v1/inference"
        for index in range(WARM_UP + args.requests):
            time.sleep(args.gap_ms / 1000)
            body = json.dumps({"input": f"lone {index} {time.time_ns()}"}).encode()
            started = time.perf_counter()
            request = urllib.request.Request(url, body, {"content-type": "application/json"})
            with urllib.request.urlopen(request) as answer:
                answer.read()
            if index >= WARM_UP:
                latencies.append((time.perf_counter() - started) * 1000)
    finally:
        deployment.stop()  # the roles flush their spans as they stop
    receiver.stop()
    print(f"client p50 {statistics.median(latencies):.2f} ms over {len(latencies)} lone requests")
    for name, (start, end, count) in offsets(receiver.spans()).items():
        print(f"  {name:14s} start {start:8.2f}  end {end:8.2f} ms  ({count} spans)")
    return 0


def offsets(spans: list[SpanRecord]) -> dict[str, tuple[float, float, int]]:
    """Each span name's median start and end, in ms after its trace's ``gateway.accept`` began."""
    traces: dict[str, list[SpanRecord]] = collections.defaultdict(list)
    for span in spans:
        traces[span.trace_id].append(span)
    starts: dict[str, list[float]] = collections.defaultdict(list)
    ends: dict[str, list[float]] = collections.defaultdict(list)
    for trace in traces.values():
        roots = [span for span in trace if span.name == "gateway.accept"]
        if not roots:
            continue  # a batch's own trace: its spans are linked, not parented
        origin = roots[0].start_ns
        for span in trace:
            starts[span.name].append((span.start_ns - origin) / 1e6)
            ends[span.name].append((span.end_ns - origin) / 1e6)
    table = {
        name: (statistics.median(starts[name]), statistics.median(ends[name]), len(starts[name])) for name in starts
    }
    return dict(sorted(table.items(), key=lambda item: item[1][0]))


if __name__ == "__main__":
    sys.exit(main())
