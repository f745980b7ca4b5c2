"""docker-compose.yml checked statically (no Docker engine here): it must agree with the CLI and the code."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchwire.cli import build_parser
from schemas.wire import DEFAULT_NAMESPACE

ROOT = Path(__file__).resolve().parent.parent
BATCHWIRE_SERVICES = ("gateway", "batcher", "gpu_worker")
HA_ROLES = ("gateway-ha", "batcher-ha", "gpu_worker-ha")
HA_KAFKA = ("kafka-1", "kafka-2", "kafka-3")
HA_SENTINELS = ("sentinel-1", "sentinel-2", "sentinel-3")
HA_BACKBONE = (*HA_KAFKA, "kafka-ha-init", "redis-primary", "redis-replica", *HA_SENTINELS)
TRACING_ROLES = ("gateway-tracing", "batcher-tracing", "gpu_worker-tracing")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]  # type: ignore[no-any-return]
    raise AssertionError("the CLI has no subcommands")


def flags_and_vars(parser: argparse.ArgumentParser) -> tuple[set[str], set[str]]:
    flags = {option for action in parser._actions for option in action.option_strings}
    variables = {"BATCHWIRE_" + flag.lstrip("-").replace("-", "_").upper() for flag in flags if flag.startswith("--")}
    return flags, variables


@pytest.mark.parametrize("service", BATCHWIRE_SERVICES + HA_ROLES)
def test_every_command_flag_and_variable_exists_in_the_cli(compose: dict[str, Any], service: str) -> None:
    spec = compose["services"][service]
    command = spec["command"]
    parser = subparser(command[0])
    flags, variables = flags_and_vars(parser)
    used_flags = [arg for arg in command[1:] if arg.startswith("--")]
    assert set(used_flags) <= flags, f"{service}: unknown flags {set(used_flags) - flags}"
    parser.parse_args(command[1:])  # values parse too
    env = set(spec.get("environment", {}))
    assert env <= variables, f"{service}: variables the CLI does not read: {env - variables}"
    assert spec.get("build") == ".", f"{service} must build the project's Dockerfile"
    assert spec.get("restart") == "unless-stopped", f"{service} must be restarted when it exits (hung backend)"


def test_addresses_ports_and_names_agree(compose: dict[str, Any]) -> None:
    services = compose["services"]
    kafka_env = services["kafka"]["environment"]
    internal = next(part for part in kafka_env["KAFKA_ADVERTISED_LISTENERS"].split(",") if part.startswith("INTERNAL"))
    advertised = internal.split("//", 1)[1]
    for service in BATCHWIRE_SERVICES:
        env = services[service]["environment"]
        assert env["BATCHWIRE_KAFKA_BOOTSTRAP"] == advertised, f"{service} must reach Kafka's internal listener"
        assert env["BATCHWIRE_REDIS_URL"].startswith("redis://redis:6379"), f"{service} must reach the redis service"
        assert env["BATCHWIRE_NAMESPACE"] == DEFAULT_NAMESPACE
    gateway = services["gateway"]
    port = gateway["command"][gateway["command"].index("--port") + 1]
    assert any(mapping.endswith(f":{port}:{port}") for mapping in gateway["ports"]), "published port = listen port"
    assert subparser("gateway").get_default("port") == int(port) == 8000
    assert services["gpu_worker"]["deploy"]["replicas"] >= 2, "the worker service is meant to scale"
    assert kafka_env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false", "roles create their own topics"
    for name in ("kafka", "redis", "gateway"):
        assert "healthcheck" in services[name], f"{name} needs a health check"


def test_dockerfile_installs_the_cli_for_every_role() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    for package in ("batchwire", "gateway", "batcher", "gpu_worker", "schemas"):
        assert f"COPY {package} ./{package}" in dockerfile, f"the image must contain {package}/"
    assert 'ENTRYPOINT ["batchwire"]' in dockerfile
    # The image installs with the script the core-install smoke test runs (tests/smoke), nothing else.
    assert 'RUN sh infra/install.sh /opt/batchwire "${EXTRAS}"' in dockerfile
    assert "pip install" not in dockerfile, "the image installs through infra/install.sh only"


def test_redis_is_bounded_refuses_writes_when_full_and_persists(compose: dict[str, Any]) -> None:
    from infra.redis_server import MAXMEMORY_POLICY, checked_maxmemory
    from infra.stack import DEFAULT_REDIS_MAXMEMORY

    redis = compose["services"]["redis"]
    command = redis["command"]
    assert command[0] == "redis-server"
    options = dict(zip(command[1::2], command[2::2], strict=True))
    assert checked_maxmemory(options["--maxmemory"]) == DEFAULT_REDIS_MAXMEMORY, "the same bound as the dev stack"
    assert options["--maxmemory-policy"] == MAXMEMORY_POLICY == "noeviction", "evicting would drop live tasks"
    assert (options["--appendonly"], options["--appendfsync"]) == ("yes", "everysec"), "a restart keeps the data"
    volume = next(mount.split(":", 1)[0] for mount in redis["volumes"] if mount.endswith(":/data"))
    assert volume in compose["volumes"], "Redis's data lives in a named volume"


def _redis_options(command: list[str]) -> dict[str, str]:
    """`--option value` pairs; `--replicaof host port` (two values) as one "host port"."""
    assert command[0] == "redis-server"
    args = list(command[1:])
    if "--replicaof" in args:
        at = args.index("--replicaof")
        args[at : at + 3] = ["--replicaof", " ".join(args[at + 1 : at + 3])]
    return dict(zip(args[0::2], args[1::2], strict=True))


def test_the_ha_profile_is_separate_and_every_long_running_service_has_a_health_check(compose: dict[str, Any]) -> None:
    services = compose["services"]
    in_ha = {name for name, spec in services.items() if "ha" in spec.get("profiles", [])}
    assert in_ha == {*HA_BACKBONE, *HA_ROLES}
    in_tracing = {name for name, spec in services.items() if "tracing" in spec.get("profiles", [])}
    assert all("profiles" not in spec for name, spec in services.items() if name not in in_ha | in_tracing), (
        "`docker compose up` without a profile starts what it did"
    )
    for name in sorted(in_ha - {"kafka-ha-init"}):
        assert "healthcheck" in services[name], f"{name} needs a health check"
    # The one-shot job's exit status is its check: the roles wait for it to succeed.
    assert services["kafka-ha-init"]["restart"] == "no"
    for role in HA_ROLES:
        depends = services[role]["depends_on"]
        assert set(depends) == {"kafka-ha-init", "redis-replica", *HA_SENTINELS}, f"{role} must wait for the backbone"
        assert depends["kafka-ha-init"]["condition"] == "service_completed_successfully"
        assert all(depends[name]["condition"] == "service_healthy" for name in depends if name != "kafka-ha-init")


def test_the_ha_brokers_form_one_kraft_cluster_that_replicates_its_internal_topics(compose: dict[str, Any]) -> None:
    services = compose["services"]
    envs = [services[name]["environment"] for name in HA_KAFKA]
    assert {services[name]["image"] for name in (*HA_KAFKA, "kafka-ha-init")} == {services["kafka"]["image"]}
    assert [env["KAFKA_NODE_ID"] for env in envs] == [1, 2, 3]
    voters = ",".join(f"{env['KAFKA_NODE_ID']}@{name}:9093" for name, env in zip(HA_KAFKA, envs, strict=True))
    for env in envs:
        assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == voters, "every node votes"
        assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
        assert env["CLUSTER_ID"] == envs[0]["CLUSTER_ID"]
        assert (
            env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == env["KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR"] == 3
        )
        assert env["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"] == 2
        assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false", "roles create their own topics"
    internal = [
        next(part for part in env["KAFKA_ADVERTISED_LISTENERS"].split(",") if part.startswith("INTERNAL")).split("//")[
            1
        ]
        for env in envs
    ]
    for role in HA_ROLES:
        assert services[role]["environment"]["BATCHWIRE_KAFKA_BOOTSTRAP"] == ",".join(internal), role
    published = [mapping for name in HA_KAFKA for mapping in services[name]["ports"]]
    assert len(set(published)) == 3 and not set(published) & set(services["kafka"]["ports"])
    init = " ".join(services["kafka-ha-init"]["command"])
    assert "--entity-name __consumer_offsets --add-config min.insync.replicas=2" in init


def test_the_ha_redis_is_a_persistent_primary_a_replica_and_three_sentinels(compose: dict[str, Any]) -> None:
    from infra.redis_sentinel import MASTER_NAME, QUORUM

    services = compose["services"]
    single = _redis_options(services["redis"]["command"])
    primary = _redis_options(services["redis-primary"]["command"])
    replica = _redis_options(services["redis-replica"]["command"])
    for options in (primary, replica):
        for key in ("--maxmemory", "--maxmemory-policy", "--appendonly", "--appendfsync", "--save"):
            assert options[key] == single[key], f"{key}: as the single Redis (bounded, noeviction, AOF everysec)"
    assert "--replicaof" not in primary
    assert services["redis-replica"]["command"][-2:] == ["redis-primary", "6379"]
    assert services["redis-replica"]["command"][-3] == "--replicaof"
    volumes = {
        mount.split(":", 1)[0] for name in ("redis-primary", "redis-replica") for mount in services[name]["volumes"]
    }
    assert len(volumes) == 2 and volumes <= set(compose["volumes"]), "each keeps its append-only file in its own volume"
    images = {services[name]["image"] for name in ("redis-primary", "redis-replica", *HA_SENTINELS)}
    assert images == {services["redis"]["image"]}
    for name in HA_SENTINELS:
        script = services[name]["command"][-1]
        assert f"sentinel monitor {MASTER_NAME} redis-primary 6379 {QUORUM}" in script, name
        assert "--sentinel" in script and services[name]["environment"]["HOSTNAME_ANNOUNCED"] == name
    url = f"redis+sentinel://{','.join(f'{name}:26379' for name in HA_SENTINELS)}/{MASTER_NAME}"
    for role in HA_ROLES:
        assert services[role]["environment"]["BATCHWIRE_REDIS_URL"] == url, role


def test_the_tracing_profile_sends_every_roles_spans_to_jaeger(compose: dict[str, Any]) -> None:
    services = compose["services"]
    in_tracing = {name for name, spec in services.items() if "tracing" in spec.get("profiles", [])}
    assert in_tracing == {"jaeger", *TRACING_ROLES}
    jaeger = services["jaeger"]
    assert jaeger["image"].startswith("jaegertracing/all-in-one:")
    assert jaeger["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    for role in TRACING_ROLES:
        spec = services[role]
        parser = subparser(spec["command"][0])
        parser.parse_args(spec["command"][1:])
        env = spec["environment"]
        assert set(env) <= flags_and_vars(parser)[1], f"{role}: variables the CLI does not read"
        assert env["BATCHWIRE_OTLP_ENDPOINT"] == "http://jaeger:4318", f"{role} must export to Jaeger's OTLP/HTTP port"
        assert spec["build"] == {"context": ".", "args": {"EXTRAS": "[tracing]"}}, f"{role} needs the [tracing] extra"
        assert "jaeger" in spec["depends_on"], f"{role} must start after Jaeger"
        assert spec["restart"] == "unless-stopped"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert "\ntracing = [" in pyproject, "the [tracing] extra the image installs"
