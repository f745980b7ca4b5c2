"""``batchwire stack``: a local Kafka and Redis in the background, for trying batchwire and for tests.

A tool, not a role: only the CLI's ``stack`` command imports it, so nothing a role runs reaches the
local-stack code in ``infra``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from pathlib import Path

from batchwire import flags
from batchwire.operations import durability, ensure_role_topics
from batchwire.role_settings import shared_settings
from infra import cluster_stack, stack, stack_report
from infra.errors import InfraError, ShapeError
from infra.redis_server import checked_maxmemory


def _memory_size(text: str) -> str:
    try:
        return checked_maxmemory(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds ``stack``."""
    parser = sub.add_parser("stack")
    parser.add_argument("action", choices=["up", "down", "status"])
    flags.add(parser, "--state-dir", ".batchwire", str, "where the stack keeps data, logs and stack.env")
    flags.add(
        parser,
        "--redis-maxmemory",
        "512mb",
        _memory_size,
        "Redis's memory bound (bytes, or with kb/mb/gb; 0: none) when up starts it; over it writes are refused",
    )
    flags.add(parser, "--brokers", 1, int, "Kafka nodes up starts (more than 1: a KRaft cluster, internal topics RF 3)")
    flags.add(
        parser, "--redis-replicas", 0, int, "Redis replicas up starts beside the primary (1 or more: 3 Sentinels too)"
    )
    flags.add(
        parser,
        "--redis-cluster",
        0,
        int,
        "instead of one Redis: a Redis Cluster of this many primaries (3 or more), each with a replica",
    )
    parser.add_argument("--json", action="store_true", help="status: every server as JSON (pid, port, leaders, roles)")
    flags.shared(parser)
    flags.replication(parser)


def run(args: argparse.Namespace) -> int:
    state_dir = Path(args.state_dir)
    if args.action == "up":
        settings = shared_settings(args)  # refused before a server starts, rather than after, leaving them up
        shape = cluster_stack.Shape(args.brokers, args.redis_replicas, args.redis_cluster)
        try:
            up = cluster_stack.up_any(state_dir, shape, redis_maxmemory=args.redis_maxmemory)
        except ShapeError as err:  # a flag to change, as argparse's own refusals (exit 2)
            print(f"batchwire stack: {err}", file=sys.stderr)
            return 2
        except (InfraError, OSError) as err:  # OSError: a --state-dir that cannot be made or written
            print(f"stack up failed: {err}", file=sys.stderr)
            return 1
        shared = dataclasses.replace(settings, kafka_bootstrap=up.env[stack.KAFKA_ENV])
        asyncio.run(ensure_role_topics(shared, durability(args), True, shared.models))
        stack.print_up(up, state_dir, out=sys.stdout, err=sys.stderr)
        return 0
    if args.action == "down":
        return cluster_stack.cmd_down_any(state_dir, out=sys.stdout, err=sys.stderr)
    return stack_report.cmd_status_report(state_dir, as_json=args.json, out=sys.stdout)
