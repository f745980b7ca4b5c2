"""A class-data-sharing (AppCDS) archive for the broker JVM: a faster start-up.

The JVM maps classes parsed and verified by an earlier run instead of loading thousands of
classes from the jars. Java 17 writes such an archive at exit with `-XX:ArchiveClassesAtExit`, so one
training run (start a throwaway broker, use it, stop it) makes it. The archive only fits the
exact JVM build and jar set it came from, hence the key in its file name. A mismatched
archive is harmless: the JVM notes it in the log and starts without it.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from infra.errors import InfraError, PortTakenError, StartTimeoutError
from infra.kafka_dist import KafkaRuntime
from infra.kafka_server import KafkaServer
from infra.locks import file_lock

_TRAIN_TIMEOUT_S = 120.0
# Writing the archive happens during JVM exit, after the broker's own shutdown.
_TRAIN_STOP_TIMEOUT_S = 60.0


def cds_archive_path(runtime: KafkaRuntime) -> Path:
    """Where the archive for this JVM build and jar folder lives (next to `libs/`)."""
    java = runtime.java.resolve()
    stat = java.stat()
    jars = sorted(p.name for p in runtime.libs_dir.glob("*.jar"))
    key_source = f"{java}|{stat.st_size}|{stat.st_mtime_ns}|{runtime.libs_dir.resolve()}|{jars}"
    key = hashlib.sha256(key_source.encode()).hexdigest()[:16]
    return runtime.libs_dir.parent / "cds" / f"kafka-{key}.jsa"


def ensure_cds_archive(runtime: KafkaRuntime) -> Path | None:
    """Return the archive for `runtime`, training it first if missing; None if the JVM can't.

    A failure of the JVM is remembered (a `.failed` file) so a JVM without dynamic CDS support costs
    one training run, not one per start; a run that ran out of time or found its port taken (a busy
    machine) is not, and the next start trains again.
    """
    archive = cds_archive_path(runtime)
    failed_marker = archive.with_suffix(".failed")
    if archive.is_file():
        return archive
    if failed_marker.is_file():
        return None
    archive.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(archive.parent / ".cds.lock"):
        if archive.is_file():
            return archive
        for stale in archive.parent.glob(".*.jsa.*.tmp"):
            stale.unlink(missing_ok=True)  # a training run killed midway; holding the lock, none runs now
        try:
            _train(runtime, archive)
        except (StartTimeoutError, PortTakenError):
            return None
        except InfraError as err:
            failed_marker.write_text(f"{err}\n")
            return None
    return archive if archive.is_file() else None


def _train(runtime: KafkaRuntime, archive: Path) -> None:
    partial = archive.with_name(f".{archive.name}.{os.getpid()}.tmp")
    partial.unlink(missing_ok=True)
    plain = KafkaRuntime(java=runtime.java, libs_dir=runtime.libs_dir, cds_archive=None)
    with tempfile.TemporaryDirectory(prefix="batchwire-kafka-cds-") as work:
        # Same JVM flags as real runs (an archive is only used under compatible options);
        # the storage formatting run must not write the archive, only the broker.
        server = KafkaServer(
            plain,
            Path(work),
            broker_only_jvm_opts=[
                f"-XX:ArchiveClassesAtExit={partial}",
                # Dumping lists every class it skips (old bytecode, unlinked) as a warning.
                "-Xlog:cds*=error",
            ],
        )
        try:
            server.start(timeout_s=_TRAIN_TIMEOUT_S)
        finally:
            server.stop(timeout_s=_TRAIN_STOP_TIMEOUT_S)
    if not partial.is_file():
        raise InfraError(f"the JVM wrote no CDS archive at {partial}")
    partial.replace(archive)
