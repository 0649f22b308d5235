"""Group commit of ``ctx.sql_transaction`` blocks: savepoints of a shared transaction, per-message outcomes.

Real PostgreSQL and a real broker. Each test counts effects: every message's row exactly once,
no failed message's row, whatever the grouping did.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import redis
import structlog
from sqlalchemy import text

from framework import Context, RetryPolicy, Service, group_commit, outbox
from framework.settings import RuntimeSettings
from framework.testing import TEST_SETTINGS, ServiceHarness
from tests.test_sql_effects import _counts, _prepare, run_counter_under_kills

pytestmark = pytest.mark.postgres


def _settings(**changes: Any) -> RuntimeSettings:
    import attrs

    return attrs.evolve(TEST_SETTINGS, concurrency=16, **changes)


class Probe:
    """What the handlers saw of the group committer."""

    def __init__(self) -> None:
        self.committer: Any = None

    def see(self, engine: Any) -> None:
        groups = group_commit.current()
        assert groups is not None, "ctx.sql_transaction runs outside a runtime's group commit"
        self.committer = groups.for_engine(engine)


def _counter(engine: Any, probe: Probe, *, sleep: float = 0.005, fail: set[str] | None = None, **svc: Any) -> Service:
    svc_ = Service("counter", **svc)

    @svc_.command("counter.increment")
    async def increment(cmd: dict, ctx: Context) -> None:
        probe.see(engine)
        async with ctx.sql_transaction(engine) as conn:
            await conn.execute(text("INSERT INTO applied (n) VALUES (:n)"), {"n": cmd["n"]})
            ctx.publish("counter.incremented", {"n": cmd["n"]}, key=cmd["n"])  # keyed: per-key locks too
            await anyio.sleep(sleep)
            if fail and cmd["n"] in fail:
                raise RuntimeError(f"{cmd['n']} always fails")
            await conn.execute(text("UPDATE counters SET value = value + 1 WHERE name = 'total'"))

    return svc_


async def _drain(svc: Service, engine: Any, settings: RuntimeSettings, redis_url: str, namespace: str) -> dict:
    """Send commands 0..199 to ``svc``, run until idle, return the handler's stats; dispose ``engine``."""
    try:
        async with ServiceHarness([svc], url=redis_url, namespace=namespace, settings=settings) as h:
            await h.client.send_many("counter.increment", [{"n": str(n)} for n in range(200)])
            await h.run_until_idle()
            return h.stats()["counter.increment"]
    finally:
        await engine.dispose()


@pytest.mark.anyio
async def test_group_commit_applies_every_effect_once_with_many_handlers_in_flight(
    pg_url: str, redis_url: str, namespace: str
) -> None:
    await _prepare(pg_url)
    engine = outbox.create_engine(pg_url)
    probe = Probe()
    svc = _counter(engine, probe)
    settings = _settings(sql_connections=2, group_commit_size=16, group_commit_wait=0.05)
    try:
        async with ServiceHarness([svc], url=redis_url, namespace=namespace, settings=settings) as h:
            await h.client.send("counter.increment", {"n": "first"}, message_id="m-first")
            await h.client.send_many("counter.increment", [{"n": str(n)} for n in range(299)])
            await h.client.send("counter.increment", {"n": "first"}, message_id="m-first")  # a copy
            await h.run_until_idle()
            stats = h.stats()["counter.increment"]
    finally:
        await engine.dispose()
    assert await _counts(pg_url) == (300, 300, 300, 300)
    committer = probe.committer
    assert committer.members == 300 and committer.lanes == settings.concurrency
    assert committer.commits < 300 / 3, f"{committer.commits} commits for 300 messages: no grouping"
    assert stats["duplicates"] == 1 and stats["failed"] == 0


@pytest.mark.anyio
async def test_a_failing_handler_in_a_group_rolls_back_alone(pg_url: str, redis_url: str, namespace: str) -> None:
    await _prepare(pg_url)
    engine = outbox.create_engine(pg_url)
    probe = Probe()
    bad = {str(n) for n in range(5, 200, 20)}
    svc = _counter(engine, probe, fail=bad, retry=RetryPolicy(max_attempts=2, immediate=0, backoff=0.01))
    settings = _settings(sql_connections=1, group_commit_size=32, group_commit_wait=0.05)
    stats = await _drain(svc, engine, settings, redis_url, namespace)
    good = 200 - len(bad)
    assert await _counts(pg_url) == (good, good, good, good)  # the failing ones' rows and messages undone
    assert probe.committer.commits < good / 3  # the failures happened inside groups
    assert stats["dead_lettered"] == len(bad)


@pytest.mark.anyio
async def test_a_failed_commit_fails_the_whole_group_and_its_retry_doubles_nothing(
    pg_url: str, redis_url: str, namespace: str
) -> None:
    """The connection dies between a block's end and its group's COMMIT (pg_terminate_backend)."""
    await _prepare(pg_url)
    engine = outbox.create_engine(pg_url)
    killer = outbox.create_engine(pg_url)
    probe = Probe()
    killed: list[int] = []
    svc = Service("counter", retry=RetryPolicy(max_attempts=5, immediate=0, backoff=0.01))

    @svc.command("counter.increment")
    async def increment(cmd: dict, ctx: Context) -> None:
        probe.see(engine)
        async with ctx.sql_transaction(engine) as conn:
            await conn.execute(text("INSERT INTO applied (n) VALUES (:n)"), {"n": cmd["n"]})
            await conn.execute(text("UPDATE counters SET value = value + 1 WHERE name = 'total'"))
            ctx.publish("counter.incremented", {"n": cmd["n"]})
            await anyio.sleep(0.01)
            if cmd["n"] == "20" and not killed:
                pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
                async with killer.connect() as other:
                    await other.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
                    await other.commit()
                killed.append(pid)
                await anyio.sleep(0.05)  # the server closes the connection; the block ends normally

    settings = _settings(sql_connections=1, group_commit_size=64, group_commit_wait=1.0)
    try:
        async with ServiceHarness([svc], url=redis_url, namespace=namespace, settings=settings) as h:
            await h.client.send_many("counter.increment", [{"n": str(n)} for n in range(60)])
            await h.run_until_idle()
            stats = h.stats()["counter.increment"]
    finally:
        await engine.dispose()
        await killer.dispose()
    assert killed
    assert await _counts(pg_url) == (60, 60, 60, 60)
    assert stats["failed"] >= 2, stats  # the block that killed it and the others in its group
    assert stats["dead_lettered"] == 0


@pytest.mark.anyio
async def test_group_commit_size_one_is_one_transaction_per_message(
    pg_url: str, redis_url: str, namespace: str
) -> None:
    await _prepare(pg_url)
    engine = outbox.create_engine(pg_url)
    probe = Probe()
    svc = _counter(engine, probe, fail={"3"}, retry=RetryPolicy(max_attempts=1))
    settings = _settings(sql_connections=2, group_commit_size=1, group_commit_wait=1.0)
    try:
        async with ServiceHarness([svc], url=redis_url, namespace=namespace, settings=settings) as h:
            await h.client.send_many("counter.increment", [{"n": str(n)} for n in range(50)])
            await h.run_until_idle()
    finally:
        await engine.dispose()
    assert await _counts(pg_url) == (49, 49, 49, 49)
    assert probe.committer.commits == probe.committer.members == 49


@pytest.mark.anyio
async def test_a_finished_block_waits_at_most_the_group_commit_wait_plus_the_block_running(
    pg_url: str, redis_url: str, namespace: str
) -> None:
    await _prepare(pg_url)
    engine = outbox.create_engine(pg_url)
    probe = Probe()
    waits: list[float] = []
    durations: list[float] = []
    svc = Service("counter")

    @svc.command("counter.increment")
    async def increment(cmd: dict, ctx: Context) -> None:
        probe.see(engine)
        async with ctx.sql_transaction(engine) as conn:
            began = time.monotonic()
            await conn.execute(text("INSERT INTO applied (n) VALUES (:n)"), {"n": cmd["n"]})
            await anyio.sleep(0.003)
            ended = time.monotonic()
        waits.append(time.monotonic() - ended)
        durations.append(ended - began)

    wait = 0.04
    settings = _settings(sql_connections=1, group_commit_size=10_000, group_commit_wait=wait)
    try:
        async with ServiceHarness([svc], url=redis_url, namespace=namespace, settings=settings) as h:
            await h.client.send_many("counter.increment", [{"n": str(n)} for n in range(400)])
            await h.run_until_idle()
    finally:
        await engine.dispose()
    assert await _counts(pg_url) == (0, 400, 400, 0)
    committer = probe.committer
    # Handlers always wait for the one connection, so only the wait bound ends a group.
    assert committer.commits < 400 / 4
    bound = wait + max(durations) + 0.1  # + a commit and scheduling on a loaded machine
    assert max(waits) <= bound, f"a block waited {max(waits) * 1000:.0f} ms for its commit (bound {bound * 1000:.0f})"


@pytest.mark.anyio
async def test_inbox_sql_skips_the_redis_inbox_and_still_drops_copies(
    pg_url: str, redis_url: str, namespace: str
) -> None:
    await _prepare(pg_url)
    engine = outbox.create_engine(pg_url)
    probe = Probe()
    svc = _counter(engine, probe, inbox="sql")
    loose = Service("loose", inbox="sql")

    @loose.command("loose.jobs")
    async def forgetful(cmd: dict) -> None:
        pass  # no ctx.sql_transaction: nothing records the message

    assert svc.handlers[0].sql_inbox and not svc.handlers[0].inbox
    try:
        with structlog.testing.capture_logs() as logs:
            async with ServiceHarness([svc, loose], url=redis_url, namespace=namespace) as h:
                for n in range(20):
                    await h.client.send("counter.increment", {"n": str(n)}, message_id=f"m-{n}")
                await h.client.send("counter.increment", {"n": "4"}, message_id="m-4")  # a copy
                await h.client.send("loose.jobs", {})
                await h.run_until_idle()
                stats = h.stats()
    finally:
        await engine.dispose()
    assert await _counts(pg_url) == (20, 20, 20, 20)
    assert stats["counter.increment"]["duplicates"] == 1
    r = redis.Redis.from_url(redis_url)
    assert not r.keys(f"{namespace}:*inbox*"), "inbox='sql' wrote Redis inbox records"
    warnings = [e for e in logs if "inbox='sql' finished without ctx.sql_transaction" in e["event"]]
    assert len(warnings) == 1 and warnings[0]["log_level"] == "warning"


@pytest.mark.fault
@pytest.mark.slow
def test_workers_killed_mid_group_lose_and_double_nothing(
    worker_env: dict[str, str], tmp_path: Path, pg_url: str, redis_url: str, namespace: str
) -> None:
    """Long groups (50 ms wait, 2 connections), so most kills land while a group is open."""
    kills = run_counter_under_kills(
        {**worker_env, "DATABASE_URL": pg_url},
        tmp_path,
        pg_url,
        redis_url,
        namespace,
        total=4000,
        rounds=4,
        step=500,
        pause=0.1,
        extra=("--group-commit-ms", "50", "--sql-connections", "2"),
    )
    assert kills == 8


async def _passing(message: Any, ctx: Context, call_next: Any) -> Any:
    return await call_next()


@pytest.mark.anyio
@pytest.mark.parametrize("middleware", [False, True], ids=["direct", "with-middleware"])
async def test_blocks_sharing_a_transaction_with_a_failing_one_run_again_uncounted(
    pg_url: str, redis_url: str, namespace: str, middleware: bool
) -> None:
    """Without savepoints a failing block rolls back its whole group; the others run again, and
    a handler that catches that rollback still does not get its message acked without its row."""
    await _prepare(pg_url)
    engine = outbox.create_engine(pg_url)
    probe = Probe()
    runs: dict[str, int] = {}
    retry = RetryPolicy(max_attempts=2, immediate=0, backoff=0.01)
    svc = Service("counter", retry=retry, middleware=[_passing] if middleware else [])

    @svc.command("counter.increment")
    async def increment(cmd: dict, ctx: Context) -> None:
        probe.see(engine)
        runs[cmd["n"]] = runs.get(cmd["n"], 0) + 1
        try:  # a handler that swallows every error of its block (it must not lose the row)
            async with ctx.sql_transaction(engine) as conn:
                await conn.execute(text("INSERT INTO applied (n) VALUES (:n)"), {"n": cmd["n"]})
                ctx.publish("counter.incremented", {"n": cmd["n"]})
                await anyio.sleep(0.002)
                if cmd["n"].startswith("bad"):
                    raise RuntimeError(f"{cmd['n']} always fails")
                await conn.execute(text("UPDATE counters SET value = value + 1 WHERE name = 'total'"))
        except RuntimeError:
            raise
        except Exception:
            pass

    bad = [f"bad-{i}" for i in range(3)]
    names = [str(n) for n in range(150)]
    for i, name in enumerate(bad):
        names.insert(40 * (i + 1), name)  # each lands behind finished members of its group
    settings = _settings(sql_connections=1, group_commit_size=64, group_commit_wait=0.2)
    try:
        async with ServiceHarness([svc], url=redis_url, namespace=namespace, settings=settings) as h:
            await h.client.send_many("counter.increment", [{"n": n} for n in names])
            await h.run_until_idle()
            stats = h.stats()["counter.increment"]
    finally:
        await engine.dispose()
    assert await _counts(pg_url) == (150, 150, 150, 150)  # every good row once, nothing of the bad ones
    committer = probe.committer
    assert committer.rollbacks >= 3, "no failure rolled back a shared transaction: the test tests nothing"
    assert stats["failed"] == 2 * len(bad), stats  # only the bad ones' attempts count as failures
    assert stats["dead_lettered"] == len(bad)
    assert max(runs[n] for n in names if not n.startswith("bad")) >= 2  # some good ones ran again


@pytest.mark.anyio
async def test_a_message_committed_meanwhile_is_a_duplicate_at_commit_and_the_others_run_again(
    pg_url: str, redis_url: str, namespace: str
) -> None:
    """A copy's inbox row was committed by another run after this run's block began (here: written
    beforehand, as a worker that died after its commit leaves it): the group's commit collides."""
    await _prepare(pg_url)
    engine = outbox.create_engine(pg_url)
    probe = Probe()
    svc = _counter(engine, probe, sleep=0.002, inbox="sql")
    settings = _settings(sql_connections=1, group_commit_size=64, group_commit_wait=0.2)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO framework_inbox (group_name, message_id, processed_at) "
                    "VALUES ('counter', 'm-7', now())"
                )
            )
        async with ServiceHarness([svc], url=redis_url, namespace=namespace, settings=settings) as h:
            for n in range(40):
                await h.client.send("counter.increment", {"n": str(n)}, message_id=f"m-{n}")
            await h.run_until_idle()
            stats = h.stats()["counter.increment"]
    finally:
        await engine.dispose()
    assert await _counts(pg_url) == (39, 39, 39, 39)  # m-7's block ran, and nothing of it was kept
    assert probe.committer.rollbacks >= 1
    assert stats["duplicates"] == 1 and stats["failed"] == 0, stats


@pytest.mark.anyio
async def test_a_retry_looks_itself_up_before_its_block_runs(pg_url: str, redis_url: str, namespace: str) -> None:
    """An attempt after the first may follow a run that committed (a lost connection at COMMIT, a
    worker that died before its ack): it finds its inbox row first and its block does not run."""
    await _prepare(pg_url)
    engine = outbox.create_engine(pg_url)
    entered: list[int] = []
    svc = Service("counter", retry=RetryPolicy(max_attempts=3, immediate=0, backoff=0.01))

    @svc.command("counter.increment")
    async def increment(cmd: dict, ctx: Context) -> None:
        if ctx.attempt == 1:  # as if this run's commit had landed and the ack was lost
            async with engine.begin() as conn:
                await conn.execute(
                    text("INSERT INTO framework_inbox (group_name, message_id, processed_at) VALUES (:g, :m, now())"),
                    {"g": ctx.service, "m": ctx.message_id},
                )
            raise ConnectionError("lost after the commit")
        async with ctx.sql_transaction(engine) as conn:
            entered.append(ctx.attempt)
            await conn.execute(text("INSERT INTO applied (n) VALUES (:n)"), {"n": cmd["n"]})

    try:
        async with ServiceHarness([svc], url=redis_url, namespace=namespace, settings=_settings()) as h:
            await h.client.send("counter.increment", {"n": "1"})
            await h.run_until_idle()
            stats = h.stats()["counter.increment"]
    finally:
        await engine.dispose()
    assert entered == []
    assert await _counts(pg_url) == (0, 0, 0, 0)
    assert stats["duplicates"] == 1 and stats["failed"] == 1, stats


@pytest.mark.anyio
async def test_savepoints_while_blocks_fail_often(pg_url: str, redis_url: str, namespace: str) -> None:
    """Half of the blocks fail: the committer turns savepoints on, so they roll back alone and the
    good ones are neither lost, doubled, nor charged a failed attempt."""
    await _prepare(pg_url)
    engine = outbox.create_engine(pg_url)
    probe = Probe()
    bad = {str(n) for n in range(0, 200, 2)}
    svc = _counter(engine, probe, sleep=0.002, fail=bad, retry=RetryPolicy(max_attempts=1))
    settings = _settings(sql_connections=2, group_commit_size=32, group_commit_wait=0.05)
    stats = await _drain(svc, engine, settings, redis_url, namespace)
    assert await _counts(pg_url) == (100, 100, 100, 100)
    assert stats["failed"] == 100 and stats["dead_lettered"] == 100, stats
    committer = probe.committer
    assert committer.failure_rate > group_commit.SAVEPOINT_ABOVE
    assert committer.commits < 100 / 2  # still grouped


class _BlockContext:
    """What ``GroupCommitter.transaction`` reads of a handler's context."""

    service = "counter"
    attempt = 1

    def __init__(self, message_id: str) -> None:
        self.message_id = message_id
        self.outgoing: list[Any] = []
        self.error: BaseException | None = None

    def _unstage_from(self, position: int) -> list[Any]:
        return []

    def _sql_committed(self) -> None:
        pass

    def _sql_failed(self, error: BaseException) -> None:
        self.error = error


@pytest.mark.anyio
async def test_a_block_without_a_savepoint_never_rolls_back_to_an_earlier_members_savepoint(pg_url: str) -> None:
    """Savepoints go on and off with the failure rate: a block that joined without one and fails
    must not be undone to the savepoint an earlier member opened (that member's work would go
    with it while its inbox row commits: an effect lost)."""
    await _prepare(pg_url)
    engine = outbox.create_engine(pg_url)
    committer = group_commit.GroupCommitter(engine, size=64, wait=10.0, connections=1)
    returned: list[str] = []
    go = anyio.Event()

    async def member(name: str, rate_after: float | None, fail: bool) -> None:
        ctx = _BlockContext(f"m-{name}")
        with contextlib.suppress(RuntimeError, group_commit.GroupCommitFailed):
            async with committer.transaction(ctx) as conn:  # type: ignore[arg-type]
                await go.wait()  # the first holds the one connection until the others wait for it
                await conn.execute(text("INSERT INTO applied (n) VALUES (:n)"), {"n": name})
                if rate_after is not None:  # what the next member to join sees
                    committer.failure_rate = rate_after
                if fail:
                    raise RuntimeError(f"{name} fails")
            returned.append(name)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(member, "first", 1.0, False)  # the next one opens a savepoint
            await anyio.sleep(0.2)
            tg.start_soon(member, "second", 0.0, False)  # the next one opens none
            await anyio.sleep(0.1)
            tg.start_soon(member, "third", None, True)
            await anyio.sleep(0.1)
            go.set()  # one transaction: first, second (in a savepoint), third (in none)
    finally:
        await committer.aclose()
        await engine.dispose()
    engine = outbox.create_engine(pg_url)
    async with engine.connect() as conn:
        rows = {r[0] for r in await conn.execute(text("SELECT n FROM applied"))}
        inbox = {r[0] for r in await conn.execute(text("SELECT message_id FROM framework_inbox"))}
    await engine.dispose()
    assert committer.commits + committer.rollbacks == 1, "the three blocks were not in one transaction"
    assert "third" not in rows
    for name in returned:  # a block that returned normally committed its row with its inbox row
        assert name in rows and f"m-{name}" in inbox, (name, rows, inbox)
    assert {f"m-{n}" for n in rows} == inbox  # no inbox row without its effects


async def _trickle(committer: Any, spacing: float, count: int, block: float) -> list[float]:
    """Start ``count`` blocks ``spacing`` apart, each writing a row and taking ``block`` seconds;
    return how long each waited for its commit after its block ended."""
    waits: list[float] = []

    async def member(n: int) -> None:
        async with committer.transaction(_BlockContext(f"m-{n}")) as conn:  # type: ignore[arg-type]
            await conn.execute(text("INSERT INTO applied (n) VALUES (:n)"), {"n": str(n)})
            await anyio.sleep(block)
            ended = time.monotonic()
        waits.append(time.monotonic() - ended)

    async def busy_neighbour() -> None:  # long loop iterations, as in a loaded worker (uvloop's clock lags)
        while True:
            time.sleep(0.002)  # noqa: ASYNC251 - blocking on purpose
            await anyio.lowlevel.checkpoint()

    with anyio.fail_after(30):  # a transaction nobody ends would hang its members here
        async with anyio.create_task_group() as tg:
            tg.start_soon(busy_neighbour)
            async with anyio.create_task_group() as members:
                for n in range(count):
                    members.start_soon(member, n)
                    await anyio.sleep(spacing)
            tg.cancel_scope.cancel()
    return waits


async def _trickled(pg_url: str, wait: float, spacing: float, count: int, block: float) -> tuple[Any, list[float]]:
    """:func:`_trickle` on a fresh committer (4 connections, ``wait``) over ``pg_url``'s prepared
    tables; return the closed committer (its counters) and the blocks' waits for their commits."""
    await _prepare(pg_url)
    engine = outbox.create_engine(pg_url)
    committer = group_commit.GroupCommitter(engine, size=64, wait=wait, connections=4)
    try:
        waits = await _trickle(committer, spacing=spacing, count=count, block=block)
    finally:
        await committer.aclose()
        await engine.dispose()
    return committer, waits


async def _rows(pg_url: str) -> tuple[set[str], set[str]]:
    engine = outbox.create_engine(pg_url)
    try:
        async with engine.connect() as conn:
            rows = {r[0] for r in await conn.execute(text("SELECT n FROM applied"))}
            inbox = {r[0] for r in await conn.execute(text("SELECT message_id FROM framework_inbox"))}
    finally:
        await engine.dispose()
    return rows, inbox


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", [("asyncio", {"use_uvloop": True})])  # as workers run
async def test_under_a_steady_trickle_a_finished_transaction_stays_open_for_the_next_blocks(pg_url: str) -> None:
    """Blocks finishing less than the group wait apart, never waiting for a connection: each
    transaction stays open for the next blocks (fewer commits than blocks), a timer ends it, so
    every block returns within the wait bound, the last ones too."""
    wait = 0.03
    committer, waits = await _trickled(pg_url, wait, spacing=0.0015, count=300, block=0.001)
    rows, inbox = await _rows(pg_url)
    assert rows == {str(n) for n in range(300)} and inbox == {f"m-{n}" for n in range(300)}
    assert committer.members == 300
    # without lingering each block commits alone (about 300 commits); with it, a few blocks share
    # each (about 3 to 20 on a loaded CI machine, whose sleeps stretch the spacing)
    assert committer.commits < 300 / 2, f"{committer.commits} commits for 300 blocks: nothing lingered"
    bound = wait + 0.001 + 0.15  # + the block running on the link, a commit and a loaded machine
    assert max(waits) <= bound, f"a block waited {max(waits) * 1000:.0f} ms for its commit (bound {bound * 1000:.0f})"


@pytest.mark.anyio
async def test_blocks_finishing_further_apart_than_the_group_wait_commit_at_once(pg_url: str) -> None:
    """At a low rate nothing would join a transaction: each block commits alone, without waiting."""
    committer, _ = await _trickled(pg_url, 0.01, spacing=0.04, count=20, block=0.0)
    rows, _ = await _rows(pg_url)
    assert len(rows) == 20
    assert committer.commits == committer.members == 20


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", [("asyncio", {"use_uvloop": True})])  # as workers run
async def test_blocks_that_take_most_of_the_group_wait_commit_at_once(pg_url: str) -> None:
    """Blocks finishing less than the group wait apart, but each taking most of it: a block that
    starts after one finished could not finish within the wait, so lingering would only delay the
    first member's commit by the whole wait. Each commits alone, at once."""
    wait = 0.03
    # (spacing + block time 25 + about 16 ms against the 30 ms wait: a margin a loaded machine's
    # late sleeps do not eat; at 20 ms apart one block in 30 lingered on a slow 2-core VM)
    committer, waits = await _trickled(pg_url, wait, spacing=0.025, count=30, block=0.015)
    rows, _ = await _rows(pg_url)
    assert len(rows) == 30
    # (lingering: about one commit per two blocks, the first of each waiting 30 ms or more)
    assert committer.commits == committer.members == 30, f"{committer.commits} commits for 30 blocks: some lingered"
    slow = [w for w in waits if w >= wait]
    assert not slow, f"{len(slow)} of 30 blocks waited {max(slow) * 1000:.0f} ms or more for their commit"


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", [("asyncio", {"use_uvloop": True})])  # as workers run
async def test_no_transaction_lingers_while_every_lane_waits_for_a_commit(pg_url: str) -> None:
    """Blocks finishing quickly one after another would make a transaction linger for the next
    ones; but once every handler the process can run (its lanes) is a finished member waiting
    for a commit, none can start: the open transactions commit at once instead of after the wait.
    (When lanes have run out of work, the last members do linger: more work could come.)"""
    await _prepare(pg_url)
    engine = outbox.create_engine(pg_url)
    wait, lanes, runs = 1.0, 8, 12
    committer = group_commit.GroupCommitter(engine, size=64, wait=wait, connections=4, lanes=lanes)
    waits: list[tuple[float, float]] = []  # (seconds the block waited for its commit, when it returned)
    finished: list[float] = []  # when each lane ran out of work

    async def lane(i: int) -> None:  # one lane: its handlers one after another, each with a block
        for k in range(runs):
            async with committer.transaction(_BlockContext(f"m-{i}-{k}")) as conn:  # type: ignore[arg-type]
                await conn.execute(text("INSERT INTO applied (n) VALUES (:n)"), {"n": f"{i}-{k}"})
                ended = time.monotonic()
            returned = time.monotonic()
            waits.append((returned - ended, returned))
        finished.append(time.monotonic())

    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(lanes):
                    tg.start_soon(lane, i)
    finally:
        await committer.aclose()
        await engine.dispose()
    rows, inbox = await _rows(pg_url)
    assert rows == {f"{i}-{k}" for i in range(lanes) for k in range(runs)}
    assert inbox == {f"m-{i}-{k}" for i in range(lanes) for k in range(runs)}
    assert committer.commits < committer.members == lanes * runs  # still grouped
    # lingering would hold every round of the lanes for the whole wait; a commit takes milliseconds.
    # A block may wait for the timer only once a lane has run out of work (fewer lanes than the
    # committer counts can then be members): how many do depends on how far apart the lanes end.
    first_done = min(finished)
    lingered = [w for w, returned in waits if w >= wait / 2 and returned < first_done]
    assert not lingered, f"{len(lingered)} of {len(waits)} blocks waited about {wait:g} s with every lane busy"
