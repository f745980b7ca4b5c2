"""The per-user Kafka cache: what a fetch or a CDS training run killed midway left is cleared by the next one,
and a failed training run is remembered only when the JVM failed."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra import kafka_cds
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


def test_a_training_run_that_fails_is_remembered_and_one_that_runs_out_of_time_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A JVM that refuses the run costs one training run; a slow machine's next start trains again."""
    libs = tmp_path / "libs"
    libs.mkdir()
    refusing = KafkaRuntime(java=Path("/bin/false"), libs_dir=libs)
    assert ensure_cds_archive(refusing) is None
    assert cds_archive_path(refusing).with_suffix(".failed").is_file()

    slow_java = tmp_path / "slow-java"
    slow_java.write_text("#!/bin/sh\nexec sleep 30\n")
    slow_java.chmod(0o755)
    slow = KafkaRuntime(java=slow_java, libs_dir=libs)
    monkeypatch.setattr(kafka_cds, "_TRAIN_TIMEOUT_S", 1.0)
    assert ensure_cds_archive(slow) is None
    assert not cds_archive_path(slow).with_suffix(".failed").exists(), "a run out of time is remembered as failed"
