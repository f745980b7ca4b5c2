"""Kafka and Redis together for one test session or one developer: `LocalStack`.

Blocking API on purpose (start-up is a few process launches and a readiness wait); async
callers use `await asyncio.to_thread(stack.restart_kafka)`.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from types import TracebackType

from infra.fetch_kafka import prepare_kafka
from infra.kafka_dist import KafkaRuntime
from infra.kafka_server import DEFAULT_START_TIMEOUT_S, KafkaServer
from infra.redis_server import RedisServer


class LocalStack:
    """One Kafka broker and one Redis server on free loopback ports, restartable in place.

    `work_dir` holds `kafka/` (config, data, kafka.log) and `redis/` (redis.log); when not
    given, a temporary folder is made and removed by `close()`. Addresses are fixed at
    construction and survive every stop/start, so clients can reconnect after a restart.
    """

    def __init__(
        self,
        work_dir: Path | None = None,
        *,
        runtime: KafkaRuntime | None = None,
        detached: bool = False,
    ) -> None:
        self._owns_work_dir = work_dir is None
        self._work_dir = Path(tempfile.mkdtemp(prefix="batchwire-stack-")) if work_dir is None else work_dir
        self._runtime = runtime
        self._detached = detached
        self._kafka: KafkaServer | None = None
        self.redis = RedisServer(self._work_dir / "redis", detached=detached)

    @property
    def kafka(self) -> KafkaServer:
        """The broker; built lazily because it needs the fetched jars."""
        if self._kafka is None:
            runtime = self._runtime if self._runtime is not None else prepare_kafka()
            self._kafka = KafkaServer(runtime, self._work_dir / "kafka", detached=self._detached)
        return self._kafka

    @property
    def work_dir(self) -> Path:
        return self._work_dir

    @property
    def kafka_bootstrap(self) -> str:
        """`127.0.0.1:PORT` of the broker."""
        return self.kafka.bootstrap

    @property
    def redis_url(self) -> str:
        """`redis://127.0.0.1:PORT/0`."""
        return self.redis.url

    def start(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> None:
        """Start whichever of the two is not running; return once both serve."""
        try:
            self.start_redis()
            self.start_kafka(timeout_s)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop both (SIGTERM, then SIGKILL after a timeout); the work folder stays."""
        try:
            if self._kafka is not None:
                self._kafka.stop()
        finally:
            self.redis.stop()

    def close(self) -> None:
        """`stop()`, then delete the work folder if this object made it."""
        self.stop()
        if self._owns_work_dir:
            shutil.rmtree(self._work_dir, ignore_errors=True)

    def start_kafka(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> None:
        self.kafka.start(timeout_s)

    def stop_kafka(self) -> None:
        self.kafka.stop()

    def kill_kafka(self) -> None:
        """SIGKILL the broker (a crash); `start_kafka()` recovers it from its data."""
        self.kafka.kill()

    def restart_kafka(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> None:
        """Clean stop and start on the same port and data; returns once it serves again."""
        self.kafka.stop()
        self.kafka.start(timeout_s)

    def start_redis(self) -> None:
        self.redis.start()

    def stop_redis(self) -> None:
        self.redis.stop()

    def restart_redis(self) -> None:
        """Stop and start on the same port; the data is gone (no persistence)."""
        self.redis.stop()
        self.redis.start()

    def __enter__(self) -> LocalStack:
        try:
            self.start()
        except BaseException:
            self.close()  # `__exit__` does not run when `__enter__` raises
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
