"""docker-compose.yml checked statically (no Docker engine here): it must agree with the CLI and the code."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchwire.cli import build_parser
from schemas.wire import DEFAULT_NAMESPACE
from telemetry.metrics import REGISTRY

ROOT = Path(__file__).resolve().parent.parent
BATCHWIRE_SERVICES = ("gateway", "batcher", "gpu_worker")
HA_ROLES = ("gateway-ha", "batcher-ha", "gpu_worker-ha")
HA_KAFKA = ("kafka-1", "kafka-2", "kafka-3")
HA_SENTINELS = ("sentinel-1", "sentinel-2", "sentinel-3")
HA_BACKBONE = (*HA_KAFKA, "kafka-ha-init", "redis-primary", "redis-replica", *HA_SENTINELS)
TRACING_ROLES = ("gateway-tracing", "batcher-tracing", "gpu_worker-tracing")
CLUSTER_ROLES = ("gateway-cluster", "batcher-cluster", "gpu_worker-cluster")
CLUSTER_NODES = tuple(f"redis-node-{n}" for n in range(1, 7))
MONITORING = ROOT / "infra" / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "batchwire.json"


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


@pytest.mark.parametrize("service", BATCHWIRE_SERVICES + HA_ROLES + CLUSTER_ROLES)
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


def _roles(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The batchwire roles of every profile: the services built from this repository."""
    return {name: spec for name, spec in compose["services"].items() if "build" in spec}


def test_roles_that_share_a_kafka_namespace_share_one_redis(compose: dict[str, Any]) -> None:
    """Roles of one namespace on one Kafka join the same consumer groups: a batcher takes requests of
    every gateway there, and a worker stores their answers in its own Redis. Two profiles over the same
    Kafka with different Redis (run together, or `--profile cluster up` without naming its services)
    would send a share of each other's requests where their gateways never see the answer (504)."""
    stores: dict[tuple[str, str], dict[str, set[str]]] = {}
    for name, spec in _roles(compose).items():
        env = spec["environment"]
        key = (env["BATCHWIRE_KAFKA_BOOTSTRAP"], env.get("BATCHWIRE_NAMESPACE", DEFAULT_NAMESPACE))
        stores.setdefault(key, {}).setdefault(env["BATCHWIRE_REDIS_URL"], set()).add(name)
    for (bootstrap, namespace), by_url in stores.items():
        assert len(by_url) == 1, (
            f"namespace {namespace!r} on Kafka {bootstrap} is served over {len(by_url)} Redis deployments "
            f"({ {url: sorted(names) for url, names in by_url.items()} }): give each its own namespace"
        )


def _listen_port(command: list[str]) -> int:
    """The port a role serves HTTP on: the gateway's --port, a batcher's or worker's --metrics-port."""
    flag = "--port" if command[0] == "gateway" else "--metrics-port"
    assert flag in command, f"{command[0]} serves nothing a health check could ask without {flag}"
    return int(command[command.index(flag) + 1])


@pytest.mark.parametrize("profile", ["default", "ha", "cluster", "tracing"])
def test_every_role_has_a_health_check_on_the_port_it_serves(compose: dict[str, Any], profile: str) -> None:
    """docs/operations.md says every service of a deployment has a health check: `docker compose ps`
    shows a role that never came up, and a service may wait for it."""
    roles = {name: spec for name, spec in _roles(compose).items() if (spec.get("profiles") or ["default"]) == [profile]}
    assert roles, f"no roles in profile {profile}"
    for name, spec in roles.items():
        assert "healthcheck" in spec, f"{name} needs a health check"
        port = _listen_port(spec["command"])
        probe = " ".join(spec["healthcheck"]["test"])
        path = "/readyz" if spec["command"][0] == "gateway" else "/metrics"
        assert f"http://127.0.0.1:{port}{path}" in probe, f"{name}: the check asks {probe!r}, the role serves {port}"


def _seconds(duration: str) -> float:
    """A compose duration such as `45s` or `1m30s`, in seconds."""
    parts = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", duration)
    assert parts and duration, f"{duration!r}: write it as Nm or Ns"
    return 60 * int(parts[1] or 0) + int(parts[2] or 0)


def _shutdown_bound_s(command: list[str], env: dict[str, str]) -> float:
    """The longest a role's graceful stop (SIGTERM) may take, from the settings it runs with."""
    from batchwire.supervise import graceful_shutdown_s
    from gateway.settings import GatewaySettings
    from gpu_worker.worker import HAND_BACK_WRITE_S
    from transport.kafka.group import GroupTiming
    from transport.kafka.producers import DEFAULT_REQUEST_TIMEOUT_MS

    def setting(name: str) -> float:
        variable = "BATCHWIRE_" + name.upper()
        return float(env[variable]) if variable in env else float(subparser(command[0]).get_default(name))

    commit_s = GroupTiming().commit_timeout_s
    if command[0] == "gateway":  # the requests in hand, up to the longest deadline, then its producer's sends
        settings = GatewaySettings(max_timeout_ms=int(setting("max_timeout_ms")))
        return graceful_shutdown_s(settings) + DEFAULT_REQUEST_TIMEOUT_MS / 1000
    if command[0] == "worker":  # the batch in hand, the hand-back record, the commit
        return setting("drain_timeout_s") + HAND_BACK_WRITE_S + commit_s
    assert command[0] == "batcher"  # the batches on their way land, then their commit
    return DEFAULT_REQUEST_TIMEOUT_MS / 1000 + commit_s


def test_every_role_may_finish_its_graceful_stop_before_docker_kills_it(compose: dict[str, Any]) -> None:
    """`docker compose stop`, `down` or a recreate sends SIGTERM and, after stop_grace_period (10 s when
    unset), SIGKILL. A worker stops once its batch in hand ends (up to --drain-timeout-s), a gateway once
    its requests in hand are answered (up to --max-timeout-ms): killed sooner, a worker's batch counts as
    a death toward --max-deliveries and runs again, and a gateway's callers lose their connection."""
    for name, spec in _roles(compose).items():
        bound = _shutdown_bound_s(spec["command"], spec["environment"])
        grace = _seconds(spec.get("stop_grace_period", "10s"))
        assert grace >= bound + 3, f"{name}: stop_grace_period is {grace:g} s; its graceful stop may take {bound:g} s"


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
    in_monitoring = {name for name, spec in services.items() if "monitoring" in spec.get("profiles", [])}
    in_cluster = {name for name, spec in services.items() if "cluster" in spec.get("profiles", [])}
    in_profiles = in_ha | in_tracing | in_monitoring | in_cluster
    assert all("profiles" not in spec for name, spec in services.items() if name not in in_profiles), (
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


def test_the_cluster_profile_is_three_primaries_with_a_replica_each_and_the_roles_over_them(
    compose: dict[str, Any],
) -> None:
    services = compose["services"]
    in_cluster = {name for name, spec in services.items() if "cluster" in spec.get("profiles", [])}
    assert in_cluster == {*CLUSTER_NODES, "redis-cluster-init", *CLUSTER_ROLES}
    single = _redis_options(services["redis"]["command"])
    for name in CLUSTER_NODES:
        spec = services[name]
        assert spec["image"] == services["redis"]["image"] and spec["hostname"] == name
        options = _redis_options(shlex.split(spec["command"][-1])[1:])  # after `exec`
        for key in ("--maxmemory", "--maxmemory-policy", "--appendonly", "--appendfsync"):
            assert options[key] == single[key], f"{name} {key}: as the single Redis (bounded, noeviction, AOF everysec)"
        assert options["--cluster-enabled"] == "yes" and options["--cluster-config-file"] == "nodes.conf"
        assert spec["volumes"] == [f"{name}-data:/data"] and f"{name}-data" in compose["volumes"], "nodes.conf kept"
        assert "healthcheck" in spec
    init = services["redis-cluster-init"]
    assert init["restart"] == "no" and set(init["depends_on"]) == set(CLUSTER_NODES)
    assert "--cluster create" in init["command"][-1] and "--cluster-replicas 1" in init["command"][-1]
    url = "redis+cluster://" + ",".join(f"{name}:6379" for name in CLUSTER_NODES)
    for role in CLUSTER_ROLES:
        assert services[role]["environment"]["BATCHWIRE_REDIS_URL"] == url, role
        depends = services[role]["depends_on"]
        assert depends["redis-cluster-init"]["condition"] == "service_completed_successfully", role
        assert "healthcheck" in services[role]


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


@pytest.fixture(scope="module")
def prometheus() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    return config


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    model: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return model


def _mounts(spec: dict[str, Any]) -> dict[str, Path]:
    """A service's bind mounts: where in the container, from which path of this repository."""
    mounts = {}
    for mount in spec.get("volumes", []):
        source, target = mount.split(":")[:2]
        assert source.startswith("./"), f"{mount}: the monitoring services mount files of this repository"
        mounts[target] = ROOT / source
    return mounts


def _provisioned_datasource_uid() -> str:
    provisioning = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (datasource,) = provisioning["datasources"]
    assert (datasource["type"], datasource["url"]) == ("prometheus", "http://prometheus:9090")
    return str(datasource["uid"])


def test_the_monitoring_profile_runs_prometheus_and_grafana_over_the_repositorys_files(
    compose: dict[str, Any],
) -> None:
    services = compose["services"]
    in_monitoring = {name for name, spec in services.items() if "monitoring" in spec.get("profiles", [])}
    assert in_monitoring == {"prometheus", "grafana"}
    prometheus, grafana = services["prometheus"], services["grafana"]
    for spec, repository in ((prometheus, "prom/prometheus"), (grafana, "grafana/grafana")):
        name, _, tag = spec["image"].partition(":")
        assert name == repository and tag and tag != "latest", f"{spec['image']}: a pinned {repository} tag"
        assert "healthcheck" in spec, f"{repository} needs a health check"
    assert _mounts(prometheus) == {"/etc/prometheus/prometheus.yml": MONITORING / "prometheus.yml"}
    assert "127.0.0.1:9090:9090" in prometheus["ports"], "the port the Grafana datasource names"
    grafana_mounts = _mounts(grafana)
    assert grafana_mounts == {
        "/etc/grafana/provisioning": MONITORING / "grafana" / "provisioning",
        "/var/lib/grafana/dashboards": DASHBOARD.parent,
    }
    assert "127.0.0.1:3000:3000" in grafana["ports"]
    env = grafana["environment"]
    assert (env["GF_AUTH_ANONYMOUS_ENABLED"], env["GF_AUTH_ANONYMOUS_ORG_ROLE"]) == ("true", "Viewer")
    home = Path(env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert (home.parent, home.name) == (Path("/var/lib/grafana/dashboards"), DASHBOARD.name)
    assert grafana["depends_on"]["prometheus"]["condition"] == "service_healthy"
    provider = yaml.safe_load((MONITORING / "grafana/provisioning/dashboards/batchwire.yml").read_text())
    (files,) = provider["providers"]
    assert files["options"]["path"] == "/var/lib/grafana/dashboards", "where the dashboards are mounted"
    _provisioned_datasource_uid()


def test_prometheus_scrapes_every_role_of_the_default_deployment(
    compose: dict[str, Any], prometheus: dict[str, Any]
) -> None:
    services = compose["services"]
    roles = {name for name, spec in services.items() if "profiles" not in spec and "build" in spec}
    assert roles == set(BATCHWIRE_SERVICES), "the roles of `docker compose up`"
    scraped: dict[str, set[int]] = {}
    for job in prometheus["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics", job["job_name"]
        for target in job.get("dns_sd_configs", []):
            for name in target["names"]:
                scraped.setdefault(name, set()).add(target["port"])
        for group in job.get("static_configs", []):
            for address in group["targets"]:
                host, _, port = address.rpartition(":")
                scraped.setdefault(host, set()).add(int(port))
    gateway = services["gateway"]
    command = gateway["command"]
    assert scraped.get("gateway") == {int(command[command.index("--port") + 1])}, "the gateway's HTTP port"
    for role in ("batcher", "gpu_worker"):
        command = services[role]["command"]
        assert "--metrics-port" in command, f"{role} must serve its metrics"
        port = int(command[command.index("--metrics-port") + 1])
        assert port > 0 and scraped.get(role) == {port}, f"{role}: scrape {port}, the --metrics-port; got {scraped}"
    # With API keys on, /metrics takes an operator key only: the gateway's job would need one.
    (gateway_job,) = [job for job in prometheus["scrape_configs"] if job["job_name"] == "gateway"]
    keys = {"BATCHWIRE_API_KEYS", "BATCHWIRE_API_KEYS_FILE"} & set(gateway["environment"])
    assert not keys or "authorization" in gateway_job, f"the gateway has {keys}: Prometheus needs an operator key"


_FAMILY_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
}
_NOT_METRICS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or", "unless"}


def _exported_names() -> set[str]:
    """The series names REGISTRY's metrics appear under in Prometheus."""
    return {family.name + suffix for family in REGISTRY.collect() for suffix in _FAMILY_SUFFIXES[family.type]}


def _metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: the identifiers outside label matchers, ranges, strings
    and groupings that call nothing and are no keyword (a number or a duration is no identifier)."""
    bare = re.sub(r'\{[^}]*\}|\[[^\]]*\]|"[^"]*"', " ", expr)
    bare = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", bare)
    tokens = re.findall(r"(\d[\w.+-]*)|([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?", bare)
    return {name for _number, name, call in tokens if name and not call and name not in _NOT_METRICS}


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel that draws something (rows only group them), nested rows' panels too."""
    panels = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            panels.extend(panel.get("panels", []))
        else:
            panels.append(panel)
    return panels


def test_the_dashboard_queries_the_provisioned_prometheus_in_every_panel(dashboard: dict[str, Any]) -> None:
    uid = _provisioned_datasource_uid()
    assert dashboard["uid"] and dashboard["title"] and 36 <= dashboard["schemaVersion"] <= 41
    panels = _panels(dashboard)
    assert panels, "the dashboard has panels"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), f"panel ids repeat: {ids}"
    variables = {variable["name"] for variable in dashboard["templating"]["list"]}
    assert "model" in variables
    for panel in panels:
        title = panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": uid}, f"{title}: the provisioned datasource"
        assert panel["targets"], f"{title} has no query"
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}, title
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == uid and target["expr"].strip(), title
            used = set(re.findall(r"\$(\w+)", target["expr"])) - {"__rate_interval", "__interval", "__range"}
            assert used <= variables, f"{title}: undefined variables {used - variables}"


def test_every_metric_the_dashboard_queries_is_one_batchwire_exports(
    dashboard: dict[str, Any], prometheus: dict[str, Any]
) -> None:
    exported = _exported_names()
    assert {"batchwire_requests_total", "batchwire_batch_size_bucket", "batchwire_batcher_pending"} <= exported
    jobs = {job["job_name"] for job in prometheus["scrape_configs"]}
    queried: set[str] = set()
    for panel in _panels(dashboard):
        for target in panel["targets"]:
            names = _metric_names(target["expr"])
            assert names, f"{panel['title']}: no metric found in {target['expr']!r}"
            assert names <= exported, f"{panel['title']}: {sorted(names - exported)} are not in telemetry/metrics.py"
            named_jobs = set(re.findall(r'job="([^"]*)"', target["expr"]))
            assert named_jobs <= jobs, f"{panel['title']}: jobs {named_jobs - jobs} are not scraped"
            queried |= names
    # The panels the dashboard is for: rate, latency, refusals, queue, batches, flushes, workers, cache.
    for name in (
        "batchwire_request_latency_seconds_bucket",
        "batchwire_tier_submits_total",
        "batchwire_request_topic_lag",
        "batchwire_batch_size_sum",
        "batchwire_flushes_total",
        "batchwire_worker_busy_seconds_total",
        "batchwire_worker_batches_total",
        "batchwire_cache_hits_total",
        "batchwire_cache_misses_total",
    ):
        assert name in queried, f"no panel shows {name}"


def test_the_dashboards_refusals_leave_out_the_probes_and_scrapes(dashboard: dict[str, Any]) -> None:
    """An unready gateway answers its health probe (compose's, every 5 s) and a fleet read 503: no
    client's request was refused, and the fleet's own figures leave them out (``telemetry.heartbeat``)."""
    operational = ("/readyz", "/healthz", "/metrics", "/v1/fleet", "/dashboard", "/dashboard/events")
    for panel in _panels(dashboard):
        for target in panel["targets"]:
            expr = target["expr"]
            if "batchwire_requests_total" not in expr or "503" not in expr:
                continue
            excluded = re.search(r'route!~"([^"]*)"', expr)
            assert excluded is not None, f"{panel['title']}: counts the probes' and scrapes' 503s: {expr}"
            kept = [route for route in operational if not re.fullmatch(excluded.group(1), route)]
            assert not kept, f"{panel['title']}: counts the 503s of {kept}: {expr}"
