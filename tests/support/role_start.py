"""A role started as a process of its own that should refuse to start: its exit status, output and time,
and what it left on Kafka."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

from aiokafka.admin import AIOKafkaAdminClient

EXIT_TIMEOUT_S = 20.0


def run_role(
    role: str,
    redis_url: str,
    kafka_bootstrap: str,
    namespace: str,
    tmp_path: Path,
    *,
    flags: tuple[str, ...] = (),
    exit_timeout_s: float = EXIT_TIMEOUT_S,
    **settings: str,
) -> tuple[int, str, float]:
    """Runs ``role`` to its end with these servers, ``flags`` and ``BATCHWIRE_*`` ``settings``: its exit
    status, its output, and how long it ran."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWIRE_")}
    env.update(
        BATCHWIRE_KAFKA_BOOTSTRAP=kafka_bootstrap,
        BATCHWIRE_REDIS_URL=redis_url,
        BATCHWIRE_NAMESPACE=namespace,
        BATCHWIRE_STACK_ENV=str(tmp_path / "no-stack.env"),
        **settings,
    )
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "batchwire.cli", role, *flags],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=exit_timeout_s,
        check=False,
    )
    return done.returncode, done.stderr + done.stdout, time.monotonic() - started


def topics_of(kafka_bootstrap: str, namespace: str) -> list[str]:
    async def listed() -> list[str]:
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        await admin.start()
        try:
            return [topic for topic in await admin.list_topics() if topic.startswith(namespace + ".")]
        finally:
            await admin.close()

    return asyncio.run(listed())


def assert_stopped_cleanly(code: int, output: str, elapsed_s: float, *expected: str, within_s: float = 10.0) -> None:
    assert code == 2, f"expected exit 2 (a settings error), got {code}:\n{output}"
    for text in expected:
        assert text in output, f"expected {text!r} in the output:\n{output}"
    assert "Traceback" not in output, output
    assert elapsed_s < within_s, f"took {elapsed_s:.1f} s to stop"
