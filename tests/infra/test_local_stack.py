"""A `LocalStack` that fails to start leaves nothing behind: no server, no temporary folder."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from infra.errors import ServiceStartError
from infra.kafka_dist import KafkaRuntime
from infra.local_stack import LocalStack
from infra.redis_server import redis_pings

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(60)]


def test_a_stack_that_fails_to_start_stops_redis_and_removes_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    broken = KafkaRuntime(java=Path("/bin/false"), libs_dir=tmp_path / "no-libs")  # the storage format fails
    stack = LocalStack(runtime=broken)

    with pytest.raises(ServiceStartError, match="kafka-storage format failed"), stack:
        pass

    assert not redis_pings(stack.redis.port), "Redis, started first, is stopped"
    assert not stack.work_dir.exists(), f"the temporary folder {stack.work_dir} is removed"
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())
