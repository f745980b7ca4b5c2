"""The per-user Kafka cache: what a fetch or a CDS training run killed midway left is cleared by the next one."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.errors import ToolMissingError
from infra.kafka_cds import cds_archive_path, ensure_cds_archive
from infra.kafka_dist import KafkaRuntime, fetch_kafka_libs


def test_a_fetch_removes_the_jars_a_killed_fetch_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    libs = tmp_path / "kafka" / "libs"
    stale = tmp_path / "kafka" / ".libs-staging-99999999"
    stale.mkdir(parents=True)
    (stale / "kafka_2.13.jar").write_bytes(b"half a jar")
    monkeypatch.setenv("PATH", str(tmp_path / "no-tools"))

    with pytest.raises(ToolMissingError, match="mvn not found"):
        fetch_kafka_libs(libs)

    assert not stale.exists(), "a killed fetch's staging folder is left"


def test_a_training_run_removes_the_archive_a_killed_run_left(tmp_path: Path) -> None:
    libs = tmp_path / "libs"
    libs.mkdir()
    runtime = KafkaRuntime(java=Path("/bin/false"), libs_dir=libs)  # training fails at once
    archive = cds_archive_path(runtime)
    archive.parent.mkdir(parents=True)
    stale = archive.with_name(f".{archive.name}.99999999.tmp")
    stale.write_bytes(b"half an archive")

    assert ensure_cds_archive(runtime) is None

    assert not stale.exists(), "a killed training run's partial archive is left"
