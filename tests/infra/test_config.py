"""Pure parts of `infra`: broker settings, container env, infra selection, tool errors, files written whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.docker_stack import kafka_container_env
from infra.errors import InfraError, NotSupportedError, ToolMissingError
from infra.kafka_cluster import cluster_jvm_opts
from infra.kafka_dist import cache_root, default_libs_dir
from infra.kafka_server import (
    BROKER_PROPERTIES,
    FAST_START_JVM_OPTS,
    new_cluster_id,
    read_config_ports,
    render_server_properties,
)
from infra.loopback import write_atomically
from infra.redis_server import RedisServer, checked_maxmemory, read_config_port
from infra.select import ProvidedInfra, choose_infra_kind


def _props(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines())


def test_server_properties_single_loopback_node(tmp_path: Path) -> None:
    props = _props(render_server_properties(data_dir=tmp_path, broker_port=1111, controller_port=2222))

    assert props["process.roles"] == "broker,controller"
    assert props["controller.quorum.voters"] == "1@127.0.0.1:2222"
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:1111,CONTROLLER://127.0.0.1:2222"
    assert props["advertised.listeners"] == "PLAINTEXT://127.0.0.1:1111"
    assert props["log.dirs"] == str(tmp_path)
    assert props["offsets.topic.replication.factor"] == "1"
    assert props["group.min.session.timeout.ms"] == "1000"
    assert props["auto.create.topics.enable"] == "false"


def test_the_ports_server_properties_records_are_read_back(tmp_path: Path) -> None:
    path = tmp_path / "server.properties"
    path.write_text(render_server_properties(data_dir=tmp_path, broker_port=1111, controller_port=2222))

    assert read_config_ports(path) == (1111, 2222)
    assert read_config_ports(tmp_path / "missing.properties") is None


def test_redis_conf_bounds_memory_refuses_writes_over_it_and_records_its_port(tmp_path: Path) -> None:
    server = RedisServer(tmp_path, port=4321, maxmemory="64MB", persistent=True)
    server.config_path.write_text(server.config_text())

    conf = dict(line.split(" ", 1) for line in server.config_path.read_text().splitlines())
    assert (conf["maxmemory"], conf["maxmemory-policy"]) == ("64mb", "noeviction")
    assert (conf["appendonly"], conf["appendfsync"]) == ("yes", "everysec")
    assert read_config_port(server.config_path) == 4321
    throwaway = dict(line.split(" ", 1) for line in RedisServer(tmp_path, port=1).config_text().splitlines())
    assert (throwaway["appendonly"], throwaway["maxmemory"]) == ("no", "0")


@pytest.mark.parametrize("text", ["512mb", "1GB", "0", "1048576", "64k"])
def test_redis_memory_sizes_redis_takes(text: str) -> None:
    assert checked_maxmemory(text) == text.lower()


@pytest.mark.parametrize("text", ["", "lots", "1.5gb", "-1", "512 mb", "10tb"])
def test_redis_memory_sizes_redis_refuses_are_refused_early(text: str) -> None:
    with pytest.raises(ValueError, match="not a memory size"):
        checked_maxmemory(text)


def test_stack_up_flag_names_a_bad_size_and_defaults_to_the_stacks_bound() -> None:
    import subprocess
    import sys

    from batchwire.cli import tool_parser
    from infra.stack import DEFAULT_REDIS_MAXMEMORY

    parser = tool_parser("stack")
    assert parser.parse_args(["stack", "up"]).redis_maxmemory == DEFAULT_REDIS_MAXMEMORY
    done = subprocess.run(
        [sys.executable, "-m", "batchwire.cli", "stack", "up", "--redis-maxmemory", "lots"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and "--redis-maxmemory" in done.stderr and "not a memory size" in done.stderr, done


def test_stack_up_in_a_state_dir_that_cannot_be_made_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from batchwire.cli import main

    (tmp_path / "a-file").write_text("")
    state_dir = tmp_path / "a-file" / "stack"
    assert main(["stack", "up", "--state-dir", str(state_dir)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("stack up failed: ") and str(state_dir.parent) in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("flag", "named"),
    [
        ("--namespace=team a", "namespace 'team a' must be"),
        ("--models=sim,sim", "lists a model twice"),
        ("--request-partitions=0", "--request-partitions (0) must be at least"),
    ],
)
def test_stack_up_refuses_a_setting_of_its_topics_before_it_starts_a_server(
    flag: str, named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The state dir cannot be made, so a stack up that got that far says so instead (exit 1): the topics'
    settings are refused first, with exit 2, rather than after Kafka and Redis were started and left up."""
    from batchwire.cli import main

    (tmp_path / "a-file").write_text("")
    state_dir = tmp_path / "a-file" / "stack"
    assert main(["stack", "up", "--state-dir", str(state_dir), flag]) == 2
    err = capsys.readouterr().err
    assert named in err and "stack up failed" not in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("state_dir", "stop"), [(".batchwire", "batchwire stack down\n"), ("/srv/bw", "--state-dir /srv/bw\n")]
)
def test_stack_up_tells_the_stop_command_for_its_own_state_dir(state_dir: str, stop: str) -> None:
    """`stack down` without the state dir up used looks in .batchwire, finds no stack and leaves it running."""
    import io

    from infra.stack import StackUp, print_up

    out, err = io.StringIO(), io.StringIO()
    print_up(StackUp({"BATCHWIRE_REDIS_URL": "redis://127.0.0.1:1/0"}), Path(state_dir), out=out, err=err)
    assert err.getvalue().endswith(stop), err.getvalue()


def test_stack_up_in_another_state_dir_tells_how_roles_read_its_file() -> None:
    """Roles read .batchwire/stack.env unless BATCHWIRE_STACK_ENV names another: without it they find no stack."""
    import io

    from infra.stack import StackUp, print_up

    out, err = io.StringIO(), io.StringIO()
    print_up(StackUp({"BATCHWIRE_REDIS_URL": "redis://127.0.0.1:1/0"}), Path("/srv/bw"), out=out, err=err)
    assert "BATCHWIRE_STACK_ENV=/srv/bw/stack.env" in err.getvalue(), err.getvalue()
    print_up(StackUp({"BATCHWIRE_REDIS_URL": "redis://127.0.0.1:1/0"}), Path(".batchwire"), out=out, err=err)
    assert err.getvalue().count("BATCHWIRE_STACK_ENV") == 1, err.getvalue()


def test_server_properties_extra_overrides(tmp_path: Path) -> None:
    text = render_server_properties(data_dir=tmp_path, broker_port=1, controller_port=2, extra={"num.partitions": "4"})
    assert _props(text)["num.partitions"] == "4"


def _mebibytes(opts: tuple[str, ...], flag: str) -> int:
    (value,) = (opt.removeprefix(flag) for opt in opts if opt.startswith(flag))
    assert value.endswith("m"), value
    return int(value[:-1])


def test_a_cluster_nodes_heap_is_sized_at_start_and_the_cleaner_takes_little_of_it() -> None:
    opts = cluster_jvm_opts(FAST_START_JVM_OPTS)
    heap_mib = _mebibytes(opts, "-Xmx")
    dedupe_mib = int(BROKER_PROPERTIES["log.cleaner.dedupe.buffer.size"]) / 2**20

    assert _mebibytes(opts, "-Xms") == heap_mib
    assert dedupe_mib * 16 <= heap_mib, (dedupe_mib, heap_mib)


def test_cluster_id_is_22_url_safe_chars() -> None:
    cluster_id = new_cluster_id()
    assert len(cluster_id) == 22
    assert cluster_id.replace("-", "").replace("_", "").isalnum()


def test_kafka_container_env_sets_everything_the_image_needs() -> None:
    env = kafka_container_env(host="localhost", port=39092, cluster_id="abc")

    assert env["KAFKA_ADVERTISED_LISTENERS"].startswith("PLAINTEXT://localhost:39092,")
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert env["KAFKA_NODE_ID"] == "1"
    assert env["KAFKA_INTER_BROKER_LISTENER_NAME"] == "BROKER"
    assert env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == "1"
    assert env["CLUSTER_ID"] == "abc"


def test_cache_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BATCHWIRE_CACHE_DIR", str(tmp_path))
    assert cache_root() == tmp_path
    assert default_libs_dir() == tmp_path / "kafka-3.9.1" / "libs"
    monkeypatch.setenv("BATCHWIRE_CACHE_DIR", "")
    assert cache_root() == Path.home() / ".cache" / "batchwire"


def test_external_wins_when_both_addresses_are_set() -> None:
    env = {"BATCHWIRE_TEST_KAFKA_BOOTSTRAP": "k:9092", "BATCHWIRE_TEST_REDIS_URL": "redis://r:6379/0"}
    assert choose_infra_kind(env) == "external"


def test_forced_local_ignores_external_addresses() -> None:
    env = {
        "BATCHWIRE_TEST_INFRA": "local",
        "BATCHWIRE_TEST_KAFKA_BOOTSTRAP": "k:9092",
        "BATCHWIRE_TEST_REDIS_URL": "redis://r:6379/0",
    }
    assert choose_infra_kind(env) == "local"


def test_forced_external_names_the_missing_variable() -> None:
    with pytest.raises(InfraError, match="BATCHWIRE_TEST_REDIS_URL"):
        choose_infra_kind({"BATCHWIRE_TEST_INFRA": "external", "BATCHWIRE_TEST_KAFKA_BOOTSTRAP": "k:1"})


def test_unknown_forced_kind_lists_the_choices() -> None:
    with pytest.raises(InfraError, match="local, docker, external"):
        choose_infra_kind({"BATCHWIRE_TEST_INFRA": "podman"})


def test_external_infra_cannot_restart() -> None:
    provided = ProvidedInfra(kind="external", kafka_bootstrap="k:1", redis_url="redis://r:1/0")
    assert not provided.can_restart
    with pytest.raises(NotSupportedError, match="restart Kafka"):
        provided.restart_kafka()


def test_missing_redis_server_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ToolMissingError, match="apt-get install redis-server"):
        RedisServer(tmp_path).start()


def test_docker_is_unavailable_when_docker_host_answers_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from infra.select import docker_available

    monkeypatch.setenv("DOCKER_HOST", "tcp://127.0.0.1:1")
    assert docker_available() is False


@pytest.mark.parametrize("action", ["down", "status"])
def test_stack_down_and_status_in_a_missing_state_dir_make_nothing_and_say_no_stack(
    action: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from batchwire.cli import main

    (tmp_path / "a-file").write_text("")
    for state_dir in (tmp_path / "missing" / "stack", tmp_path / "a-file" / "stack"):
        code = main(["stack", action, "--state-dir", str(state_dir)])
        out, err = capsys.readouterr()
        assert "Traceback" not in err and "Error" not in err, err
        if action == "down":
            assert (code, out) == (0, "no stack was running\n"), (code, out)
        else:
            assert code == 1 and "kafka: none yet" in out, (code, out)
        assert not (tmp_path / "missing").exists(), "a mistyped --state-dir is not made"


def test_hardening_the_offsets_topic_of_a_cluster_that_does_not_answer_is_an_infra_error() -> None:
    """`stack up` reports an InfraError in one line: a KafkaError would end it in a traceback."""
    import asyncio

    from infra.detached import StackCommands
    from infra.kafka_cluster import harden_offsets_topic
    from infra.ports import free_port

    bootstrap = f"127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(InfraError, match=f"__consumer_offsets on the cluster at {bootstrap}"):
        asyncio.run(harden_offsets_topic(bootstrap, 3, commands=StackCommands(), timeout_s=1.0))


def test_a_file_written_atomically_is_whole_even_when_the_write_fails(tmp_path: Path) -> None:
    """The servers' configurations record their ports: a write that fails midway keeps the old ports."""
    path = tmp_path / "server.properties"
    write_atomically(path, "listeners=PLAINTEXT://127.0.0.1:1111\n")
    with pytest.raises(UnicodeEncodeError):
        write_atomically(path, "listeners=PLAINTEXT://127.0.0.1:2222\n\ud800")
    assert path.read_text() == "listeners=PLAINTEXT://127.0.0.1:1111\n"
    assert [entry.name for entry in tmp_path.iterdir()] == ["server.properties"], "no partial file is left"


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--brokers=0"], "--brokers must be 1 or more"),
        (["--redis-replicas=-1"], "--redis-replicas 0 or more"),
        (["--redis-cluster=2"], "--redis-cluster takes 3 primaries or more"),
        (["--redis-cluster=3", "--redis-replicas=1"], "and no --redis-replicas"),
    ],
)
def test_stack_up_refuses_a_shape_no_stack_can_have_as_a_usage_error(
    flags: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A count no stack can have is a flag to change (exit 2, as the other flags' values), not a stack that failed
    to start (exit 1, which a script may retry); the state dir cannot be made, so nothing got further."""
    from batchwire.cli import main

    (tmp_path / "a-file").write_text("")
    state_dir = tmp_path / "a-file" / "stack"
    assert main(["stack", "up", "--state-dir", str(state_dir), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("batchwire stack: ") and named in err and "Traceback" not in err, err
