"""The database outbox and SQL inbox against real servers: PostgreSQL (embedded unless DATABASE_URL), SQLite, Redis.

Each PostgreSQL test works in a database of its own, created on the server and dropped afterwards
(``pg_url`` in conftest.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import anyio.abc
import anyio.lowlevel
import psycopg
import pytest
from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from broker import Envelope, connect, derive_id
from broker.codec import decode_fields
from broker.redis import RedisBroker
from framework import Queue, Topic, outbox
from framework.outbox import OutboxRelay, outbox_table, sent_table
from framework.sql import resolve_url

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent


# -- fixtures (``pg_url``, a fresh database on the test PostgreSQL server, comes from conftest.py) -------


@pytest.fixture
async def pg(pg_url: str) -> AsyncIterator[AsyncEngine]:
    engine = outbox.create_engine(pg_url)
    await outbox.create_tables(engine)
    yield engine
    await engine.dispose()


@pytest.fixture
async def lite(tmp_path: Path) -> AsyncIterator[AsyncEngine]:
    engine = outbox.create_engine(f"sqlite:///{tmp_path / 'outbox.db'}")
    await outbox.create_tables(engine)
    yield engine
    await engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def engine(request: pytest.FixtureRequest) -> AsyncEngine:
    """Each dialect in turn."""
    return request.getfixturevalue("lite" if request.param == "sqlite" else "pg")  # type: ignore[no-any-return]


# -- helpers ----------------------------------------------------------------------------------------------


async def stream(broker: RedisBroker, destination: str) -> list[Envelope]:
    """Every entry on ``destination``: all partitions, each in stream order."""
    spec = await broker.get_destination(destination)
    if spec is None:
        return []
    out = []
    for p in range(spec.partitions):
        key = broker.keyspace.partition(destination, p).stream
        for _, flat in await broker.redis.execute_command("XRANGE", key, "-", "+"):
            out.append(decode_fields(dict(zip(flat[::2], flat[1::2], strict=True)), spec.name, spec.kind))
    return out


def by_key(envelopes: list[Envelope]) -> dict[str | None, list[str]]:
    out: dict[str | None, list[str]] = defaultdict(list)
    for e in envelopes:
        out[e.key].append(e.id)
    return out


async def count(engine: AsyncEngine, table: Any) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(select(func.count()).select_from(table))).scalar_one())


async def sent_ids_by_key(engine: AsyncEngine) -> dict[str | None, list[str]]:
    """Message ids per key in ``seq`` order (per key: commit order), from the sent table."""
    async with engine.connect() as conn:
        rows = (await conn.execute(select(sent_table.c.key, sent_table.c.message_id).order_by(sent_table.c.seq))).all()
    out: dict[str | None, list[str]] = defaultdict(list)
    for key, message_id in rows:
        out[key].append(message_id)
    return out


def cli_env(redis_url: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
        FRAMEWORK_LOG_FORMAT="json",
        REDIS_URL=redis_url,
    )
    env.pop("DATABASE_URL", None)
    return env


def framework_cli(*args: str, env: dict[str, str], cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "framework", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


class Relays:
    """``python -m framework outbox relay`` subprocesses, logging JSON lines to files; killed at teardown."""

    def __init__(self, env: dict[str, str], tmp: Path) -> None:
        self.env, self.tmp = env, tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, database_url: str, namespace: str, *extra: str) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "framework",
                "outbox",
                "relay",
                "--database-url",
                database_url,
                "--namespace",
                namespace,
                *extra,
            ],
            env=self.env,
            cwd=self.tmp,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def events(self, name: str) -> list[dict[str, Any]]:
        out = []
        for line in self.log(name).splitlines():
            with contextlib.suppress(ValueError):  # a line that is not a log record
                out.append(json.loads(line))
        return out

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def relays(redis_url: str, tmp_path: Path) -> Iterator[Relays]:
    r = Relays(cli_env(redis_url), tmp_path)
    yield r
    r.stop_all()


async def wait_for(predicate: Any, timeout: float, what: str) -> None:
    with anyio.move_on_after(timeout):
        while not await predicate():
            await anyio.sleep(0.05)
        return
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


# -- schema and URLs --------------------------------------------------------------------------------------


def test_database_urls_map_to_the_async_drivers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_url("postgres://u:p@h:5432/d").drivername == "postgresql+psycopg"
    assert resolve_url("postgresql://u@h/d").drivername == "postgresql+psycopg"
    assert resolve_url("sqlite:///x.db").drivername == "sqlite+aiosqlite"
    for bad, says in (
        ("mysql://u@h/d", "unsupported database URL scheme 'mysql'"),
        ("postgresql+asyncpg://u@h/d", "postgresql://"),
        ("sqlite://", "needs a file"),
    ):
        with pytest.raises(ValueError, match=says):
            resolve_url(bad)
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.setenv("FRAMEWORK_HOME", str(tmp_path))
    assert resolve_url(None).database == str(tmp_path / "outbox.db")
    monkeypatch.setenv("DATABASE_URL", "postgres://u@h/d")
    assert resolve_url(None).drivername == "postgresql+psycopg"


async def test_ddl_is_plain_idempotent_sql_for_sqlite(tmp_path: Path) -> None:
    path = tmp_path / "mine.db"
    with sqlite3.connect(path) as db:  # a user's own migration tool: the DDL as it is, twice
        db.executescript(outbox.ddl("sqlite"))
        db.executescript(outbox.ddl("sqlite"))
    engine = outbox.create_engine(f"sqlite:///{path}")
    await outbox.check_tables(engine)
    await outbox.create_tables(engine)  # and the helper agrees with it
    assert await count(engine, outbox.shards_table) == outbox.SHARDS
    await engine.dispose()
    with pytest.raises(ValueError, match="postgresql, sqlite"):
        outbox.ddl("mysql")


@pytest.mark.postgres
async def test_ddl_is_plain_idempotent_sql_for_postgresql(pg_url: str) -> None:
    from framework.sql import libpq_url

    with psycopg.connect(libpq_url(pg_url), autocommit=True) as db:
        db.execute(outbox.ddl("postgresql").encode())
        db.execute(outbox.ddl("postgresql").encode())
    engine = outbox.create_engine(pg_url)
    await outbox.check_tables(engine)
    async with anyio.create_task_group() as tg:  # concurrent migrations do not trip over each other
        for _ in range(3):
            tg.start_soon(outbox.create_tables, engine)
    assert await count(engine, outbox.shards_table) == outbox.SHARDS
    await engine.dispose()


# -- producing and relaying -------------------------------------------------------------------------------


async def test_relay_publishes_committed_messages_with_their_ids_and_moves_them(
    engine: AsyncEngine, broker: RedisBroker
) -> None:
    async with engine.begin() as conn:
        ids = [
            await outbox.add_event(conn, "orders.placed", {"n": i}, key=f"o{i % 3}", headers={"h": "v"})
            for i in range(30)
        ]
        job = await outbox.add(conn, Queue("billing.jobs", partitions=4), {"job": 1}, key="j")
        await outbox.stage(
            conn,
            [
                Envelope(
                    destination="audit.log",
                    kind="event",
                    type="Raw",
                    body=b"x",
                    id="fixed-id-1",
                    published_at=1_700_000_000_123,
                )
            ],
        )
    relay = OutboxRelay(engine, broker)
    assert await relay.drain() == 32
    assert await relay.run_once() == 0
    events = await stream(broker, "orders.placed")
    assert by_key(events) == {f"o{k}": ids[k::3] for k in range(3)}  # each key in commit order
    assert events[0].headers == {"h": "v"} and events[0].body == b'{"n":0}' and events[0].kind == "event"
    jobs = await stream(broker, "billing.jobs")
    assert [(e.id, e.kind) for e in jobs] == [(job, "command")]
    assert (await broker.get_destination("billing.jobs")).partitions == 4  # type: ignore[union-attr]
    [raw] = await stream(broker, "audit.log")
    assert (raw.id, raw.body, raw.published_at) == ("fixed-id-1", b"x", 1_700_000_000_123)
    assert await count(engine, outbox_table) == 0 and await count(engine, sent_table) == 32
    assert relay.published == 32


async def test_rollback_leaves_no_row_and_publishes_nothing(engine: AsyncEngine, broker: RedisBroker) -> None:
    with pytest.raises(RuntimeError, match="business rule"):
        async with engine.begin() as conn:
            await conn.execute(text("CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY)"))
            await conn.execute(text("INSERT INTO orders VALUES ('o-1')"))
            await outbox.add_event(conn, "orders.placed", {"id": "o-1"}, key="o-1")
            raise RuntimeError("business rule says no")
    assert await count(engine, outbox_table) == 0
    assert await OutboxRelay(engine, broker).drain() == 0
    assert await stream(broker, "orders.placed") == []


async def test_staging_the_same_ids_again_adds_nothing(engine: AsyncEngine) -> None:
    parent = "0190a5f2-0000-7000-8000-000000000001"
    staged = [
        Envelope(
            destination="payments.captured",
            kind="event",
            type="T",
            body=b"{}",
            key="k",
            id=derive_id(parent, f"billing/{i}"),
        )
        for i in range(3)
    ]
    for _ in range(2):  # a retried handler stages the same derived ids
        async with engine.begin() as conn:
            await outbox.stage(conn, staged)
    assert await count(engine, outbox_table) == 3


async def test_add_needs_a_kind_for_a_bare_name(lite: AsyncEngine) -> None:
    async with lite.begin() as conn:
        with pytest.raises(TypeError, match="kind='event' or kind='command'"):
            await outbox.add(conn, "somewhere", {})
        await outbox.add(conn, Topic("t1"), {})  # implied by the object
        await outbox.add_command(conn, "q1", {})
        kinds = (
            await conn.execute(select(outbox_table.c.destination, outbox_table.c.kind).order_by(outbox_table.c.seq))
        ).all()
    assert [tuple(k) for k in kinds] == [("t1", "event"), ("q1", "command")]


async def test_claim_inbox_is_true_only_the_first_time(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        assert await outbox.claim_inbox(conn, "billing", "m-1") is True
        assert await outbox.claim_inbox(conn, "billing", "m-1") is False
        assert await outbox.claim_inbox(conn, "shipping", "m-1") is True  # another group
    with pytest.raises(RuntimeError):
        async with engine.begin() as conn:  # a handler that fails: its claim rolls back with its effects
            assert await outbox.claim_inbox(conn, "billing", "m-2") is True
            raise RuntimeError
    async with engine.begin() as conn:
        assert await outbox.claim_inbox(conn, "billing", "m-2") is True


@pytest.mark.postgres
async def test_concurrent_claims_of_one_message_let_one_transaction_through(pg: AsyncEngine) -> None:
    async with pg.connect() as first, pg.connect() as second:
        assert await outbox.claim_inbox(first, "billing", "m-1") is True
        result: list[bool] = []

        async def claim_second() -> None:
            result.append(await outbox.claim_inbox(second, "billing", "m-1"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(claim_second)
            await anyio.sleep(0.3)
            assert result == []  # waits for the first transaction
            await first.commit()
        assert result == [False]


@pytest.mark.postgres
async def test_same_key_transactions_are_published_in_commit_order(pg: AsyncEngine, broker: RedisBroker) -> None:
    async with pg.connect() as t1, pg.connect() as t2, pg.connect() as t3:
        first = await outbox.add_event(t1, "ledger", {"n": 1}, key="acct-1")
        done: list[str] = []

        async def second() -> None:
            done.append(await outbox.add_event(t2, "ledger", {"n": 2}, key="acct-1"))
            await t2.commit()

        async with anyio.create_task_group() as tg:
            tg.start_soon(second)
            await anyio.sleep(0.3)
            assert done == []  # the second writer of acct-1 waits for the first to end...
            other = await outbox.add_event(t3, "ledger", {"n": 3}, key="acct-2")
            await t3.commit()  # ...while other keys go ahead
            await t1.commit()
    await OutboxRelay(pg, broker).drain()
    assert by_key(await stream(broker, "ledger")) == {"acct-1": [first, done[0]], "acct-2": [other]}


@pytest.mark.postgres
async def test_a_running_relay_wakes_on_notify(pg: AsyncEngine, broker: RedisBroker) -> None:
    relay = OutboxRelay(pg, broker, poll_interval=60)  # only a NOTIFY can wake it in time
    async with anyio.create_task_group() as tg:
        await tg.start(relay.run)
        await anyio.sleep(0.3)  # idle: waiting on its (long) poll interval
        async with pg.begin() as conn:
            message_id = await outbox.add_event(conn, "orders.placed", {"n": 1})
        started = time.monotonic()

        async def arrived() -> bool:
            return [e.id for e in await stream(broker, "orders.placed")] == [message_id]

        await wait_for(arrived, 5, "the relay to publish")
        assert time.monotonic() - started < 5
        relay.stop()


@pytest.mark.postgres
async def test_cancelling_a_running_relay_leaves_every_row_published_or_waiting(
    pg: AsyncEngine, broker: RedisBroker
) -> None:
    async with pg.begin() as conn:
        await outbox.stage(
            conn,
            [
                Envelope(destination="orders.placed", kind="event", type="T", body=b"{}", key=f"k{i % 50}")
                for i in range(5000)
            ],
        )
    relay = OutboxRelay(pg, broker, batch_size=200)
    async with anyio.create_task_group() as tg:
        await tg.start(relay.run)

        with anyio.fail_after(10):
            while relay.published == 0:
                await anyio.sleep(0.002)
        tg.cancel_scope.cancel()  # the app shuts down mid-stream: batches in flight finish first
    published = {e.id for e in await stream(broker, "orders.placed")}
    async with pg.connect() as conn:
        sent = set((await conn.execute(select(sent_table.c.message_id))).scalars())
        waiting = set((await conn.execute(select(outbox_table.c.message_id))).scalars())
    assert sent == published and len(sent) == relay.published
    assert len(waiting) + len(sent) == 5000 and not waiting & sent and waiting


async def test_sqlite_relay_polls(lite: AsyncEngine, broker: RedisBroker) -> None:
    relay = OutboxRelay(lite, broker)
    async with anyio.create_task_group() as tg:
        await tg.start(relay.run)
        async with lite.begin() as conn:
            message_id = await outbox.add_event(conn, "orders.placed", {"n": 1})

        async def arrived() -> bool:
            return [e.id for e in await stream(broker, "orders.placed")] == [message_id]

        await wait_for(arrived, 5, "the relay to publish")
        relay.stop()
    assert await count(lite, outbox_table) == 0


async def test_sqlite_relays_take_turns(lite: AsyncEngine, tmp_path: Path, broker: RedisBroker) -> None:
    async with lite.begin() as conn:
        await outbox.stage(
            conn,
            [Envelope(destination="ledger", kind="event", type="T", body=b"{}", key=f"k{i % 9}") for i in range(600)],
        )
    expected = await _waiting_ids_by_key(lite)
    other = outbox.create_engine(f"sqlite:///{tmp_path / 'outbox.db'}")
    first, second = OutboxRelay(lite, broker, batch_size=50), OutboxRelay(other, broker, batch_size=50)
    async with anyio.create_task_group() as tg:
        tg.start_soon(first.drain)
        tg.start_soon(second.drain)
    await other.dispose()
    entries = await stream(broker, "ledger")
    assert len(entries) == len({e.id for e in entries}) == 600 == first.published + second.published
    assert by_key(entries) == expected


async def test_cleanup_deletes_old_sent_rows_and_inbox_records_only(engine: AsyncEngine, broker: RedisBroker) -> None:
    async with engine.begin() as conn:
        for i in range(5):
            await outbox.add_event(conn, "orders.placed", {"n": i})
        await outbox.claim_inbox(conn, "billing", "m-old")
    retention = 2.0  # wide enough that a loaded machine reaches the first cleanup before it passes
    relay = OutboxRelay(engine, broker, retention=retention, inbox_retention=retention)
    await relay.drain()
    sent = time.monotonic()
    async with engine.begin() as conn:
        waiting = await outbox.add_event(conn, "orders.placed", {"n": 99})  # not published yet
    assert await relay.cleanup() == (0, 0)  # nothing is old enough yet
    await anyio.sleep(sent + retention + 0.1 - time.monotonic())
    async with engine.begin() as conn:
        await outbox.claim_inbox(conn, "billing", "m-new")
    assert await relay.cleanup() == (5, 1)
    assert await count(engine, sent_table) == 0
    async with engine.connect() as conn:
        assert (await conn.execute(select(outbox_table.c.message_id))).scalars().all() == [waiting]
        assert (await conn.execute(select(outbox.inbox_table.c.message_id))).scalars().all() == ["m-new"]


@pytest.mark.postgres
async def test_a_refused_message_is_set_aside_without_blocking_its_shard(
    pg: AsyncEngine, pg_url: str, broker: RedisBroker, redis_url: str, namespace: str, tmp_path: Path
) -> None:
    await broker.declare(Queue("jobs").spec())
    async with pg.begin() as conn:
        bad = await outbox.add_event(conn, "jobs", {"n": 1}, key="k")  # an event for a queue
        good = await outbox.add_event(conn, "orders.placed", {"n": 2}, key="k")
    relay = OutboxRelay(pg, broker)
    assert await relay.drain() == 2
    assert [e.id for e in await stream(broker, "orders.placed")] == [good]
    async with pg.connect() as conn:
        row = (await conn.execute(select(outbox_table.c.message_id, outbox_table.c.error))).one()
    assert row.message_id == bad and "declared as a queue" in row.error
    env = {**cli_env(redis_url), "FRAMEWORK_NAMESPACE": namespace}
    status = framework_cli("outbox", "status", "--database-url", pg_url, "--json", env=env, cwd=tmp_path)
    assert json.loads(status.stdout)["refused"] == 1, status.stderr
    await broker.redis.hdel(broker.keyspace.destinations, "jobs")  # the operator fixes the cause...
    broker._specs.clear()
    retry = framework_cli("outbox", "retry", "--all", "--database-url", pg_url, env=env, cwd=tmp_path)
    assert retry.returncode == 0 and "1 refused message(s)" in retry.stdout, retry.stderr
    await OutboxRelay(pg, broker).drain()  # ...and it goes out
    assert [e.id for e in await stream(broker, "jobs")] == [bad]


# -- several relays, crashes and outages ------------------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.fault
async def test_relay_killed_between_publish_and_commit_republishes_the_same_ids(
    pg: AsyncEngine, pg_url: str, broker: RedisBroker, namespace: str, relays: Relays
) -> None:
    async with pg.begin() as conn:
        for i in range(200):
            await outbox.add_event(conn, "orders.placed", {"n": i}, key=f"k{i % 7}")
    expected = await _waiting_ids_by_key(pg)
    async with pg.connect() as blocker:
        # Lock the rows: the relay can read and publish them, but its move to the sent table waits.
        await blocker.execute(select(outbox_table.c.seq).with_for_update())
        relays.start("doomed", pg_url, namespace, "--batch-size", "500", "--max-shards", "64")

        async def all_published() -> bool:
            return len(await stream(broker, "orders.placed")) == 200

        await wait_for(all_published, 30, "the relay to publish the batch")
        await anyio.sleep(0.2)
        relays.procs["doomed"].send_signal(signal.SIGKILL)  # published, not committed
        relays.procs["doomed"].wait()
        await blocker.rollback()
    relay = OutboxRelay(pg, broker)

    async def all_sent() -> bool:
        await relay.drain()  # the dead relay's server session may hold its shards for a moment
        return await count(pg, outbox_table) == 0

    await wait_for(all_sent, 30, "a new relay to publish the rows again")
    entries = by_key(await stream(broker, "orders.placed"))
    assert set(entries) == set(expected)
    for key, ids in entries.items():
        originals, republished = ids[: len(ids) // 2], ids[len(ids) // 2 :]
        assert originals == expected[key]
        assert republished == originals  # same ids, same order: downstream inboxes drop the copies
    assert await count(pg, sent_table) == 200


async def _waiting_ids_by_key(engine: AsyncEngine) -> dict[str | None, list[str]]:
    async with engine.connect() as conn:
        rows = (
            await conn.execute(select(outbox_table.c.key, outbox_table.c.message_id).order_by(outbox_table.c.seq))
        ).all()
    out: dict[str | None, list[str]] = defaultdict(list)
    for key, message_id in rows:
        out[key].append(message_id)
    return out


@pytest.mark.postgres
@pytest.mark.fault
@pytest.mark.slow
async def test_two_relays_never_publish_a_row_twice_and_keep_each_keys_order(
    pg: AsyncEngine, pg_url: str, broker: RedisBroker, namespace: str, relays: Relays
) -> None:
    for name in ("a", "b"):  # small batches and few shards each, so that both relays get work
        relays.start(name, pg_url, namespace, "--batch-size", "40", "--max-shards", "6")

    async def both_started() -> bool:
        return all(any(e.get("event") == "outbox relay started" for e in relays.events(n)) for n in "ab")

    await wait_for(both_started, 30, "both relays to start")
    producers, per_producer, keys = 4, 300, 24

    async def produce(p: int) -> None:
        for i in range(0, per_producer, 3):
            async with pg.begin() as conn:  # several producers write the same keys concurrently
                for j in range(i, i + 3):
                    await outbox.add_event(conn, "ledger", {"p": p, "n": j}, key=f"acct-{(p * 7 + j) % keys}")
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        for p in range(producers):
            tg.start_soon(produce, p)

    total = producers * per_producer

    async def all_sent() -> bool:
        return await count(pg, sent_table) == total

    await wait_for(all_sent, 60, "the relays to publish everything")
    for proc in relays.procs.values():
        proc.send_signal(signal.SIGTERM)
    assert [proc.wait(timeout=30) for proc in relays.procs.values()] == [0, 0]
    entries = await stream(broker, "ledger")
    assert Counter(e.id for e in entries).most_common(1)[0][1] == 1  # no row published twice
    assert by_key(entries) == await sent_ids_by_key(pg)  # every id, each key in commit order
    published = [
        next(e["published"] for e in relays.events(n) if e.get("event") == "outbox relay stopped") for n in "ab"
    ]
    assert sum(published) == total and min(published) > 0, published


class TcpProxy:
    """A TCP forwarder that can be cut and restored on the same port: a broker outage on demand."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.port = 0
        self._scope: anyio.CancelScope | None = None

    async def start(self, tg: anyio.abc.TaskGroup) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=self.port, reuse_port=True)
        self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
        ready = anyio.Event()

        async def serve() -> None:
            with anyio.CancelScope() as self._scope:
                ready.set()
                async with listener:
                    await listener.serve(self._forward)

        tg.start_soon(serve)
        await ready.wait()

    def cut(self) -> None:
        assert self._scope is not None
        self._scope.cancel()  # closes the listener and every forwarded connection

    async def _forward(self, client: anyio.abc.SocketStream) -> None:
        async with client, await anyio.connect_tcp(*self.target) as upstream:

            async def pump(src: anyio.abc.SocketStream, dst: anyio.abc.SocketStream) -> None:
                try:
                    async for chunk in src:
                        await dst.send(chunk)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    pass
                finally:
                    tg.cancel_scope.cancel()

            async with anyio.create_task_group() as tg:
                tg.start_soon(pump, client, upstream)
                tg.start_soon(pump, upstream, client)


@pytest.mark.postgres
async def test_relay_rides_out_a_broker_outage(
    pg: AsyncEngine, redis_url: str, namespace: str, broker: RedisBroker
) -> None:
    parts = urlsplit(redis_url)
    if parts.scheme != "redis" or not parts.port:
        pytest.skip("needs a redis://host:port broker to put a proxy in front of")
    proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port)
    async with anyio.create_task_group() as tg:
        await proxy.start(tg)
        auth = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""  # the embedded server has a password
        proxied = await connect(f"redis://{auth}127.0.0.1:{proxy.port}{parts.path or ''}", namespace=namespace)
        relay = OutboxRelay(pg, proxied, poll_interval=0.1)
        await tg.start(relay.run)

        async def published(n: int) -> bool:
            return len({e.id for e in await stream(broker, "orders.placed")}) == n

        async with pg.begin() as conn:
            ids = [await outbox.add_event(conn, "orders.placed", {"n": 0})]
        await wait_for(lambda: published(1), 10, "the first message")
        proxy.cut()
        async with pg.begin() as conn:
            ids += [await outbox.add_event(conn, "orders.placed", {"n": i}) for i in range(1, 4)]
        await anyio.sleep(1.0)
        assert await count(pg, outbox_table) == 3  # still waiting, not lost
        await proxy.start(tg)  # the broker is back
        await wait_for(lambda: published(4), 20, "the relay to catch up")
        assert sorted({e.id for e in await stream(broker, "orders.placed")}) == sorted(ids)
        relay.stop()
        proxy.cut()
    await proxied.close()


# -- the command line -------------------------------------------------------------------------------------


async def test_cli_migrates_prints_ddl_and_relays_once(
    redis_url: str, namespace: str, tmp_path: Path, broker: RedisBroker
) -> None:
    env = {**cli_env(redis_url), "FRAMEWORK_NAMESPACE": namespace}
    db = f"sqlite:///{tmp_path / 'app.db'}"
    migrated = framework_cli("outbox", "migrate", "--database-url", db, env=env, cwd=tmp_path)
    assert migrated.returncode == 0, migrated.stderr
    engine = outbox.create_engine(db)
    async with engine.begin() as conn:
        ids = [await outbox.add_event(conn, "orders.placed", {"n": i}) for i in range(3)]
    await engine.dispose()
    once = framework_cli("outbox", "relay", "--database-url", db, "--once", env=env, cwd=tmp_path)
    assert once.returncode == 0 and "published 3 message(s)" in once.stdout, once.stderr
    assert [e.id for e in await stream(broker, "orders.placed")] == ids
    ddl = framework_cli("outbox", "ddl", "--dialect", "postgresql", env=env, cwd=tmp_path)
    assert "CREATE TABLE IF NOT EXISTS framework_outbox (" in ddl.stdout
    assert "EXECUTE FUNCTION framework_outbox_notify()" in ddl.stdout


def test_cli_errors_are_one_line_and_say_what_to_do(redis_url: str, tmp_path: Path) -> None:
    env = cli_env(redis_url)
    bad = framework_cli("outbox", "relay", "--database-url", "mysql://u@h/d", env=env, cwd=tmp_path)
    assert bad.returncode == 2 and "unsupported database URL scheme 'mysql'" in bad.stderr
    down = framework_cli(
        "outbox", "relay", "--database-url", "postgresql://postgres@127.0.0.1:9/x", env=env, cwd=tmp_path
    )
    assert down.returncode == 1
    assert "cannot reach the database at postgresql://postgres@127.0.0.1:9/x" in down.stderr
    assert "Start PostgreSQL or point --database-url" in down.stderr
    empty = framework_cli(
        "outbox", "status", "--database-url", f"sqlite:///{tmp_path / 'empty.db'}", env=env, cwd=tmp_path
    )
    assert empty.returncode == 1 and "framework outbox migrate" in empty.stderr
    for result in (bad, down, empty):
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
