"""Services on RabbitMQ end to end: real ``framework run`` workers, the CLI, a SIGKILL mid-stream.

The workers run ``tests/apps/rabbitapp.py`` on the session's RabbitMQ virtual host (``BROKER_URL``) and
record what they did in a SQLite file; the SQL inbox (``ctx.sql_transaction``) makes every job's
effect happen once however often RabbitMQ delivers it.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sqlite3
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from framework import Queue, SyncClient
from tests.conftest import ROOT, run_cli
from tests.workers import Workers, wait_for, whole_lines

pytestmark = [pytest.mark.slow]

JOBS = Queue("rabbit.jobs", partitions=2)  # as tests/apps/rabbitapp.py declares it

SCHEMA = "CREATE TABLE applied (n INTEGER, key TEXT, seq INTEGER);"
RUNS_SCHEMA = """
CREATE TABLE runs (n INTEGER, consumer TEXT);
CREATE TABLE attempts (n INTEGER, attempt INTEGER, at REAL);
CREATE TABLE arrivals (n INTEGER, at REAL);
CREATE TABLE noted (service TEXT, n INTEGER);
"""


@pytest.fixture
def results(tmp_path: Path) -> Path:
    """The SQLite file the workers write: the test's tables and the framework's inbox and outbox tables."""
    import anyio

    from framework.outbox.schema import create_tables
    from framework.sql import create_engine

    db = tmp_path / "results.db"
    with sqlite3.connect(db) as conn:
        conn.executescript(SCHEMA)

    async def framework_tables() -> None:
        engine = create_engine(f"sqlite+aiosqlite:///{db}")
        await create_tables(engine)
        await engine.dispose()

    anyio.run(framework_tables)
    return db


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    """The SQLite file of what the handlers saw (runs, attempts, arrivals), beside their effects' one."""
    db = tmp_path / "runs.db"
    with sqlite3.connect(db) as conn:
        conn.executescript(RUNS_SCHEMA)
    return db


@pytest.fixture
def env(rabbitmq_url: str, results: Path, runs: Path) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "BROKER_URL")}
    out.update(
        BROKER_URL=rabbitmq_url,
        FRAMEWORK_NAMESPACE=f"e2e-{uuid.uuid4().hex[:8]}",
        RESULTS_DB=str(results),
        RUNS_DB=str(runs),
        PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "apps"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        FRAMEWORK_LOG_FORMAT="json",
    )
    return out


@pytest.fixture
def rabbit_workers(env: dict[str, str], tmp_path: Path) -> Iterator[Workers]:
    w = Workers(env, tmp_path)
    yield w
    w.stop_all()


def rows(db: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(db, timeout=30) as conn:
        return list(conn.execute(sql))


def test_jobs_run_once_in_order_per_key_across_two_workers_and_a_sigkill(
    rabbit_workers: Workers, env: dict[str, str], results: Path, runs: Path
) -> None:
    keys, per_key = ("a", "b", "c", "d"), 60
    jobs = [{"n": i * len(keys) + k, "key": key, "seq": i} for i in range(per_key) for k, key in enumerate(keys)]
    with SyncClient(env["BROKER_URL"], namespace=env["FRAMEWORK_NAMESPACE"]) as client:
        for cmd in jobs:
            client.send(JOBS, cmd, key=cmd["key"])
    opts = ("--prefetch", "20", "--concurrency", "4")
    first = rabbit_workers.start("rabbitapp:shop", "first", *opts, JOB_SLEEP="0.01", CONSUMER_NAME="first")
    wait_for(lambda: rows(results, "SELECT count(*) FROM applied")[0][0] > 30, 60, "the first worker to apply jobs")
    second = rabbit_workers.start("rabbitapp:shop", "second", *opts, JOB_SLEEP="0.01", CONSUMER_NAME="second")
    wait_for(lambda: "runtime started" in rabbit_workers.log("second"), 60, "the second worker to start")
    first.send_signal(signal.SIGKILL)  # it holds fetched, unacknowledged jobs: RabbitMQ requeues them
    first.wait()
    wait_for(lambda: rows(results, "SELECT count(*) FROM applied")[0][0] >= len(jobs), 120, "every job applied")
    time.sleep(1)  # any duplicate still on its way would show now
    applied = rows(results, "SELECT n, key, seq FROM applied ORDER BY rowid")
    assert sorted(n for n, _, _ in applied) == sorted(j["n"] for j in jobs), "a job was lost or applied twice"
    for key in keys:
        seqs = [seq for _, k, seq in applied if k == key]
        assert seqs == sorted(seqs), f"key {key} was applied out of order: {seqs}"
    by = dict(rows(runs, "SELECT consumer, count(*) FROM runs GROUP BY consumer"))
    assert by.get("second", 0) > 0, f"the second worker took over nothing: runs per worker {by}"
    second.send_signal(signal.SIGTERM)
    assert second.wait(timeout=30) == 0


def test_a_failing_handler_is_retried_with_backoff_dead_lettered_and_redriven_from_the_cli(
    rabbit_workers: Workers, env: dict[str, str], runs: Path
) -> None:
    with SyncClient(env["BROKER_URL"], namespace=env["FRAMEWORK_NAMESPACE"]) as client:
        client.send("rabbit.flaky", {"n": 1})
        sent = time.time()
        client.send("rabbit.later", {"n": 7}, delay=1.5)
    worker = rabbit_workers.start("rabbitapp:everything", "w", CONSUMER_NAME="w")
    wait_for(lambda: rows(runs, "SELECT count(*) FROM arrivals")[0][0] == 1, 60, "the delayed command")
    [(arrived,)] = rows(runs, "SELECT at FROM arrivals")
    assert arrived - sent >= 1.4, f"a command delayed 1.5 s arrived after {arrived - sent:.2f} s"
    wait_for(lambda: rows(runs, "SELECT count(*) FROM noted")[0][0] >= 2, 60, "the event to reach both services")
    time.sleep(0.5)
    noted = rows(runs, "SELECT service, n FROM noted ORDER BY service")
    assert noted == [("audit", 7), ("mail", 7)], f"each subscribing service gets the event once: {noted}"

    def listed() -> list[dict]:
        out = run_cli("dlq", "list", "--json", env=env)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout or "[]")

    wait_for(lambda: listed(), 60, "the flaky command to be dead-lettered")
    [letter] = listed()
    assert letter["error_type"].endswith("ValueError") and "failed on purpose" in letter["error_message"], letter
    assert letter["attempts"] == 3 and letter["handler"].endswith("flaky") and letter["traceback"], letter
    shown = run_cli("dlq", "show", letter["ref"], env=env)
    assert shown.returncode == 0 and "failed on purpose" in shown.stdout, shown.stdout + shown.stderr
    attempts = rows(runs, "SELECT attempt, at FROM attempts ORDER BY at")
    assert [a for a, _ in attempts] == [1, 2, 3], f"attempts {attempts}: three, numbered 1..3, expected"
    gaps = [b - a for (_, a), (_, b) in itertools.pairwise(attempts)]
    assert gaps[0] >= 0.25 and gaps[1] >= 0.5, f"retries came back too early (backoff 0.3 s, doubling): {gaps}"

    status = run_cli("status", env=env)
    assert status.returncode == 0, status.stderr
    assert "rabbit.flaky" in status.stdout and "rabbit.jobs" in status.stdout, status.stdout

    redriven = run_cli("dlq", "redrive", "--all", env=env)
    assert redriven.returncode == 0, redriven.stderr
    wait_for(lambda: rows(runs, "SELECT count(*) FROM attempts")[0][0] >= 4, 60, "the redriven command to run")
    assert rows(runs, "SELECT attempt FROM attempts WHERE rowid = 4") == [(1,)], "a redrive is not a first attempt"
    wait_for(lambda: len(listed()) == 1, 60, "the redriven command to fail into the DLQ again")
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0


def test_a_message_that_crashes_its_worker_every_time_ends_in_the_dlq(
    rabbit_workers: Workers, env: dict[str, str], runs: Path
) -> None:
    """A poison message kills its worker on every delivery: after ``max_attempts`` (3) the next worker
    dead-letters it without running it, and the other messages are handled."""
    with SyncClient(env["BROKER_URL"], namespace=env["FRAMEWORK_NAMESPACE"]) as client:
        crash_id = client.send("rabbit.crashy", {"n": "crash"})
        for i in range(10):
            client.send("rabbit.crashy", {"n": i})
    exits = []
    for attempt in range(6):
        w = rabbit_workers.start("rabbitapp:shop", f"w{attempt}")
        wait_for(lambda w=w: w.poll() is not None or len(_dead_letters(env)) > 0, 60, "a crash or a dead letter")
        if w.poll() is None:
            wait_for(lambda: rows(runs, "SELECT count(*) FROM arrivals WHERE n >= 0")[0][0] >= 10, 60, "the others")
            w.send_signal(signal.SIGTERM)
            assert w.wait(timeout=30) == 0
            break
        exits.append(w.returncode)
    assert exits == [17, 17, 17], f"worker exits {exits}: three crashes, then the dead letter"
    assert rows(runs, "SELECT count(*) FROM arrivals WHERE n = -1") == [(3,)], "poison ran other than 3 times"
    [letter] = _dead_letters(env)
    assert letter["message_id"] == crash_id, letter


def _dead_letters(env: dict[str, str]) -> list[dict]:
    out = run_cli("dlq", "list", "--json", env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout or "[]")


def test_a_worker_paused_past_the_heartbeat_loses_its_partitions_to_another_and_nothing_is_lost(
    rabbit_workers: Workers, env: dict[str, str], tmp_path: Path
) -> None:
    """SIGSTOP the worker reading both partitions: the server drops its connection once heartbeats stop
    (2 s here), the standby worker gets everything it held, in order per key; the paused worker, resumed,
    reconnects and shuts down cleanly. What it held may run twice (no fencing: documented), never more."""
    runs_dir = tmp_path / "ticks"
    runs_dir.mkdir()
    env = {**env, "BROKER_URL": env["BROKER_URL"] + "?heartbeat=2&prefetch=20", "RUNS_DIR": str(runs_dir)}
    rabbit_workers.env = env
    total = 300
    with SyncClient(env["BROKER_URL"], namespace=env["FRAMEWORK_NAMESPACE"]) as client:
        for i in range(total):
            client.send(Queue("rabbit.ticks", partitions=2), {"key": f"k{i % 3}", "n": i}, key=f"k{i % 3}")

    def seen() -> list[tuple[str, int]]:
        out = []
        for f in runs_dir.iterdir():
            out += [(line.split()[0], int(line.split()[1])) for line in whole_lines(f.read_text()) if line]
        return out

    opts = ("--concurrency", "2", "--prefetch", "10")
    a = rabbit_workers.start("rabbitapp:ticker", "a", *opts, JOB_SLEEP="0.02", CONSUMER_NAME="a")
    wait_for(lambda: len(seen()) > 30, 60, "worker a to run ticks")
    b = rabbit_workers.start("rabbitapp:ticker", "b", *opts, JOB_SLEEP="0.02", CONSUMER_NAME="b")
    wait_for(lambda: "runtime started" in rabbit_workers.log("b"), 60, "worker b to start")
    a.send_signal(signal.SIGSTOP)
    try:
        wait_for(lambda: len({n for _, n in seen()}) == total, 120, "every tick to run")
    finally:
        a.send_signal(signal.SIGCONT)
    mine = {f.name: [int(line.split()[1]) for line in f.read_text().splitlines()] for f in runs_dir.iterdir()}
    assert mine.get("b"), "the standby worker took nothing over"
    for key in ("k0", "k1", "k2"):
        b_runs = [n for n in mine["b"] if n % 3 == int(key[1])]
        assert b_runs == sorted(b_runs), f"worker b ran {key} out of order: {b_runs}"
    duplicates = len(seen()) - total
    # what a could run twice: what it held unacknowledged (prefetch 20 per partition queue) and, resumed,
    # what it had received before noticing its connection was gone (the same messages)
    assert duplicates <= 2 * 20, f"{duplicates} runs repeated: more than the paused worker could hold"
    for w in (a, b):
        w.send_signal(signal.SIGTERM)
        assert w.wait(timeout=60) == 0


# -- the default inbox (the Redis inbox beside RabbitMQ) ------------------------------------------------

CHARGES = Queue("rabbit.charges", partitions=2)  # as tests/apps/rabbitapp.py declares it


def _lines(runs_dir: Path) -> list[tuple[str, str, int, str]]:
    """(worker, "start" | "end", n, message id) of every line the billing workers wrote."""
    out = []
    for f in sorted(runs_dir.iterdir()):
        for line in whole_lines(f.read_text()):
            what, n, mid = line.split()
            out.append((f.name, what, int(n), mid))
    return out


def _status_rows(env: dict[str, str]) -> list[dict]:
    out = run_cli("status", "--json", "rabbit.charges", env=env)
    assert out.returncode == 0, out.stderr
    return [g for d in json.loads(out.stdout) for g in d["groups"]]


def test_the_default_inbox_runs_copies_of_a_message_once(
    rabbit_workers: Workers, env: dict[str, str], redis_url: str, tmp_path: Path
) -> None:
    """A service with the default inbox runs on RabbitMQ unchanged (its inbox in Redis, named by ``?inbox=``):
    each message published twice with the same message id runs once; ``framework status`` reads the inbox."""
    runs_dir = tmp_path / "charges"
    runs_dir.mkdir()
    env = {**env, "BROKER_URL": f"{env['BROKER_URL']}?inbox={quote(redis_url, safe='')}", "RUNS_DIR": str(runs_dir)}
    rabbit_workers.env = env
    total = 40
    with SyncClient(env["BROKER_URL"], namespace=env["FRAMEWORK_NAMESPACE"]) as client:
        for i in range(total):
            cmd = {"n": i, "key": f"k{i % 5}"}
            mid = client.send(CHARGES, cmd, key=cmd["key"])
            client.send(CHARGES, cmd, key=cmd["key"], message_id=mid)  # a producer's retry: the same id
    w = rabbit_workers.start("rabbitapp:billing", "w", "--prefetch", "20", JOB_SLEEP="0.01", CONSUMER_NAME="w")
    wait_for(lambda: len([x for x in _lines(runs_dir) if x[1] == "end"]) >= total, 60, "every charge")
    time.sleep(1.5)  # the second copies, deferred while their first ran, are checked again and dropped
    w.send_signal(signal.SIGTERM)
    assert w.wait(timeout=30) == 0
    rows = _status_rows(env)  # what the worker did not ack went back to the queue: it would show as lag
    assert [(r["group"], r["lag"]) for r in rows] == [("billing", 0)], rows
    assert rows[0]["inbox_ids"] >= total, f"framework status does not see the inbox: {rows}"
    lines = _lines(runs_dir)
    starts = sorted(n for _, what, n, _ in lines if what == "start")
    assert starts == list(range(total)), f"a copy ran (or a charge was lost): {starts}"
    assert sorted(n for _, what, n, _ in lines if what == "end") == list(range(total))
    assert "the rabbitmq transport lacks" not in rabbit_workers.log("w")


async def _recorded(redis_url: str, namespace: str, ids: dict[int, list[str]]) -> set[str]:
    """Which of ``ids`` (per partition) the inbox holds as processed: inbox_claim.lua with a 1 ms lease (an
    id leased by a run has status 2 and keeps its lease; a new one is leased for 1 ms, which changes nothing)."""
    from broker import connect
    from broker.envelope import now_ms
    from broker.redis import RedisBroker
    from broker.redis.keys import inbox_records
    from broker.redis.reading import claim_statuses
    from broker.topology import DestinationSpec

    broker = await connect(redis_url, namespace=namespace)
    assert isinstance(broker, RedisBroker)
    try:
        found: set[str] = set()
        spec = DestinationSpec(CHARGES.name, "command", partitions=2)
        for partition, chunk in ids.items():
            if not chunk:
                continue
            view = broker.group_partition(spec, partition, "billing")
            args = [now_ms(), 1, len(chunk), 0, len(chunk), *chunk, inbox_records(chunk)]
            statuses = claim_statuses(
                await broker.scripts["inbox_claim"](broker.redis, [view.keys.inbox], args), len(chunk)
            )
            found |= {mid for mid, status in zip(chunk, statuses, strict=True) if status == 1}
        return found
    finally:
        await broker.close()


def test_a_sigkilled_worker_with_the_default_inbox_loses_nothing_and_reruns_nothing_recorded(
    rabbit_workers: Workers, env: dict[str, str], redis_url: str, tmp_path: Path
) -> None:
    """SIGKILL the worker mid-stream; the inbox's Redis comes from ``REDIS_URL`` (no ``?inbox=``). Then:
    every charge's effect happened; no charge whose id the killed worker recorded ran again (the
    server requeued what it had not acked: found processed, dropped); the only effects twice are charges the
    killed worker finished and had not recorded yet (killed between the handler's end and the record:
    the Redis inbox records with the ack, not with the effect), and none of those ran three times."""
    import anyio

    runs_dir = tmp_path / "charges"
    runs_dir.mkdir()
    env = {**env, "REDIS_URL": redis_url, "RUNS_DIR": str(runs_dir)}
    rabbit_workers.env = env
    total, keys = 600, 6
    partition_of: dict[str, int] = {}
    with SyncClient(env["BROKER_URL"], namespace=env["FRAMEWORK_NAMESPACE"]) as client:
        for i in range(total):
            key = f"k{i % keys}"
            mid = client.send(CHARGES, {"n": i, "key": key}, key=key)
            assert mid is not None
            partition_of[mid] = CHARGES.spec().partition_for(key, mid)
    opts = ("--prefetch", "20", "--concurrency", "4")
    a = rabbit_workers.start("rabbitapp:billing", "a", *opts, JOB_SLEEP="0.01", CONSUMER_NAME="a")
    wait_for(lambda: len([x for x in _lines(runs_dir) if x[1] == "end"]) > 150, 60, "worker a to apply charges")
    a.send_signal(signal.SIGKILL)  # mid-stream: it holds fetched, unacknowledged charges; RabbitMQ requeues them
    a.wait()
    ended_by_a = {mid for w, what, _, mid in _lines(runs_dir) if w == "a" and what == "end"}
    by_partition: dict[int, list[str]] = {0: [], 1: []}
    for mid in ended_by_a:
        by_partition[partition_of[mid]].append(mid)
    recorded = anyio.run(_recorded, redis_url, env["FRAMEWORK_NAMESPACE"], by_partition)
    b = rabbit_workers.start("rabbitapp:billing", "b", *opts, JOB_SLEEP="0.001", CONSUMER_NAME="b")
    wait_for(lambda: {n for _, what, n, _ in _lines(runs_dir) if what == "end"} == set(range(total)), 120, "all")
    time.sleep(1)  # a duplicate still on its way would show now
    b.send_signal(signal.SIGTERM)
    assert b.wait(timeout=30) == 0
    rows = _status_rows(env)  # what b did not ack went back to the queue: it would show as lag
    assert [(r["group"], r["lag"]) for r in rows] == [("billing", 0)], rows
    lines = _lines(runs_dir)
    started_by_b = {mid for w, what, _, mid in lines if w == "b" and what == "start"}
    ends: dict[str, int] = {}
    for _, what, _, mid in lines:
        if what == "end":
            ends[mid] = ends.get(mid, 0) + 1
    twice = {mid for mid, count in ends.items() if count > 1}
    assert len(ends) == total, "a charge was lost"
    assert not (started_by_b & recorded), f"{len(started_by_b & recorded)} recorded charges ran again"
    assert twice <= ended_by_a - recorded, "an effect happened twice for a charge the killed worker never finished"
    assert max(ends.values()) <= 2, "a charge's effect happened three times"
    assert len(recorded) >= len(ended_by_a) - 2 * 20 * 2, (
        f"of {len(ended_by_a)} charges a finished only {len(recorded)} were recorded: more than its unacked window"
    )
