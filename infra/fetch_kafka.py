"""Fetch the Kafka jars (and train the JVM start-up archive) once per machine.

`python -m infra.fetch_kafka` is what `make install` runs; it prints the jar folder.
Everything else calls `prepare_kafka()`, which is instant once that has run.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from infra.errors import InfraError
from infra.kafka_cds import ensure_cds_archive
from infra.kafka_dist import KafkaRuntime, fetch_kafka_libs, find_java


def prepare_kafka(libs_dir: Path | None = None, *, use_cds: bool = True) -> KafkaRuntime:
    """Jars fetched, JVM found, CDS archive ready (when the JVM supports it).

    First call on a machine: a Maven download plus one training start of the broker. Later
    calls: a few `stat`s.
    """
    libs = fetch_kafka_libs(libs_dir)
    runtime = KafkaRuntime(java=find_java(), libs_dir=libs)
    if not use_cds:
        return runtime
    archive = ensure_cds_archive(runtime)
    return KafkaRuntime(java=runtime.java, libs_dir=libs, cds_archive=archive)


def main(argv: Sequence[str] | None = None, *, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """CLI: `python -m infra.fetch_kafka [LIBS_DIR]`; prints the jar folder on stdout."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) > 1 or (args and args[0] in ("-h", "--help")):
        print("usage: python -m infra.fetch_kafka [LIBS_DIR]", file=err)
        return 2
    try:
        runtime = prepare_kafka(Path(args[0]) if args else None)
    except InfraError as error:
        print(f"fetch_kafka: {error}", file=err)
        return 1
    print(f"Kafka jars: {runtime.libs_dir}", file=out)
    if runtime.cds_archive is None:
        print("no JVM class-data archive (this JVM cannot make one); start-up is slower", file=err)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
