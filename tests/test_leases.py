"""Leases of running messages: entries a worker holds are never claimed while their handlers run.

Broker level: ``extend`` resets the idle time of every held entry and tells settled entries from
taken ones. End to end: real worker processes with handlers that outlast the visibility timeout
several times; every run is counted in Redis (see tests/apps/leaseapp.py).
"""

from __future__ import annotations

import time

import anyio
import orjson
import pytest
import redis

from broker import DestinationSpec, Envelope
from broker.redis import RedisBroker
from framework import Context, RetryPolicy, Service, SyncClient
from framework.testing import ServiceHarness
from tests.workers import Workers, wait_for

VISIBILITY = "1.5"  # seconds; the slow handlers run SLOW_SLEEP = 5 s, over three times as long
TAKEN = "entries were claimed by another consumer while held here"


def command(queue: str, n: int) -> Envelope:
    return Envelope(destination=queue, kind="command", type="C", body=orjson.dumps({"n": n}))


async def idle_times(broker: RedisBroker, stream: str, group: str) -> list[int]:
    rows = await broker.redis.execute_command("XPENDING", stream, group, "-", "+", 100_000)
    return [int(row[2]) for row in rows]  # id, consumer, idle ms, delivery count


# -- broker level ---------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_extend_resets_the_idle_time_of_every_held_entry(broker: RedisBroker) -> None:
    spec = await broker.declare(DestinationSpec("lease.held", "command"))
    [view] = await broker.subscribe(spec, "g")
    await broker.publish([command("lease.held", i) for i in range(5)])
    held = await broker.read(view, "a", 10, 10)
    assert len(held) == 5
    await anyio.sleep(1.0)
    found = await broker.extend(view, "a", held)
    assert found == {d.entry_id for d in held} and found.taken == set()
    idle = await idle_times(broker, view.stream, "g")
    assert len(idle) == 5 and max(idle) < 500, idle  # before the fix: [1, 1003, 1003, 1003, 1003]
    assert await broker.claim_idle(view, "b", 800, 10) == []


@pytest.mark.anyio
async def test_extend_tells_settled_entries_from_taken_ones(broker: RedisBroker) -> None:
    spec = await broker.declare(DestinationSpec("lease.held", "command"))
    [view] = await broker.subscribe(spec, "g")
    await broker.publish([command("lease.held", i) for i in range(3)])
    acked, taken, kept = await broker.read(view, "a", 10, 10)
    await broker.ack(view, [acked])  # settled meanwhile (an ack in flight): not a take-over
    await broker.redis.xclaim(view.stream, "g", "b", 0, [taken.entry_id], justid=True)
    found = await broker.extend(view, "a", [acked, taken, kept])
    assert found == {kept.entry_id}
    assert found.taken == {taken.entry_id}


@pytest.mark.anyio
async def test_inbox_leases_of_every_held_entry_are_extended(broker: RedisBroker) -> None:
    spec = await broker.declare(DestinationSpec("lease.held", "command"))
    [view] = await broker.subscribe(spec, "g")
    await broker.publish([command("lease.held", i) for i in range(4)])
    held = await broker.read(view, "a", 10, 10)
    assert await broker.inbox_claim(view, held, 1000) == [0, 0, 0, 0]
    await broker.extend(view, "a", held, lease_ms=60_000)
    scores = await broker.redis.zmscore(view.keys.inbox, [d.message_id for d in held])
    assert all(s is not None and -s > time.time() * 1000 + 50_000 for s in scores), scores


@pytest.mark.anyio
async def test_scripts_take_batches_beyond_luas_unpack_limit(broker: RedisBroker) -> None:
    """Lua's unpack() fails beyond about 8000 values; a fetch (2 x prefetch) or a hold may be larger."""
    total = 9000
    spec = await broker.declare(DestinationSpec("lease.big", "command"))
    [view] = await broker.subscribe(spec, "g")
    for i in range(0, total, 1000):
        await broker.publish([command("lease.big", n) for n in range(i, i + 1000)])
    held = await broker.read(view, "a", total, 10)
    assert len(held) == total
    assert set(await broker.inbox_claim(view, held, 60_000)) == {0}  # 2 x 9000 ZADD arguments
    assert await broker.redis.zcard(view.keys.inbox) == total
    await anyio.sleep(1.0)
    args = ["g", "a", 1, total, *(d.entry_id for d in held), *(d.message_id for d in held)]
    reply = await broker.scripts["extend"](broker.redis, [view.stream, view.keys.inbox], args)  # one call, all
    assert set(reply) == {0}
    idle = await idle_times(broker, view.stream, "g")
    assert len(idle) == total and max(idle) < 700, max(idle)  # all touched, in one call


# -- end to end with worker processes --------------------------------------------------------------


def runs(r: redis.Redis, namespace: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in r.hgetall(f"{namespace}:test:runs").items()}


@pytest.mark.slow
@pytest.mark.parametrize(("target", "queue"), [("leaseapp:lease", "lease.jobs"), ("leaseapp:bare", "bare.jobs")])
def test_handlers_outlasting_the_visibility_timeout_run_once_across_two_workers(
    workers: Workers, redis_url: str, namespace: str, target: str, queue: str
) -> None:
    """Two workers share a queue of fast jobs with slow ones among them (each over three visibility
    timeouts long, some queued behind another in a lane): no job may run twice, overlap, or be lost."""
    r = redis.Redis.from_url(redis_url)
    fast, slow = 2000, 12
    jobs = [{"n": i, "slow": i % (fast // slow) == 7} for i in range(fast + slow)]
    with SyncClient(redis_url, namespace=namespace) as client:
        client.send_many(queue, jobs)
    opts = ("--visibility-timeout", VISIBILITY, "--concurrency", "8", "--prefetch", "50")
    a = workers.start(target, "a", *opts, SLOW_SLEEP="5")
    b = workers.start(target, "b", *opts, SLOW_SLEEP="5")
    done, running = f"{namespace}:test:done", f"{namespace}:test:running"
    try:
        wait_for(lambda: r.hlen(done) == len(jobs) and r.scard(running) == 0, 40, "every job")
    except AssertionError as exc:
        state = f"done {r.hlen(done)} of {len(jobs)}, running {sorted(r.smembers(running))}"
        raise AssertionError(f"{exc}: {state}\n{workers.log('a')[-3000:]}\n{workers.log('b')[-3000:]}") from None
    time.sleep(2 * float(VISIBILITY))  # a late second run would start within a claim interval or two
    counts = runs(r, namespace)
    twice = sorted(int(n) for n, c in counts.items() if c > 1)
    overlapped = sorted(int(n) for n in r.hkeys(f"{namespace}:test:overlaps"))
    assert len(counts) == len(jobs), "lost jobs"
    assert twice == [], f"ran twice: {twice} (slow ones: {[j['n'] for j in jobs if j['slow']]})"
    assert overlapped == []
    for name, proc in (("a", a), ("b", b)):
        proc.terminate()
        assert proc.wait(timeout=30) == 0
        assert TAKEN not in workers.log(name)
        assert "claimed entries idle past the visibility timeout" not in workers.log(name)
    assert sum(g["pending"] for g in r.xinfo_groups(f"{namespace}:{{{queue}:0}}")) == 0


@pytest.mark.slow
def test_a_single_consumer_never_reports_its_own_acks_as_take_overs(
    workers: Workers, redis_url: str, namespace: str
) -> None:
    """Acks in flight while entries are extended are settled entries, not entries claimed away."""
    r = redis.Redis.from_url(redis_url)
    total = 1500
    with SyncClient(redis_url, namespace=namespace) as client:
        client.send_many("lease.jobs", [{"n": i} for i in range(total)])
    w = workers.start(
        "leaseapp:lease", "solo", "--visibility-timeout", "0.6", "--concurrency", "16", "--prefetch", "100",
        FAST_SLEEP="0.05",
    )  # fmt: skip
    wait_for(lambda: r.hlen(f"{namespace}:test:done") == total, 40, "every job")  # about 5 s, 25 extend rounds
    w.terminate()
    assert w.wait(timeout=30) == 0
    log = workers.log("solo")
    assert TAKEN not in log, [line for line in log.splitlines() if TAKEN in line][:3]
    assert set(runs(r, namespace).values()) == {1}


# -- Lua argument limits in handler effects -------------------------------------------------------


@pytest.mark.anyio
async def test_an_oversized_redis_command_in_a_transaction_applies_nothing(redis_url: str, namespace: str) -> None:
    """A command past Lua's unpack() limit used to stop commit_effects.lua after the commands before
    it were applied, leaving the message pending: every retry applied them again."""
    svc = Service("tags", retry=RetryPolicy(max_attempts=3, immediate=2, backoff=0.05))
    counter, tags = f"{namespace}:counter", f"{namespace}:tags"

    @svc.command("tags.add")
    async def add(cmd: dict, ctx: Context) -> None:
        tx = ctx.redis_transaction()
        tx.incr(counter)
        tx.sadd(tags, *range(cmd["count"]))

    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as h:
        await h.client.send("tags.add", {"count": 9000})
        await h.run_until_idle()
        assert await h.broker.redis.get(counter) is None  # applied by none of the attempts
        view = h.broker.group_partition(await h.broker.get_destination("tags.add"), 0, "tags")
        [(_, fields)] = await h.broker.dead_letter_entries(view)
        assert b"Redis command 2 of 2 (SADD) has 9002 arguments" in fields[b"dlq-error-message"], fields
        assert (await h.broker.stream_groups(view.stream))[0]["pending"] == 0
