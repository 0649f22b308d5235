"""deploy/kubernetes/: the Deployment's command and probes, and the KEDA ScaledObject's streams,
group and lag, checked against the real CLI parser, the real service and a real server.

No cluster runs here: the files are parsed as data. The lag test reads what KEDA's Redis Streams
scaler reads in lagCount mode (``XINFO GROUPS <stream>``, the ``lag`` of ``consumerGroup``) on
every stream the ScaledObject names, on the test's Valkey with a backlog, and compares it with
``framework status --json`` for that group.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import redis
import yaml

from broker.redis import RedisBroker
from example_services.quickstart import PLACE_ORDER, orders
from framework import SyncClient
from framework.cli import build_parser
from framework.cli.run import load_services
from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parent.parent
KUBE = ROOT / "deploy" / "kubernetes"


def _documents() -> dict[str, dict]:
    found = {}
    for path in sorted(KUBE.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            found[doc["kind"]] = doc
    return found


def _container() -> dict:
    return _documents()["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def _env() -> dict[str, dict]:
    return {e["name"]: e for e in _container()["env"]}


def _triggers() -> list[dict]:
    return _documents()["ScaledObject"]["spec"]["triggers"]


def test_the_deployment_runs_a_real_service_with_probes_on_its_health_port() -> None:
    container = _container()
    argv = container["args"]
    assert argv[0] == "framework"
    args = build_parser().parse_args(argv[1:])  # the real parser: every option exists and is valid
    assert args.command == "run"
    assert [s.name for s in load_services(args.targets)] == [orders.name]
    assert args.health_host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["health"] == args.health_port
    assert ports["metrics"] == args.metrics_port
    assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "health"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    grace = _documents()["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > args.shutdown_timeout  # the drain finishes before Kubernetes kills the pod
    env = _env()
    assert "secretKeyRef" in env["REDIS_PASSWORD"]["valueFrom"]  # no password in the file
    assert env["BROKER_URL"]["value"] == "redis://:$(REDIS_PASSWORD)@$(REDIS_ADDRESS)/0"


def test_the_scaled_object_names_every_partition_stream_of_the_group_in_lag_mode() -> None:
    docs = _documents()
    scaled = docs["ScaledObject"]["spec"]
    assert scaled["scaleTargetRef"]["name"] == docs["Deployment"]["metadata"]["name"]
    assert scaled["minReplicaCount"] == 0  # lag mode is the one that scales to zero
    assert scaled["maxReplicaCount"] <= PLACE_ORDER.partitions  # owned partitions: more pods would idle
    namespace = _env()["FRAMEWORK_NAMESPACE"]["value"]
    address = _env()["REDIS_ADDRESS"]["value"]
    assert re.fullmatch(r"[\w.-]+:\d+", address)  # KEDA wants host:port, not a URL
    streams = []
    for trigger in _triggers():
        meta = trigger["metadata"]
        assert trigger["type"] == "redis-streams"
        assert meta["consumerGroup"] == orders.name  # the group is the service's name
        assert int(meta["lagCount"]) > 0 and int(meta["activationLagCount"]) >= 0
        assert "pendingEntriesCount" not in meta and "streamLength" not in meta
        assert meta["addressFromEnv"] == "REDIS_ADDRESS" and meta["passwordFromEnv"] == "REDIS_PASSWORD"
        streams.append(meta["stream"])
    assert streams == [f"{namespace}:{{{PLACE_ORDER.name}:{p}}}" for p in range(PLACE_ORDER.partitions)]


@pytest.mark.anyio
async def test_the_lag_keda_reads_is_the_lag_framework_status_reports(
    broker: RedisBroker, redis_url: str, namespace: str, worker_env: dict[str, str]
) -> None:
    (handler,) = [h for h in orders.handlers if h.destination.name == PLACE_ORDER.name]
    spec = await broker.declare(handler.spec)
    await broker.subscribe(spec, orders.name)  # the group a running `orders` worker joins
    with SyncClient(redis_url, namespace=namespace) as client:
        client.send_many(
            PLACE_ORDER,
            [{"order_id": str(i), "customer": f"c{i % 7}", "total_cents": 100, "card": "ok"} for i in range(300)],
            key=lambda c: c["customer"],
        )
    manifest_ns = _env()["FRAMEWORK_NAMESPACE"]["value"]
    r = redis.Redis.from_url(redis_url)
    first = f"{namespace}:{{{PLACE_ORDER.name}:0}}"
    r.xreadgroup(orders.name, "probe", {first: ">"}, count=25)  # part of the backlog delivered, not acked

    keda: list[int] = []  # what KEDA reads per trigger: XINFO GROUPS <stream> -> lag of consumerGroup
    for trigger in _triggers():
        meta = trigger["metadata"]
        stream = namespace + meta["stream"].removeprefix(manifest_ns)  # the test's namespace, same layout
        groups = {g["name"].decode(): g for g in r.xinfo_groups(stream)}
        lag = groups[meta["consumerGroup"]]["lag"]
        assert lag is not None  # Redis 7+ / Valkey: lagCount mode works
        keda.append(int(lag))

    status = run_cli("status", "--json", PLACE_ORDER.name, env=worker_env)
    assert status.returncode == 0, status.stderr
    (dest,) = json.loads(status.stdout)
    per_partition = [
        next(g["lag"] for g in p["groups"] if g["group"] == orders.name)
        for p in sorted(dest["per_partition"], key=lambda p: p["partition"])
    ]
    total = next(g["lag"] for g in dest["groups"] if g["group"] == orders.name)
    assert keda == per_partition
    assert sum(keda) == total == 300 - 25
    assert all(lag > 0 for lag in keda)  # the keys spread the backlog over both partitions
