"""A single-node KRaft Kafka broker (broker and controller in one JVM) on loopback ports.

Settings favour fast tests on a small machine: one partition per internal topic, replication
factor 1, no initial rebalance delay, short minimum session timeout for crash tests.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from infra.errors import PortTakenError, ServiceStartError, StartTimeoutError
from infra.kafka_dist import LOG4J_CONFIG, KafkaRuntime
from infra.kafka_probe import wait_for_kafka
from infra.loopback import LoopbackServer, write_atomically
from infra.ports import LOOPBACK, free_port
from infra.process import ServiceProcess

# Tuned for launch-to-serving time on a small machine: the C1 compiler alone and the serial
# collector start faster than the JVM defaults (the CDS archive, infra.kafka_cds, faster still).
# C1-only code is slower at peak throughput, which a test broker sharing two cores never reaches;
# the serial collector has no concurrent GC threads competing with the services under test.
# The heap starts at the size a cluster node keeps (`infra.kafka_cluster.cluster_jvm_opts`): a heap
# that grows does so in a full collection, which stops the broker while it serves. A small young
# generation keeps each young collection's pause short.
FAST_START_JVM_OPTS: tuple[str, ...] = (
    "-Xms256m",
    "-Xmx512m",
    "-Xmn32m",
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",
    "-XX:-UsePerfData",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
)
# BATCHWIRE_KAFKA_JVM_OPTS replaces them, e.g. for benchmarks, where the C2 compiler's faster
# code matters more than a second of start-up: "-Xms256m -Xmx512m -XX:+UseSerialGC".
DEFAULT_JVM_OPTS: tuple[str, ...] = (
    tuple(os.environ["BATCHWIRE_KAFKA_JVM_OPTS"].split())
    if os.environ.get("BATCHWIRE_KAFKA_JVM_OPTS")
    else FAST_START_JVM_OPTS
)

BROKER_PROPERTIES: Mapping[str, str] = {
    "process.roles": "broker,controller",
    "node.id": "1",
    "inter.broker.listener.name": "PLAINTEXT",
    "controller.listener.names": "CONTROLLER",
    "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
    # The defaults (replication factor 3) leave a single node without a group coordinator.
    "offsets.topic.replication.factor": "1",
    "offsets.topic.num.partitions": "1",
    "transaction.state.log.replication.factor": "1",
    "transaction.state.log.min.isr": "1",
    "transaction.state.log.num.partitions": "1",
    "default.replication.factor": "1",
    "min.insync.replicas": "1",
    "num.partitions": "1",
    # The 3 s default delays every first consumer-group join.
    "group.initial.rebalance.delay.ms": "0",
    # Default 6000: crash tests use 1-2 s consumer session timeouts for fast failover.
    "group.min.session.timeout.ms": "1000",
    # After a crash (SIGKILL) the restarted node cannot register until the old registration's
    # session expires: 9 s by default, which every crash test would wait out.
    "broker.session.timeout.ms": "3000",
    "broker.heartbeat.interval.ms": "500",
    # Topics are created on purpose (infra.topics.ensure_topics), never by a typo.
    "auto.create.topics.enable": "false",
    # Fewer threads than the defaults (3 network, 8 io): two cores, a handful of clients.
    "num.network.threads": "2",
    "num.io.threads": "4",
    "background.threads": "4",
    # The log cleaner (it compacts the offsets topic) takes its dedupe buffer from the heap at
    # start: 128 MiB by default, which leaves a small heap's young generation a sliver and the
    # collector pausing the broker often. A few MiB hold the keys of these compacted topics.
    "log.cleaner.dedupe.buffer.size": str(8 * 1024 * 1024),
}

DEFAULT_START_TIMEOUT_S = 60.0
DEFAULT_STOP_TIMEOUT_S = 20.0
_FORMAT_TIMEOUT_S = 120.0


def render_server_properties(
    *,
    data_dir: Path,
    broker_port: int,
    controller_port: int,
    extra: Mapping[str, str] | None = None,
) -> str:
    """The text of server.properties for a single loopback node."""
    props = dict(BROKER_PROPERTIES)
    props.update(
        {
            "controller.quorum.voters": f"1@{LOOPBACK}:{controller_port}",
            "listeners": f"PLAINTEXT://{LOOPBACK}:{broker_port},CONTROLLER://{LOOPBACK}:{controller_port}",
            "advertised.listeners": f"PLAINTEXT://{LOOPBACK}:{broker_port}",
            "log.dirs": str(data_dir),
        }
    )
    props.update(extra or {})
    return "".join(f"{key}={value}\n" for key, value in props.items())


def read_config_ports(properties_path: Path) -> tuple[int, int] | None:
    """(broker port, controller port) of a server.properties that `render_server_properties` wrote;
    None without a readable one."""
    try:
        lines = properties_path.read_text().splitlines()
    except OSError:
        return None
    listeners = next((line.partition("=")[2] for line in lines if line.startswith("listeners=")), "")
    ports: dict[str, int] = {}
    for listener in listeners.split(","):
        name, _, address = listener.partition("://")
        port = address.rpartition(":")[2]
        if port.isdigit():
            ports[name.strip()] = int(port)
    if "PLAINTEXT" not in ports or "CONTROLLER" not in ports:
        return None
    return ports["PLAINTEXT"], ports["CONTROLLER"]


def new_cluster_id() -> str:
    """A KRaft cluster id: 16 random bytes, URL-safe base64 without padding (as kafka-storage makes)."""
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()


class KafkaServer(LoopbackServer):
    """One broker process over a work folder (server.properties, data/, kafka.log).

    Ports are fixed at construction, so `stop()` (a clean shutdown) then `start()` brings back the
    same broker on the same address with its data, and so does `kill()` (a crash; the broker
    recovers from the same data): what crash tests that restart Kafka under load need.
    """

    def __init__(
        self,
        runtime: KafkaRuntime,
        work_dir: Path,
        *,
        broker_port: int | None = None,
        controller_port: int | None = None,
        detached: bool = False,
        jvm_opts: Sequence[str] = DEFAULT_JVM_OPTS,
        broker_only_jvm_opts: Sequence[str] = (),
        extra_properties: Mapping[str, str] | None = None,
        cluster_id: str | None = None,
    ) -> None:
        super().__init__(
            ports_chosen_by_us=broker_port is None and controller_port is None,
            start_timeout_s=DEFAULT_START_TIMEOUT_S,
            stop_timeout_s=DEFAULT_STOP_TIMEOUT_S,
        )
        self._runtime = runtime
        self._work_dir = work_dir
        self._broker_port = broker_port if broker_port is not None else free_port()
        self._controller_port = controller_port if controller_port is not None else free_port()
        self._detached = detached
        self._jvm_opts = tuple(jvm_opts)
        self._broker_only_jvm_opts = tuple(broker_only_jvm_opts)
        self._extra_properties = dict(extra_properties or {})
        # The nodes of one cluster format their storage with the same id; a lone node makes its own.
        self._cluster_id = cluster_id

    @property
    def bootstrap(self) -> str:
        """`127.0.0.1:PORT`, valid before `start()` and across restarts."""
        return f"{LOOPBACK}:{self._broker_port}"

    @property
    def broker_port(self) -> int:
        return self._broker_port

    @property
    def controller_port(self) -> int:
        return self._controller_port

    @property
    def work_dir(self) -> Path:
        return self._work_dir

    @property
    def properties_path(self) -> Path:
        return self._work_dir / "server.properties"

    @property
    def data_dir(self) -> Path:
        return self._work_dir / "data"

    @property
    def log_path(self) -> Path:
        return self._work_dir / "kafka.log"

    def _choose_new_ports(self) -> None:
        shutil.rmtree(self.data_dir, ignore_errors=True)  # formatted for the old controller address
        self._broker_port, self._controller_port = free_port(), free_port()

    def _start_once(self, deadline: float) -> None:
        self._work_dir.mkdir(parents=True, exist_ok=True)
        write_atomically(
            self.properties_path,
            render_server_properties(
                data_dir=self.data_dir,
                broker_port=self._broker_port,
                controller_port=self._controller_port,
                extra=self._extra_properties,
            ),
        )
        if not (self.data_dir / "meta.properties").is_file():
            self._format_storage(deadline)
        argv = [*self._java_argv(self._broker_only_jvm_opts), "kafka.Kafka", str(self.properties_path)]
        process = ServiceProcess.spawn(argv, log_path=self.log_path, cwd=self._work_dir, detached=self._detached)
        self._process = process
        served = wait_for_kafka(
            self.bootstrap,
            timeout_s=max(deadline - time.monotonic(), 0.0),
            still_running=process.is_alive,
        )
        if served and process.listens_on(self._broker_port) is False:
            process.terminate(5.0)
            self._process = None
            raise PortTakenError(
                f"Kafka broker at {self.bootstrap}: another process answered there, having bound the port first "
                f"(log: {self.log_path}):\n{self.log_tail()}"
            )
        if served:
            return
        running = process.is_alive()
        process.terminate(5.0)
        self._process = None
        error = StartTimeoutError if running else ServiceStartError
        why = "did not serve before the deadline" if running else "exited during start-up"
        raise error(f"Kafka broker at {self.bootstrap} {why} (log: {self.log_path}):\n{self.log_tail()}")

    def _format_storage(self, deadline: float) -> None:
        argv = [
            *self._java_argv(),
            "kafka.tools.StorageTool",
            "format",
            f"--cluster-id={self._cluster_id or new_cluster_id()}",  # '=' form: a random id may begin with '-'
            "-c",
            str(self.properties_path),
            "--ignore-formatted",
        ]
        timeout_s = min(_FORMAT_TIMEOUT_S, max(deadline - time.monotonic(), 1.0))
        with self.log_path.open("ab") as log:
            try:
                result = subprocess.run(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self._work_dir,
                    timeout=timeout_s,
                    check=False,
                )
            except subprocess.TimeoutExpired as err:
                raise StartTimeoutError(f"kafka-storage format took over {timeout_s:.0f} s") from err
        if result.returncode != 0:
            raise ServiceStartError(
                f"kafka-storage format failed with {result.returncode} (log: {self.log_path}):\n{self.log_tail()}"
            )

    def _java_argv(self, extra_opts: Sequence[str] = ()) -> list[str]:
        argv = [str(self._runtime.java), *self._jvm_opts, *extra_opts]
        if self._runtime.cds_archive is not None:
            argv.append(f"-XX:SharedArchiveFile={self._runtime.cds_archive}")
        argv += [
            f"-Dlog4j.configuration={LOG4J_CONFIG.as_uri()}",
            "-cp",
            self._runtime.classpath,
        ]
        return argv
