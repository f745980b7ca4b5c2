"""Each Redis Cluster primary's share of the commands a Kafka deployment sends at a given rate.

Starts a local Kafka broker (``LocalStack``) and a Redis Cluster of three primaries with a replica
each (``LocalRedisCluster``), then one gateway, one batcher and two sim workers (100 ms a call) over
them, with the roles' default replica wait (``WAIT`` per primary). It zeroes every node's
``INFO commandstats``, runs ``batchwire bench`` against the gateway, and prints each primary's
commands (those its scripts run included), its share of all of them, and its busiest commands. A
replica's commands are the copies of its primary's writes, so the shares count primaries only.

    .venv/bin/python bench/shard_share.py --rate 1000 --duration 20

Everything it started stops when it ends; the bench's raw output goes to ``bench/runs/shard-share``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import redis

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from infra.local_stack import LocalStack  # noqa: E402  (the repository's root is put on the path first)
from infra.redis_cluster import LocalRedisCluster  # noqa: E402
from tests.support.processes import launch  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="1000", help="requests per second (default 1000)")
    parser.add_argument("--duration", default="20", help="seconds of load after a 3 s warm-up (default 20)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="shard-share-"))
    (work / "roles").mkdir()
    with LocalStack() as stack, LocalRedisCluster(work / "cluster", replicas=1) as shards:
        deployment = launch(
            work / "roles",
            stack.kafka_bootstrap,
            shards.url,
            workers=2,
        )
        try:
            for node in shards.nodes:
                redis.Redis(port=node.port).config_resetstat()
            url = f"{deployment.gateway_urls[0]}/v1/inference"
            out = str(REPO / "bench" / "runs" / "shard-share")
            load = ["--rate", args.rate, "--duration", args.duration, "--warmup", "3", "--no-metrics", "--out", out]
            subprocess.run([sys.executable, "-m", "batchwire.cli", "bench", "--url", url, *load], check=True)
            calls = {port: redis.Redis(port=port).info("commandstats") for port in shards.primary_ports()}
        finally:
            deployment.stop()
    totals = {port: sum(stat["calls"] for stat in stats.values()) for port, stats in calls.items()}
    everything = sum(totals.values())
    print(f"\n{everything} Redis commands over {len(totals)} primaries at {args.rate} req/s")
    for port, total in sorted(totals.items(), key=lambda item: -item[1]):
        busiest = sorted(calls[port].items(), key=lambda item: -item[1]["calls"])[:4]
        named = ", ".join(f"{name.removeprefix('cmdstat_')} {stat['calls']}" for name, stat in busiest)
        print(f"  primary :{port}: {total} commands, {100 * total / everything:.1f} % ({named})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
