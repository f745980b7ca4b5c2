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


@pytest.mark.parametrize("service", BATCHWIRE_SERVICES)
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
