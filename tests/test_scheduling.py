"""Scheduled messages and recurring jobs, on real servers and real worker processes.

Counts what arrived early, late, twice or never: a scheduled message is moved to its destination
once, after its due time, by whichever worker is alive; a recurring job fires each tick once
across its instances.
"""

from __future__ import annotations

import json
import shutil
import signal
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import anyio
import pytest
import redis

from broker import connect, derive_id, now_ms
from broker.headers import DELIVER_AT
from broker.redis import EmbeddedServer
from framework import Client, Context, Queue, RetryPolicy, Runtime, Service, SyncClient, outbox
from framework.scheduling import Job, ScheduleError, Tick, due_ms
from framework.testing import TEST_SETTINGS
from tests.conftest import run_cli
from tests.workers import Workers, wait_for

TARGET = Queue("sched.target", partitions=2)  # as tests/apps/scheduleapp.py declares it
OPTS = ("--visibility-timeout", "2")  # a killed worker's entries are taken over within seconds


def _stream_len(r: redis.Redis, namespace: str, name: str, partitions: int = 1) -> int:
    return sum(r.xlen(f"{namespace}:{{{name}:{p}}}") for p in range(partitions))


# -- the API: due times, errors, store, move, cancel -------------------------------------------------


def test_delay_and_at_give_a_due_time_and_bad_ones_say_what_to_change() -> None:
    before = now_ms()
    assert before + 1500 <= due_ms(delay=1.5) <= now_ms() + 1500
    assert before + 60_000 <= due_ms(delay=timedelta(minutes=1)) <= now_ms() + 60_000
    at = datetime(2030, 1, 1, 3, tzinfo=UTC)
    assert due_ms(at=at) == int(at.timestamp() * 1000)
    assert due_ms() is None
    with pytest.raises(ScheduleError, match="no time zone"):
        due_ms(at=datetime(2030, 1, 1, 3))
    with pytest.raises(ScheduleError, match=">= 0"):
        due_ms(delay=-1)
    with pytest.raises(ScheduleError, match="not both"):
        due_ms(delay=1, at=at)
    with pytest.raises(ScheduleError, match="seconds or a timedelta"):
        due_ms(delay="5")  # type: ignore[arg-type]


def test_cron_ticks_follow_the_time_zone_and_intervals_align_to_the_epoch() -> None:
    berlin = Job(service="s", name="nightly", queue="s.job.nightly", cron="0 3 * * *", tz="Europe/Berlin")
    now = int(datetime(2026, 1, 10, 12, tzinfo=UTC).timestamp() * 1000)
    assert berlin.next_tick(now) == int(datetime(2026, 1, 11, 2, tzinfo=UTC).timestamp() * 1000)  # CET = UTC+1
    assert berlin.last_tick(now) == int(datetime(2026, 1, 10, 2, tzinfo=UTC).timestamp() * 1000)
    on_tick = int(datetime(2026, 1, 10, 2, tzinfo=UTC).timestamp() * 1000)
    assert berlin.last_tick(on_tick) == on_tick and berlin.last_tick(on_tick + 30_000) == on_tick
    assert berlin.last_tick(on_tick - 1) == on_tick - 86_400_000 and berlin.next_tick(on_tick) == on_tick + 86_400_000
    summer = int(datetime(2026, 7, 10, 12, tzinfo=UTC).timestamp() * 1000)
    assert berlin.next_tick(summer) == int(datetime(2026, 7, 11, 1, tzinfo=UTC).timestamp() * 1000)  # CEST
    every = Job(service="s", name="e", queue="s.job.e", interval_ms=300_000)
    assert every.last_tick(now + 1) == now and every.next_tick(now) == now + 300_000
    with pytest.raises(ScheduleError, match="not a valid cron"):
        Job(service="s", name="bad", queue="s.job.bad", cron="61 * * * *")
    with pytest.raises(ScheduleError, match="unknown time zone"):
        Job(service="s", name="tz", queue="s.job.tz", cron="0 3 * * *", tz="Mars/Olympus")
    svc = Service("jobs")
    with pytest.raises(Exception, match="at least one second"):
        svc.every(0.5)(lambda tick: None)

    @svc.cron("0 3 * * *", tz="Europe/Berlin")
    async def nightly(tick: Tick, ctx: Context) -> None: ...

    assert [h.destination.name for h in svc.handlers] == ["jobs.job.nightly"]
    assert svc.jobs[0].cron == "0 3 * * *" and svc.jobs[0].tz == "Europe/Berlin"
    with pytest.raises(Exception, match="declared twice"):
        svc.every(60, name="nightly")(lambda tick: None)


@pytest.mark.anyio
async def test_a_scheduled_message_waits_is_moved_once_and_can_be_cancelled(redis_url: str, namespace: str) -> None:
    r = redis.Redis.from_url(redis_url)
    async with Client(redis_url, namespace=namespace) as client:
        broker = client.broker
        first = await client.send(TARGET, {"n": "a"}, delay=30, key="a")
        second = await client.send(TARGET, {"n": "b"}, delay=timedelta(seconds=40), key="b")
        assert _stream_len(r, namespace, "sched.target", 2) == 0  # stored, not delivered
        listed = await client.scheduled()
        assert [m.message_id for m in listed] == [first, second]  # earliest first
        assert listed[0].envelope is not None and listed[0].envelope.key == "a"
        assert await broker.count_scheduled() == 2

        # Not due yet: nothing moves. Three movers racing past its due time: it moves once.
        assert (await broker.move_scheduled(now_ms(), sweep=True)).moved == 0
        later = now_ms() + 31_000
        results = await _race([connect(redis_url, namespace=namespace) for _ in range(3)], later)
        assert sum(results) == 1
        assert _stream_len(r, namespace, "sched.target", 2) == 1
        [entry] = [e for p in (0, 1) for e in r.xrange(f"{namespace}:{{sched.target:{p}}}")]
        assert entry[1][b"id"].decode() == first  # delivered under its scheduled id

        assert await client.cancel_scheduled(second) is True
        assert await client.cancel_scheduled(second) is False  # gone: nothing to cancel
        assert (await broker.move_scheduled(now_ms() + 3_600_000, sweep=True)).moved == 0
        assert await client.scheduled() == []

        # A due time already past is delivered at once; a repeated idempotency key is dropped.
        assert await client.send(TARGET, {"n": "c"}, at=datetime.now(UTC) - timedelta(hours=1)) is not None
        assert _stream_len(r, namespace, "sched.target", 2) == 2
        assert await client.send(TARGET, {"n": "d"}, delay=30, idempotency_key="once") is not None
        assert await client.send(TARGET, {"n": "d"}, delay=30, idempotency_key="once") is None
        assert await broker.count_scheduled() == 1
        many = await client.send_many(TARGET, [{"n": i} for i in range(3)], delay=30)
        async with client.batch() as batch:
            batched = batch.send(TARGET, {"n": "e"}, at=datetime.now(UTC) + timedelta(minutes=1))
        assert await broker.count_scheduled() == 5
        assert {m.message_id for m in await client.scheduled()} >= {*many, batched}
        assert _stream_len(r, namespace, "sched.target", 2) == 2  # still only the past-due one and "a"


async def _race(pending: list, when: int) -> list[int]:
    brokers = [await b for b in pending]
    moved: list[int] = []

    async def one(b) -> None:  # type: ignore[no-untyped-def]
        moved.append((await b.move_scheduled(when, sweep=True)).moved)

    try:
        async with anyio.create_task_group() as tg:
            for b in brokers:
                tg.start_soon(one, b)
    finally:
        for b in brokers:
            await b.close()
    return moved


@pytest.mark.anyio
async def test_a_tick_fires_once_and_missed_ticks_collapse_into_one(redis_url: str, namespace: str) -> None:
    job = Job(service="s", name="j", queue="s.job.j", interval_ms=1000)
    r = redis.Redis.from_url(redis_url)
    broker = await connect(redis_url, namespace=namespace)
    try:
        t = job.last_tick(now_ms())
        assert await broker.fire_tick(job.queue, t, job.tick_envelope(t)) == -1  # first sight: baseline only
        assert await broker.fire_tick(job.queue, t + 1000, job.tick_envelope(t + 1000)) == 1
        assert await broker.fire_tick(job.queue, t + 1000, job.tick_envelope(t + 1000)) == 0  # a second instance
        assert await broker.fire_tick(job.queue, t, job.tick_envelope(t)) == 0  # a late instance's older tick
        assert await broker.fire_tick(job.queue, t + 60_000, job.tick_envelope(t + 60_000)) == 1  # after downtime
        entries = r.xrange(f"{namespace}:{{s.job.j:0}}")
        assert len(entries) == 2  # 59 missed ticks fired once, as the latest
        ids = [e[1][b"id"].decode() for e in entries]
        assert ids == [job.tick_envelope(t + 1000).id, job.tick_envelope(t + 60_000).id]  # derived from the tick
    finally:
        await broker.close()


# -- staging: ctx.send(delay=) and the outbox --------------------------------------------------------


@pytest.mark.anyio
async def test_a_failing_handlers_delayed_send_is_never_scheduled(redis_url: str, namespace: str) -> None:
    arrived: dict[str, int] = {}
    ids: dict[str, str] = {}
    svc = Service("stager", retry=RetryPolicy(max_attempts=1))
    target = Service("target")

    @svc.command("sched.trigger")
    async def trigger(cmd: dict, ctx: Context) -> None:
        ctx.send("sched.later", {"n": cmd["n"]}, delay=1.0)
        if cmd.get("tx"):  # effects in one script with the ack: the schedule is stored just before it
            ctx.redis_transaction().hincrby(f"{namespace}:{ctx.hash_tag}:test:tx", "runs", 1)
        if cmd["fail"]:
            raise RuntimeError("failing on purpose")

    @target.command("sched.later")
    async def later(cmd: dict, ctx: Context) -> None:
        arrived[cmd["n"]] = now_ms()
        ids[cmd["n"]] = ctx.message_id

    runtime = Runtime([svc, target], url=redis_url, namespace=namespace, settings=TEST_SETTINGS)
    async with anyio.create_task_group() as tg:
        await tg.start(runtime.run)
        async with Client(redis_url, namespace=namespace) as client:
            sent_at = now_ms()
            ok = await client.send("sched.trigger", {"n": "ok", "fail": False})
            await client.send("sched.trigger", {"n": "bad", "fail": True})
            await client.send("sched.trigger", {"n": "tx", "fail": False, "tx": True})
            with anyio.fail_after(10):
                while "ok" not in arrived or "tx" not in arrived:
                    await anyio.sleep(0.05)
            await anyio.sleep(1.5)  # the failed run's message would be due by now too
            assert await client.scheduled() == []
        stats = runtime.stats()
        runtime.stop()
    assert set(arrived) == {"ok", "tx"}  # the failed handler's staged schedule never left
    assert stats["stager.trigger"]["dead_lettered"] == 1
    assert arrived["ok"] - sent_at >= 1000 and arrived["tx"] - sent_at >= 1000
    # scheduled under the id derived from its trigger: a retried handler re-schedules the same id
    assert ok is not None and ids["ok"] == derive_id(ok, "stager/0")


@pytest.mark.anyio
async def test_the_outbox_relay_schedules_what_a_transaction_added_with_a_delay(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    engine = outbox.create_engine(f"sqlite:///{tmp_path / 'outbox.db'}")
    await outbox.create_tables(engine)
    r = redis.Redis.from_url(redis_url)
    async with engine.begin() as conn:
        message_id = await outbox.add_command(conn, "sched.outboxed", {"n": 1}, delay=30)
    broker = await connect(redis_url, namespace=namespace)
    try:
        relay = outbox.OutboxRelay(engine, broker)
        assert await relay.run_once() == 1
        assert _stream_len(r, namespace, "sched.outboxed") == 0
        [waiting] = await broker.scheduled_messages()
        assert waiting.message_id == message_id and waiting.due_ms > now_ms() + 25_000
        assert (await broker.move_scheduled(waiting.due_ms, sweep=True)).moved == 1
        assert _stream_len(r, namespace, "sched.outboxed") == 1
    finally:
        await broker.close()
        await engine.dispose()


# -- the CLI -------------------------------------------------------------------------------------------


def test_schedule_list_show_cancel_with_json(worker_env: dict[str, str], redis_url: str, namespace: str) -> None:
    with SyncClient(redis_url, namespace=namespace) as client:
        a = client.send(TARGET, {"n": "a"}, delay=600)
        b = client.send(TARGET, {"n": "b"}, delay=900)
    listed = run_cli("schedule", "list", "--json", env=worker_env)
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert [row["message_id"] for row in rows] == [a, b]
    assert rows[0]["destination"] == "sched.target" and json.loads(rows[0]["body"]) == {"n": "a"}
    assert DELIVER_AT in rows[0]["headers"]
    shown = run_cli("schedule", "show", a, "--json", env=worker_env)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["due_ms"] == rows[0]["due_ms"]
    status = run_cli("status", "sched.target", "--json", env=worker_env)
    assert status.returncode == 0, status.stderr
    assert [(d["name"], d["scheduled"], d["depth"]) for d in json.loads(status.stdout)] == [("sched.target", 2, 0)]
    cancelled = run_cli("schedule", "cancel", a, "--json", env=worker_env)
    assert cancelled.returncode == 0, cancelled.stderr
    assert json.loads(cancelled.stdout) == {"cancelled": [a], "not_scheduled": []}
    again = run_cli("schedule", "cancel", a, env=worker_env)
    assert again.returncode == 1 and "not scheduled" in again.stderr
    missing = run_cli("schedule", "show", a, env=worker_env)
    assert missing.returncode == 2 and "no scheduled message" in missing.stderr
    assert "Traceback" not in missing.stderr and len(missing.stderr.strip().splitlines()) == 1
    bad = run_cli("send", "sched.target", "{}", "--delay", "-3", env=worker_env)
    assert bad.returncode == 2 and "must not be negative" in bad.stderr
    table = run_cli("schedule", "list", env=worker_env)
    assert table.returncode == 0 and "sched.target" in table.stdout
    status = run_cli("status", "sched.target", "--json", env=worker_env)
    assert json.loads(status.stdout)[0]["scheduled"] == 1  # a was cancelled
    status_table = run_cli("status", env=worker_env)
    assert status_table.returncode == 0 and "scheduled" in status_table.stdout


# -- real processes: racing movers, kills, restarts ------------------------------------------------------


@pytest.mark.slow
def test_three_workers_deliver_each_scheduled_message_once_after_its_due_time_across_a_sigkill(
    workers: Workers, redis_url: str, namespace: str
) -> None:
    r = redis.Redis.from_url(redis_url)
    procs = [workers.start("scheduleapp:receiver", name, *OPTS, CONSUMER_NAME=name) for name in "abc"]
    total = 90
    start = now_ms() + 3000  # due from 3 s to 7.5 s from now, one every 50 ms
    with SyncClient(redis_url, namespace=namespace) as client:
        for i in range(total):
            due = start + 50 * i
            client.send(TARGET, {"n": str(i), "due": due}, at=datetime.fromtimestamp(due / 1000, UTC), key=str(i))
    assert _stream_len(r, namespace, "sched.target", 2) == 0
    wait_for(lambda: r.hlen(f"{namespace}:test:arrived") >= total // 3, 30, "a third of the messages")
    procs[0].send_signal(signal.SIGKILL)  # a mover and consumer dies midway
    procs[0].wait()
    wait_for(lambda: r.hlen(f"{namespace}:test:arrived") == total, 30, "every scheduled message")
    time.sleep(1.0)  # a duplicate move would show up meanwhile
    arrived = {k.decode(): int(v) for k, v in r.hgetall(f"{namespace}:test:arrived").items()}
    due = {k.decode(): int(v) for k, v in r.hgetall(f"{namespace}:test:due").items()}
    entries = {str(i): r.scard(f"{namespace}:test:entries:{i}") for i in range(total)}
    assert set(arrived) == {str(i) for i in range(total)}  # none lost
    assert all(n == 1 for n in entries.values()), entries  # none moved twice
    lateness = sorted(arrived[n] - due[n] for n in arrived)
    assert lateness[0] >= 0, lateness[:5]  # none early
    assert lateness[-1] < 2500, lateness[-5:]  # about a second at most, on a loaded test machine
    assert (
        r.zcard(f"{namespace}:{{sched.target:0}}:scheduled") + r.zcard(f"{namespace}:{{sched.target:1}}:scheduled") == 0
    )


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_schedule_survives_a_server_kill_9_and_restart() -> None:
    data = Path(tempfile.mkdtemp(prefix="framework-schedule-"))
    server = EmbeddedServer(data)
    arrived: dict[str, int] = {}
    svc = Service("s")

    @svc.command("later")
    async def later(cmd: dict, ctx: Context) -> None:
        arrived[cmd["n"]] = arrived.get(cmd["n"], 0) + 1

    try:
        url = server.ensure_running()
        async with Client(url, namespace="sched") as client:
            due = datetime.now(UTC) + timedelta(seconds=4)
            ids = [await client.send("later", {"n": str(i)}, at=due) for i in range(10)]
        await anyio.sleep(1.5)  # appendfsync everysec: the schedule reaches the disk
        pid = server.status().pid
        assert pid is not None
        import os

        os.kill(pid, signal.SIGKILL)
        while server.status().running:
            await anyio.sleep(0.05)
        url = server.ensure_running()  # replays the AOF (the port may differ: another process may have taken it)
        async with Client(url, namespace="sched") as client:
            assert sorted(m.message_id for m in await client.scheduled()) == sorted(ids)
        runtime = Runtime([svc], url=url, namespace="sched", settings=TEST_SETTINGS)
        async with anyio.create_task_group() as tg:
            await tg.start(runtime.run)
            with anyio.fail_after(15):
                while len(arrived) < 10:
                    await anyio.sleep(0.05)
            assert datetime.now(UTC) >= due
            await anyio.sleep(0.5)
            runtime.stop()
        assert arrived == {str(i): 1 for i in range(10)}
    finally:
        server.stop()
        shutil.rmtree(data, ignore_errors=True)


@pytest.mark.slow
def test_a_recurring_job_fires_once_per_tick_across_three_instances_with_one_killed(
    workers: Workers, redis_url: str, namespace: str
) -> None:
    r = redis.Redis.from_url(redis_url)
    procs = [workers.start("scheduleapp:ticker", name, *OPTS, CONSUMER_NAME=name) for name in "abc"]
    ticks_key = f"{namespace}:{{ticker.job.heartbeat:0}}:test:ticks"
    wait_for(lambda: r.hlen(ticks_key) >= 5, 30, "five ticks")
    procs[1].send_signal(signal.SIGKILL)
    procs[1].wait()
    seen = r.hlen(ticks_key)
    wait_for(lambda: r.hlen(ticks_key) >= seen + 6, 30, "six more ticks after the kill")
    for p in (procs[0], procs[2]):
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0
    ticks = {int(k): int(v) for k, v in r.hgetall(ticks_key).items()}
    assert all(v == 1 for v in ticks.values()), ticks  # no tick ran its effects twice
    times = sorted(ticks)
    assert times == list(range(times[0], times[-1] + 1000, 1000)), times  # and none was skipped
    fired = int(r.hget(f"{namespace}:{{ticker.job.heartbeat:0}}:job", "fired") or 0)
    assert fired == len(times)  # each tick was appended once, whoever fired it
    runs = {k.decode(): int(v) for k, v in r.hgetall(f"{namespace}:test:tick-runs").items()}
    assert len(runs) >= 2  # the instances shared the work


@pytest.mark.slow
@pytest.mark.anyio
async def test_scheduling_and_ticks_work_on_a_redis_cluster(tmp_path: Path) -> None:
    from broker.redis.embedded_cluster import start_cluster

    running = start_cluster(tmp_path / "cluster", nodes=3)
    arrived: list[int] = []
    ticks: list[Tick] = []
    svc = Service("s")
    queue = Queue("cl.later", partitions=4)  # partitions spread over the masters

    @svc.command(queue)
    async def later(cmd: dict, ctx: Context) -> None:
        arrived.append(cmd["n"])

    @svc.every(1)
    async def tick(t: Tick, ctx: Context) -> None:
        ticks.append(t)

    try:
        async with Client(running.url, namespace="cl") as client:
            ids = [await client.send(queue, {"n": i}, delay=1.0, key=str(i)) for i in range(20)]
            assert await client.broker.count_scheduled() == 20
            assert await client.cancel_scheduled(ids[0]) is True
            runtime = Runtime([svc], url=running.url, namespace="cl", settings=TEST_SETTINGS)
            async with anyio.create_task_group() as tg:
                await tg.start(runtime.run)
                with anyio.fail_after(15):
                    while len(arrived) < 19 or len(ticks) < 2:
                        await anyio.sleep(0.05)
                await anyio.sleep(0.3)
                runtime.stop()
        assert sorted(arrived) == list(range(1, 20))
    finally:
        running.stop()
