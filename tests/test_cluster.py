"""The framework on a real 3-master Redis Cluster started by the test (embedded Valkey, own directory).

Partitions spread over the nodes; worker processes consume a partitioned queue with the inbox,
retries and a dead letter, one of them SIGKILLed mid-way; the CLI reads the cluster; the ownership
test's ordered workload (per-key order under SIGKILLs and a SIGSTOP past the lease) runs on it. The Spark
export over a cluster is in ``tests/spark/test_spark_cluster.py`` (it shares the Spark session).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis

from broker import connect
from broker.codec import decode_fields
from broker.redis.cluster_client import stream_read_keys
from broker.redis.embedded_cluster import RunningCluster, slot_ranges, start_cluster
from broker.redis.keys import KeySpace
from broker.redis.sync_client import sync_client
from framework.client import Client
from framework.testing import delete_namespace, unique_namespace
from tests.conftest import ROOT, run_cli
from tests.ordered_workload import run_ordered_workload
from tests.test_ownership import check_fenced_intake
from tests.workers import Workers, wait_for

pytestmark = pytest.mark.slow

PARTITIONS = 8


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    running = start_cluster(tmp_path_factory.mktemp("valkey-cluster"), nodes=3)
    yield running
    running.stop()


@pytest.fixture
def ns(cluster: RunningCluster) -> Iterator[str]:
    namespace = unique_namespace("cluster")
    yield namespace
    delete_namespace(cluster.url, namespace)


@pytest.fixture
def cluster_client(cluster: RunningCluster) -> Iterator[Any]:
    client = sync_client(cluster.url)
    assert isinstance(client, redis.RedisCluster)
    yield client
    client.close()


@pytest.fixture
def env(cluster: RunningCluster, ns: str, tmp_path: Path) -> dict[str, str]:
    out = dict(os.environ)
    out.update(
        REDIS_URL=cluster.url,
        FRAMEWORK_NAMESPACE=ns,
        FRAMEWORK_HOME=str(tmp_path / "home"),  # never the user's embedded server
        PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "apps"), str(ROOT), out.get("PYTHONPATH", "")]),
        FRAMEWORK_LOG_FORMAT="json",
    )
    return out


def test_slots_are_shared_out_whole_and_stream_reads_are_routed_by_their_keys() -> None:
    ranges = slot_ranges(3)
    assert ranges[0][0] == 0 and ranges[-1][1] == 16383
    assert all(a[1] + 1 == b[0] for a, b in itertools.pairwise(ranges))
    args = ("GROUP", "g", "c", "COUNT", 10, "BLOCK", 5, "STREAMS", "ns:{d:1}", "ns:{d:1}:g:x:redeliver", ">", ">")
    assert stream_read_keys("XREADGROUP", args) == ["ns:{d:1}", "ns:{d:1}:g:x:redeliver"]
    tricky = ("GROUP", "streams", "STREAMS", "STREAMS", "k", ">")  # a group and a consumer called so
    assert stream_read_keys("XREADGROUP", tricky) == ["k"]
    assert stream_read_keys("XREAD", ("COUNT", 1, "STREAMS", "a", "b", "0", "0")) == ["a", "b"]
    assert stream_read_keys("XREADGROUP", ("GROUP", "g", "c", "STREAMS", "a")) is None  # malformed: redis-py's


def test_the_local_cluster_is_formed_and_any_node_url_works(cluster: RunningCluster) -> None:
    status = cluster.cluster.status()
    assert status.running and len(status.nodes) == 3
    assert cluster.cluster.cluster_info()["cluster_state"] == "ok"
    other = cluster.url.replace(f":{status.nodes[0].port}/", f":{status.nodes[2].port}/")

    async def check() -> None:
        broker = await connect(other, namespace="probe")
        try:
            assert broker.cluster
            assert len(broker.redis.get_primaries()) == 3
        finally:
            await broker.close()

    anyio.run(check)


def test_a_stale_owner_reads_and_claims_nothing_on_a_cluster(cluster: RunningCluster, ns: str) -> None:
    """The fenced intake (owned_intake.lua) on a cluster: routed to the partition's node, sent once."""

    async def check() -> None:
        broker = await connect(cluster.url, namespace=ns)
        try:
            await check_fenced_intake(broker)
        finally:
            await broker.close()

    anyio.run(check)


def test_the_server_command_starts_reports_and_stops_a_local_cluster(tmp_path: Path) -> None:
    env = {**os.environ, "FRAMEWORK_HOME": str(tmp_path / "home")}
    env.pop("REDIS_URL", None)
    where = ["--cluster", "--data-dir", str(tmp_path / "cl")]
    try:
        started = run_cli("server", "start", "--cluster", "3", *where[1:], env=env)
        assert started.returncode == 0, started.stderr
        password = (tmp_path / "cl" / "password").read_text().strip()
        assert password not in started.stdout  # the file is named, the password never printed
        [export] = [line.strip() for line in started.stdout.splitlines() if "export REDIS_URL=" in line]
        port = int(export.rsplit(":", 1)[1].split("/")[0])
        url = f"redis://:{password}@127.0.0.1:{port}/0"
        client = sync_client(url)
        assert isinstance(client, redis.RedisCluster) and len(client.get_primaries()) == 3
        client.mset_nonatomic({f"kept:{i}": str(i) for i in range(30)})  # keys on every node
        client.close()
        status = run_cli("server", "status", *where, env=env)
        assert status.returncode == 0 and "cluster_state:ok" in status.stdout and password not in status.stdout
        assert run_cli("server", "stop", *where, env=env).stdout.strip() == "stopped the local cluster"
        assert run_cli("server", "status", *where, env=env).returncode == 3
        # started again: same ports, same slots (nodes.conf), same data (AOF)
        assert f"127.0.0.1:{port}/0" in run_cli("server", "start", *where, env=env).stdout
        client = sync_client(url)
        assert client.mget_nonatomic([f"kept:{i}" for i in range(30)]) == [str(i).encode() for i in range(30)]
        client.close()
    finally:
        run_cli("server", "stop", *where, env=env)


def test_partitions_of_a_topic_spread_over_the_nodes(cluster: RunningCluster, ns: str, cluster_client: Any) -> None:
    async def publish() -> None:
        async with Client(cluster.url, namespace=ns) as client:
            from framework import Topic

            topic = Topic("cl.events", partitions=PARTITIONS)
            for i in range(0, 400, 100):
                async with client.batch() as b:
                    for j in range(i, i + 100):
                        b.publish(topic, {"n": j}, key=f"k{j}")

    anyio.run(publish)
    keyspace = KeySpace(ns)
    streams = [keyspace.partition("cl.events", p).stream for p in range(PARTITIONS)]
    nodes = {cluster_client.get_node_from_key(s).name for s in streams}
    assert len(nodes) >= 2, nodes
    assert sum(cluster_client.xlen(s) for s in streams) == 400
    assert all(cluster_client.xlen(s) > 0 for s in streams)


def test_the_outbox_relay_publishes_to_partitions_on_every_node(
    cluster: RunningCluster, ns: str, cluster_client: Any, tmp_path: Path
) -> None:
    """Committed outbox rows reach a partitioned topic whose partitions live on different nodes, each
    key in commit order, once (a second relay pass publishes nothing)."""
    from framework import Topic, outbox
    from framework.outbox import OutboxRelay

    topic = Topic("cl.relayed", partitions=PARTITIONS)

    async def relay() -> list[str]:
        engine = outbox.create_engine(f"sqlite:///{tmp_path / 'outbox.db'}")
        broker = await connect(cluster.url, namespace=ns)
        try:
            await outbox.create_tables(engine)
            async with engine.begin() as conn:
                ids = [await outbox.add_event(conn, topic, {"n": i}, key=f"k{i % 20}") for i in range(200)]
            relayer = OutboxRelay(engine, broker)
            assert await relayer.drain() == 200
            assert await relayer.run_once() == 0
            return ids
        finally:
            await broker.close()
            await engine.dispose()

    ids = anyio.run(relay)
    keyspace = KeySpace(ns)
    streams = [keyspace.partition(topic.name, p).stream for p in range(PARTITIONS)]
    assert len({cluster_client.get_node_from_key(s).name for s in streams if cluster_client.xlen(s)}) >= 2
    by_key: dict[str, list[str]] = {}
    for s in streams:
        for _, fields in cluster_client.xrange(s):
            envelope = decode_fields(fields, topic.name, "event")
            by_key.setdefault(str(envelope.key), []).append(envelope.id)
    assert by_key == {f"k{k}": ids[k::20] for k in range(20)}  # every row once, each key in commit order


def _applied_counts(client: Any, ns: str, queue: str) -> Callable[[], dict[str, int]]:
    """A reader of the times each job of ``queue`` was applied (clusterapp's per-partition hashes)."""
    keys = [f"{ns}:test:{{{queue}:{p}}}:applied" for p in range(PARTITIONS)]

    def applied() -> dict[str, int]:
        out: dict[str, int] = {}
        for key in keys:
            out.update({k.decode(): int(v) for k, v in client.hgetall(key).items()})
        return out

    return applied


def _move_slot(client: Any, slot: int, target: Any, password: str | None, pause: float) -> int:
    """Reshard one slot to ``target`` the way ``redis-cli --cluster reshard`` does: IMPORTING and
    MIGRATING, keys moved by MIGRATE a few at a time (with ``pause`` between, so commands meet the
    slot half-moved), then the slot assigned on the target, the source and the others, in that
    order (redis-cli's). Returns the keys moved."""
    source = client.nodes_manager.get_node_from_slot(slot)
    source_id = client.execute_command("CLUSTER MYID", target_nodes=source)
    target_id = client.execute_command("CLUSTER MYID", target_nodes=target)
    client.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", source_id, target_nodes=target)
    client.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", target_id, target_nodes=source)
    moved = 0
    auth = ("AUTH", password) if password else ()
    while keys := client.execute_command("CLUSTER GETKEYSINSLOT", slot, 3, target_nodes=source):
        client.execute_command(
            "MIGRATE", target.host, target.port, "", 0, 10_000, *auth, "KEYS", *keys, target_nodes=source
        )
        moved += len(keys)
        time.sleep(pause)
    others = [n for n in client.get_primaries() if n.name not in (target.name, source.name)]
    for node in (target, source, *others):  # the target first: it ends IMPORTING before the source points at it
        client.execute_command("CLUSTER SETSLOT", slot, "NODE", target_id, target_nodes=node)
    client.nodes_manager.initialize()  # this client's own map (workers learn from MOVED replies)
    return moved


def test_resharding_with_the_workers_stopped_while_producers_publish_loses_and_doubles_nothing(
    cluster: RunningCluster, ns: str, env: dict[str, str], cluster_client: Any, tmp_path: Path
) -> None:
    """The procedure docs/cluster.md gives: workers consume, are stopped (SIGTERM), four partitions'
    slots move to other nodes (keys migrated a few at a time) while a producer goes on publishing,
    workers start again: every job applied once, lag back to zero, nothing dead-lettered."""
    total, moving = 4000, range(4)
    sent = 0

    async def send() -> None:
        nonlocal sent
        async with Client(cluster.url, namespace=ns) as client:
            from framework import Queue

            queue = Queue("cl.moves", partitions=PARTITIONS)
            for start in range(0, total, 100):
                batch = [{"n": n} for n in range(start, start + 100)]
                await client.send_many(queue, batch, key=lambda c: f"k{c['n'] % 100}")
                sent = start + 100
                await anyio.sleep(0.05)

    applied = _applied_counts(cluster_client, ns, "cl.moves")

    password = urllib.parse.urlsplit(cluster.url).password
    workers = Workers(env, tmp_path)
    producer = threading.Thread(target=anyio.run, args=(send,))
    opts = ("--visibility-timeout", "3", "--shutdown-timeout", "5", "--lease-ttl", "2")

    def start(names: tuple[str, ...]) -> None:
        for name in names:
            workers.start("clusterapp:moves", name, *opts)
        for name in names:
            wait_for(lambda name=name: "runtime started" in workers.log(name), 30, f"{name} to start")

    try:
        start(("w1", "w2"))
        producer.start()
        wait_for(lambda: len(applied()) >= 500, 30, "the workers to get going")
        for proc in workers.procs:  # the procedure: the group's workers stop (gracefully) first
            proc.send_signal(signal.SIGTERM)
        assert all(p.wait(timeout=30) == 0 for p in workers.procs)
        primaries = cluster_client.get_primaries()
        moves = []
        for p in moving:  # each to the next node along, while the producer publishes to it
            slot = cluster_client.keyslot(f"{{cl.moves:{p}}}")
            source = cluster_client.nodes_manager.get_node_from_slot(slot)
            target = primaries[(primaries.index(source) + 1) % len(primaries)]
            moves.append((p, source.name, target.name, _move_slot(cluster_client, slot, target, password, 0.05)))
        assert sent < total  # the moves happened while messages were still being published
        start(("w3", "w4"))
        producer.join(timeout=60)
        wait_for(lambda: len(applied()) >= total, 90, "every job")
        time.sleep(1.0)  # a late duplicate would show up now
        done = applied()
        assert sorted(done, key=int) == [str(n) for n in range(total)]  # nothing lost
        assert set(done.values()) == {1}  # nothing applied twice
        for p, source, target, keys in moves:
            slot = cluster_client.keyslot(f"{{cl.moves:{p}}}")
            assert cluster_client.nodes_manager.get_node_from_slot(slot).name == target != source
            assert keys > 0
        out = run_cli("status", "--json", env=env)
        assert out.returncode == 0, out.stderr
        [moved_queue] = [d for d in json.loads(out.stdout) if d["name"] == "cl.moves"]
        assert moved_queue["groups"][0]["lag"] == 0 and moved_queue["groups"][0]["dead_letters"] == 0
        print("moved (partition, from, to, keys):", moves)
        for proc in workers.procs[2:]:
            proc.send_signal(signal.SIGTERM)
        assert all(p.wait(timeout=30) == 0 for p in workers.procs[2:])
    finally:
        workers.stop_all()
        producer.join(timeout=30)


def test_workers_on_a_cluster_lose_nothing_apply_nothing_twice_and_dead_letter_the_poison(
    cluster: RunningCluster, ns: str, env: dict[str, str], cluster_client: Any, tmp_path: Path
) -> None:
    total = 2000

    async def send() -> None:
        async with Client(cluster.url, namespace=ns) as client:
            from framework import Queue

            queue = Queue("cl.jobs", partitions=PARTITIONS)
            await client.send_many(queue, [{"n": n} for n in range(total)], key=lambda c: f"k{c['n'] % 100}")

    async def send_poison() -> None:
        async with Client(cluster.url, namespace=ns) as client:
            await client.send("cl.jobs", {"n": "poison"}, key="k-poison")

    anyio.run(send)
    keyspace = KeySpace(ns)
    applied = _applied_counts(cluster_client, ns, "cl.jobs")

    dlqs = [keyspace.partition("cl.jobs", p).group("cljobs").dlq for p in range(PARTITIONS)]
    workers = Workers(env, tmp_path)
    try:
        opts = ("--visibility-timeout", "2", "--shutdown-timeout", "5")
        first = workers.start("clusterapp:jobs", "w1", *opts, JOB_SLEEP="0")
        workers.start("clusterapp:jobs", "w2", *opts)
        wait_for(lambda: len(applied()) >= total // 4, 30, "a quarter of the jobs")
        first.send_signal(signal.SIGKILL)  # mid-way: what it held is claimed by the others
        first.wait()
        workers.start("clusterapp:jobs", "w3", *opts)
        # After the kill: a message a killed worker held counts that run as an attempt (by design),
        # so a poison sent earlier could be dead-lettered as a crash loop rather than for its error.
        anyio.run(send_poison)
        wait_for(lambda: len(applied()) >= total and sum(cluster_client.xlen(d) for d in dlqs) >= 1, 60, "all jobs")
        time.sleep(0.5)  # a late duplicate would show up now
        done = applied()
        assert sorted(done, key=int) == [str(n) for n in range(total)]  # nothing lost
        assert set(done.values()) == {1}  # nothing applied twice (the inbox and the commit's check)
        [(_, fields)] = [e for d in dlqs for e in cluster_client.xrange(d)]
        assert json.loads(fields[b"body"]) == {"n": "poison"}
        assert b"poisoned job" in fields[b"dlq-error-message"] and fields[b"dlq-attempts"] == b"3"
        assert fields[b"dlq-error-type"].endswith(b"RuntimeError")

        # (c) the CLI reads the cluster
        out = run_cli("status", "--json", env=env)
        assert out.returncode == 0, out.stderr
        [jobs] = [d for d in json.loads(out.stdout) if d["name"] == "cl.jobs"]
        [group] = jobs["groups"]
        assert group["group"] == "cljobs" and group["dead_letters"] == 1 and group["lag"] == 0
        listed = run_cli("dlq", "list", "--json", env=env)
        assert listed.returncode == 0, listed.stderr
        [letter] = json.loads(listed.stdout)
        assert letter["group"] == "cljobs" and letter["error_type"].endswith("RuntimeError")
        assert "poisoned job" in json.dumps(letter)
        for proc in workers.procs[1:]:
            proc.send_signal(signal.SIGTERM)
        assert all(p.wait(timeout=30) == 0 for p in workers.procs[1:])
    finally:
        workers.stop_all()


@pytest.mark.fault
def test_keys_keep_their_order_on_a_cluster_across_workers_killed_restarted_and_paused(
    cluster: RunningCluster, ns: str, env: dict[str, str], tmp_path: Path
) -> None:
    """The ownership test's workload (tests/ordered_workload.py: 3 workers, 8 partitions spread over
    the 3 masters, 100 keys, 20,000 messages, SIGKILLs, a SIGSTOP past the lease) on the cluster."""
    workers = Workers(env, tmp_path)
    try:
        run_ordered_workload(workers, cluster.url, ns, messages=20_000)
    finally:
        workers.stop_all()
