"""compose.yaml parses, runs the example shop (one container per service running `framework run`),
names the right images, and its commands are real framework commands.

No Docker engine runs here, so the file is checked as data: images, commands (parsed by the real
CLI parser), start order (tables migrated before the relay), ports bound to 127.0.0.1 only, and
passwords taken from the environment (documented in .env.example), never written in the file.
The observability stack is checked the same way: every file a service mounts exists and parses,
and every name one file gives another (the collector's endpoint in the services' environment,
Prometheus' scrape targets, Grafana's datasources and dashboard folder, the dashboard's datasource
uids) points at a service, a port or a file that is really there.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from framework.cli import build_parser
from framework.cli.run import load_services

ROOT = Path(__file__).resolve().parent.parent
_REQUIRED_VAR = re.compile(r"\$\{(\w+):\?[^}]*\}")


def _compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


SHOP = ("orders", "billing", "inventory", "shipping", "notifications")


def test_compose_file_names_the_right_images_and_commands() -> None:
    services = _compose()["services"]
    assert services["redis"]["image"].startswith("redis:")  # real Redis
    assert services["redis"]["command"][0] == "redis-server" and "--appendonly" in services["redis"]["command"]
    assert services["postgres"]["image"].startswith("postgres:")
    assert services["jaeger"]["image"].startswith("jaegertracing/")
    parser = build_parser()
    for name in (*SHOP, "outbox-relay"):
        svc = services[name]
        assert svc["build"] == "." and svc["environment"]["REDIS_URL"].startswith("redis://")
        command = svc["command"]
        assert command[0] == "framework"
        args = parser.parse_args(command[1:])  # a real sub-command with valid options
        if command[1] == "run":  # one container per service, each the shop's module of that name
            assert args.targets == [f"example_services.shop.{name}:{name}"]
            assert [s.name for s in load_services(args.targets)] == [name]
    assert services["migrate"]["command"] == ["python", "-m", "example_services.shop.db"]
    api = services["api"]["command"]
    assert api[:2] == ["uvicorn", "example_services.shop.orders:app"] and "0.0.0.0" in api
    from example_services.shop.orders import app

    assert {r.path for r in app.routes} == {"/orders", "/orders/{order_id}"}
    assert (ROOT / "Dockerfile").exists()
    assert "framework" in shlex.split((ROOT / "Dockerfile").read_text().splitlines()[-1].split("CMD", 1)[1])[0]
    assert ".[sql,web]" in (ROOT / "Dockerfile").read_text()  # the API's Starlette and uvicorn


def test_every_shop_container_starts_after_the_tables_exist() -> None:
    services = _compose()["services"]
    for name in (*SHOP, "api"):
        deps = services[name]["depends_on"]
        assert deps["migrate"]["condition"] == "service_completed_successfully", name
        assert deps["redis"]["condition"] == "service_healthy", name


def test_redis_and_postgres_ports_do_not_collide_with_a_developers_own() -> None:
    services = _compose()["services"]
    for name, usual in (("redis", 6379), ("postgres", 5432)):
        [published] = services[name]["ports"]
        host_port = re.sub(r"\$\{\w+:-(\d+)\}", r"\1", published).split(":")[1]
        assert int(host_port) != usual, f"{name} is published on its usual port {usual}"


def test_the_relay_starts_only_after_the_tables_are_migrated() -> None:
    services = _compose()["services"]
    relay_deps = services["outbox-relay"]["depends_on"]
    assert relay_deps["migrate"]["condition"] == "service_completed_successfully"
    assert services["migrate"]["restart"] == "no"  # one-shot, not a crash loop
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"


def test_ports_are_published_on_loopback_only() -> None:
    for name, svc in _compose()["services"].items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"


def test_passwords_come_from_the_environment_and_env_example_lists_them() -> None:
    text = (ROOT / "compose.yaml").read_text()
    services = _compose()["services"]
    assert "postgres:postgres@" not in text and "POSTGRES_PASSWORD: postgres" not in text
    assert _REQUIRED_VAR.fullmatch(services["postgres"]["environment"]["POSTGRES_PASSWORD"])
    redis_cmd = services["redis"]["command"]
    assert _REQUIRED_VAR.fullmatch(redis_cmd[redis_cmd.index("--requirepass") + 1])
    for name in (*SHOP, "outbox-relay", "migrate", "api"):
        env = services[name]["environment"]
        assert _REQUIRED_VAR.search(env["REDIS_URL"]) and _REQUIRED_VAR.search(env["DATABASE_URL"])
        assert "--database-url" not in services[name]["command"]  # a password on a command line shows in ps
    needed = set(_REQUIRED_VAR.findall(text))
    example = dict(
        line.split("=", 1)
        for line in (ROOT / ".env.example").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    )
    assert needed == {"REDIS_PASSWORD", "VALKEY_PASSWORD", "POSTGRES_PASSWORD", "GRAFANA_ADMIN_PASSWORD"}
    assert needed <= set(example)
    assert _REQUIRED_VAR.fullmatch(services["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"])


# -- the observability stack ----------------------------------------------------------------------------

DEPLOY = ROOT / "deploy" / "observability"
_VERSION_TAG = re.compile(r":v?\d+\.\d+\.\d+$")
_METRICS_SERVICES = ("orders", "billing", "inventory", "shipping", "notifications", "outbox-relay")  # --metrics-port


def _yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _mounts(svc: dict) -> dict[str, Path]:
    """Container path -> host path of a service's bind mounts (named volumes left out)."""
    found = {}
    for volume in svc.get("volumes", []):
        source, target, *_ = volume.split(":")
        if source.startswith("./"):
            found[target] = ROOT / source
    return found


def _mounted(service: str, container_path: str) -> Path:
    """The host file behind ``container_path`` in ``service`` (through a mounted file or directory)."""
    for target, source in _mounts(_compose()["services"][service]).items():
        if container_path == target:
            return source
        if container_path.startswith(target.rstrip("/") + "/"):
            return source / container_path[len(target.rstrip("/")) + 1 :]
    raise AssertionError(f"{service} mounts nothing at {container_path}")


def _host_port(url_or_address: str) -> tuple[str, int]:
    parts = urlsplit(url_or_address if "//" in url_or_address else f"//{url_or_address}")
    assert parts.hostname and parts.port, url_or_address
    return parts.hostname, parts.port


def test_observability_services_run_pinned_images() -> None:
    services = _compose()["services"]
    expected = {
        "otel-collector": "otel/opentelemetry-collector-contrib:",
        "jaeger": "jaegertracing/",
        "prometheus": "prom/prometheus:",
        "grafana": "grafana/grafana:",
    }
    for name, prefix in expected.items():
        image = services[name]["image"]
        assert image.startswith(prefix), f"{name} runs {image}"
        assert _VERSION_TAG.search(image), f"{name}: pin a version, not {image!r}"


def test_every_mounted_file_exists_and_parses() -> None:
    mounted = 0
    for name, svc in _compose()["services"].items():
        for source in _mounts(svc).values():
            assert source.exists(), f"{name} mounts {source}, which does not exist"
            files = sorted(source.rglob("*")) if source.is_dir() else [source]
            assert files, f"{name} mounts the empty directory {source}"
            for f in (f for f in files if f.is_file()):
                mounted += 1
                if f.suffix in (".yaml", ".yml"):
                    assert isinstance(_yaml(f), dict), f
                elif f.suffix == ".json":
                    assert isinstance(json.loads(f.read_text()), dict), f
    assert mounted >= 5  # collector, prometheus, two provisioning files, the dashboard


def test_services_send_traces_to_the_collector_and_serve_metrics() -> None:
    services = _compose()["services"]
    collector = _yaml(_mounted("otel-collector", services["otel-collector"]["command"][0].split("=", 1)[1]))
    http_port = _host_port(collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"])[1]
    parser = build_parser()
    prometheus = _yaml(_mounted("prometheus", "/etc/prometheus/prometheus.yml"))
    scraped = {
        (name, sd["port"])
        for job in prometheus["scrape_configs"]
        for sd in job.get("dns_sd_configs", [])
        for name in sd["names"]
    }
    for name in (*SHOP, "outbox-relay", "api"):
        env = services[name]["environment"]
        # the framework's exporter speaks OTLP/HTTP: the collector's HTTP receiver, not gRPC's 4317
        assert _host_port(env["OTEL_EXPORTER_OTLP_ENDPOINT"]) == ("otel-collector", http_port)
        assert env["OTEL_SERVICE_NAME"] == name
        assert env["OTEL_METRICS_EXPORTER"] == "none"  # scraped by Prometheus, not pushed twice
    for name in _METRICS_SERVICES:
        args = parser.parse_args(services[name]["command"][1:])
        assert args.metrics_host == "0.0.0.0"  # reachable from the Prometheus container
        assert (name, args.metrics_port) in scraped, f"Prometheus does not scrape {name}:{args.metrics_port}"
        if args.command == "run":
            assert [s.name for s in load_services(args.targets)] == [services[name]["environment"]["OTEL_SERVICE_NAME"]]


def test_collector_pipelines_are_complete_and_export_to_jaeger_and_prometheus() -> None:
    services = _compose()["services"]
    config = _yaml(DEPLOY / "otel-collector.yaml")
    for pipeline, spec in config["service"]["pipelines"].items():
        for part in ("receivers", "processors", "exporters"):
            for component in spec.get(part, []):
                assert component in config[part], f"{pipeline} uses {component}, not defined in {part}"
    traces = config["service"]["pipelines"]["traces"]
    assert "otlp" in traces["receivers"]
    [jaeger_exporter] = [e for e in traces["exporters"] if e.startswith("otlp")]
    host, port = _host_port(config["exporters"][jaeger_exporter]["endpoint"])
    assert host == "jaeger" and host in services and port == 4317  # Jaeger v2 takes OTLP/gRPC there
    assert "prometheus" in config["service"]["pipelines"]["metrics"]["exporters"]
    # both OTLP ports are reachable from the host, on loopback
    assert {"127.0.0.1:4317:4317", "127.0.0.1:4318:4318"} <= set(services["otel-collector"]["ports"])


def test_prometheus_scrapes_only_services_that_exist_on_ports_they_serve() -> None:
    services = _compose()["services"]
    collector = _yaml(DEPLOY / "otel-collector.yaml")
    collector_ports = {
        _host_port(collector["exporters"]["prometheus"]["endpoint"])[1],
        collector["service"]["telemetry"]["metrics"]["readers"][0]["pull"]["exporter"]["prometheus"]["port"],
    }
    prometheus = _yaml(DEPLOY / "prometheus.yml")
    targets = []
    for job in prometheus["scrape_configs"]:
        for static in job.get("static_configs", []):
            targets += [_host_port(t) for t in static["targets"]]
        for sd in job.get("dns_sd_configs", []):
            targets += [(name, sd["port"]) for name in sd["names"]]
    assert targets
    for host, port in targets:
        assert host in services, f"Prometheus scrapes {host}, which compose.yaml does not run"
        if host == "otel-collector":
            assert port in collector_ports, f"the collector serves no metrics on {port}"


def test_grafana_provisions_its_datasources_and_the_dashboard() -> None:
    services = _compose()["services"]
    grafana = services["grafana"]
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"  # look, do not edit
    assert "127.0.0.1:3000:3000" in grafana["ports"]
    assert "127.0.0.1:16686:16686" in services["jaeger"]["ports"]
    datasources = _yaml(_mounted("grafana", "/etc/grafana/provisioning/datasources/datasources.yaml"))
    by_uid = {d["uid"]: d for d in datasources["datasources"]}
    assert {d["type"] for d in by_uid.values()} == {"prometheus", "jaeger"}
    expected_ports = {"prometheus": 9090, "jaeger": 16686}
    for source in by_uid.values():
        host, port = _host_port(source["url"])
        assert host in services and port == expected_ports[source["type"]], source["url"]
    assert "127.0.0.1:9090:9090" in services["prometheus"]["ports"]

    [provider] = _yaml(_mounted("grafana", "/etc/grafana/provisioning/dashboards/dashboards.yaml"))["providers"]
    folder = _mounted("grafana", provider["options"]["path"])
    dashboards = sorted(folder.glob("*.json"))
    assert dashboards, f"Grafana's dashboard folder {folder} holds no dashboard"
    home = _mounted("grafana", grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert home in dashboards
    for path in dashboards:
        used = _datasource_uids(json.loads(path.read_text()))
        assert used and used <= set(by_uid), f"{path.name} uses datasources {used - set(by_uid)} Grafana lacks"


def _datasource_uids(node: object) -> set[str]:
    """Every datasource uid a dashboard refers to (panels, targets, template variables)."""
    found: set[str] = set()
    if isinstance(node, dict):
        source = node.get("datasource")
        if isinstance(source, dict) and "uid" in source:
            found.add(source["uid"])
        for value in node.values():
            found |= _datasource_uids(value)
    elif isinstance(node, list):
        for value in node:
            found |= _datasource_uids(value)
    return found


def test_the_cluster_profile_runs_three_cluster_nodes_and_a_one_shot_create() -> None:
    services = _compose()["services"]
    nodes = [f"valkey-node-{i}" for i in (1, 2, 3)]
    for name in nodes:
        svc = services[name]
        assert svc["profiles"] == ["cluster"] and svc["image"].startswith("valkey/valkey:")
        command = svc["command"]
        assert command[0] == "valkey-server"
        options = dict(zip(command[1::2], command[2::2], strict=True))
        assert options["--cluster-enabled"] == "yes" and options["--appendonly"] == "yes"
        assert options["--cluster-announce-hostname"] == name  # clients in the network reach every node
        assert _REQUIRED_VAR.fullmatch(options["--requirepass"]) and options["--masterauth"] == options["--requirepass"]
        assert "ports" not in svc  # announced names resolve only inside the compose network
        assert f"{name}-data" in _compose()["volumes"]
    init = services["valkey-cluster-init"]
    assert init["profiles"] == ["cluster"] and init["restart"] == "no"
    assert {n: d["condition"] for n, d in init["depends_on"].items()} == dict.fromkeys(nodes, "service_healthy")
    script = init["command"][0]
    assert "--cluster create" in script and "--cluster-replicas 0" in script and "--cluster-yes" in script
    assert all(f"getent hosts {n}" in script for n in nodes)
    assert _REQUIRED_VAR.fullmatch(init["environment"]["REDISCLI_AUTH"])  # valkey-cli's password, from .env
    assert all("cluster" not in services[s].get("profiles", []) for s in ("redis", *SHOP))
