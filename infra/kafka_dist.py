"""Where the Kafka jars come from: Maven Central through `mvn`, cached per user.

Docker is not available on our machines, so the broker runs straight from the jars of
`org.apache.kafka:kafka_2.13`. They are fetched once into a cache folder; a marker file
records a complete fetch so later calls cost one `stat`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from infra.errors import FetchError, ToolMissingError
from infra.locks import file_lock

KAFKA_VERSION = "3.9.1"
KAFKA_DIR = Path(__file__).resolve().parent / "kafka"
POM_PATH = KAFKA_DIR / "pom.xml"
LOG4J_CONFIG = KAFKA_DIR / "log4j.properties"

_MARKER_NAME = ".batchwire-complete.json"
_FETCH_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class KafkaRuntime:
    """Everything needed to launch a broker: a JVM, the jars, and optionally a CDS archive.

    The class-data-sharing archive (see `infra.kafka_cds`) shortens JVM start-up.
    """

    java: Path
    libs_dir: Path
    cds_archive: Path | None = None

    @property
    def classpath(self) -> str:
        # The JVM expands `dir/*` to every jar in the folder (not in subfolders).
        return str(self.libs_dir / "*")


def cache_root() -> Path:
    """`$BATCHWIRE_CACHE_DIR`, or `~/.cache/batchwire` when unset or empty."""
    configured = os.environ.get("BATCHWIRE_CACHE_DIR", "")
    return Path(configured) if configured else Path.home() / ".cache" / "batchwire"


def default_libs_dir() -> Path:
    return cache_root() / f"kafka-{KAFKA_VERSION}" / "libs"


def find_java() -> Path:
    """The `java` to run: `$JAVA_HOME/bin/java` if set, else the one on PATH."""
    java_home = os.environ.get("JAVA_HOME", "")
    if java_home:
        candidate = Path(java_home) / "bin" / "java"
        if candidate.is_file():
            return candidate
    found = shutil.which("java")
    if found is None:
        raise ToolMissingError(
            "java not found on PATH (and JAVA_HOME is unset or wrong); Kafka 3.9 needs Java 17+: "
            "apt-get install openjdk-17-jre-headless"
        )
    return Path(found)


def libs_are_complete(libs_dir: Path) -> bool:
    """Whether `libs_dir` holds a finished fetch for the current pom.xml."""
    marker = libs_dir / _MARKER_NAME
    try:
        recorded = json.loads(marker.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    if recorded.get("pom_sha256") != _pom_digest():
        return False
    jars = recorded.get("jars", [])
    return isinstance(jars, list) and all((libs_dir / str(jar)).is_file() for jar in jars)


def fetch_kafka_libs(libs_dir: Path | None = None) -> Path:
    """Copy Kafka's runtime jars into `libs_dir` (default `default_libs_dir()`); return it.

    Idempotent and safe to call from parallel processes: a file lock serialises fetches and
    a marker written last makes a complete folder a no-op on the next call.
    """
    target = libs_dir if libs_dir is not None else default_libs_dir()
    if libs_are_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.parent / ".libs.lock"):
        if libs_are_complete(target):
            return target
        for stale in target.parent.glob(".libs-staging-*"):
            # A fetch killed midway left its jars; holding the lock, no fetch runs now.
            shutil.rmtree(stale, ignore_errors=True)
        staging = target.parent / f".libs-staging-{os.getpid()}"
        try:
            _run_maven(staging)
            jars = sorted(path.name for path in staging.glob("*.jar"))
            if not jars:
                raise FetchError(f"mvn finished but copied no jars into {staging}")
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        marker = {"pom_sha256": _pom_digest(), "jars": jars, "kafka_version": KAFKA_VERSION}
        (target / _MARKER_NAME).write_text(json.dumps(marker, indent=1) + "\n")
    return target


def _run_maven(output_dir: Path) -> None:
    mvn = shutil.which("mvn")
    if mvn is None:
        raise ToolMissingError(
            "mvn not found on PATH; it fetches the Kafka jars from Maven Central: apt-get install maven"
        )
    argv = [
        mvn,
        "-q",
        "-B",
        "-Dstyle.color=never",
        "-f",
        str(POM_PATH),
        "dependency:copy-dependencies",
        f"-DoutputDirectory={output_dir}",
        "-DincludeScope=runtime",
    ]
    started = time.monotonic()
    try:
        result = subprocess.run(
            argv, capture_output=True, check=False, timeout=_FETCH_TIMEOUT_S, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired as err:
        raise FetchError(f"mvn did not finish within {_FETCH_TIMEOUT_S:.0f} s: {' '.join(argv)}") from err
    if result.returncode != 0:
        output = (result.stdout + result.stderr).decode(errors="replace").strip()
        tail = "\n".join(output.splitlines()[-30:])
        raise FetchError(
            f"mvn exited with {result.returncode} after {time.monotonic() - started:.1f} s "
            f"(is Maven Central reachable? proxy settings go in ~/.m2/settings.xml):\n"
            f"{' '.join(argv)}\n{tail}"
        )


def _pom_digest() -> str:
    return hashlib.sha256(POM_PATH.read_bytes()).hexdigest()
