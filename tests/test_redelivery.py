"""Redelivered messages and keyless work: nothing waits for a slow handler it does not depend on.

Process-level tests kill real workers (tests/apps/redeliveryapp.py) and time what happens next;
in-process tests set up suspects and slow keyless handlers directly.
"""

from __future__ import annotations

import signal
import time

import anyio
import attrs
import pytest
import redis

from broker.redis import RedisBroker
from framework import Client, Queue, RetryPolicy, Service, SyncClient
from framework.testing import TEST_SETTINGS, ServiceHarness
from tests.workers import Workers, wait_for

JOBS = Queue("redelivery.jobs")  # as declared by tests/apps/redeliveryapp.py
APP = "redeliveryapp:worker"


def _finished(r: redis.Redis, namespace: str) -> dict[str, float]:
    return {k.decode(): float(v) for k, v in r.hgetall(f"{namespace}:test:finished").items()}


def _pending(r: redis.Redis, namespace: str) -> int:
    return sum(g["pending"] for g in r.xinfo_groups(f"{namespace}:{{redelivery.jobs:0}}"))


def _kill_holding(workers: Workers, r: redis.Redis, namespace: str, count: int, *opts: str) -> None:
    """Start worker a with handlers that hang, SIGKILL it once it holds ``count`` entries."""
    a = workers.start(APP, "a", *opts, JOB_SLEEP="60", SLOW_SLEEP="60")
    wait_for(lambda: _pending(r, namespace) == count, 30, f"worker a to hold all {count} entries")
    time.sleep(0.3)  # its handlers have started
    a.send_signal(signal.SIGKILL)
    a.wait()


@pytest.mark.slow
@pytest.mark.fault
def test_after_a_kill_another_worker_runs_the_reclaimed_messages_without_waiting_for_a_slow_one(
    workers: Workers, redis_url: str, namespace: str
) -> None:
    r = redis.Redis.from_url(redis_url)
    fast = [str(i) for i in range(40)]
    with SyncClient(redis_url, namespace=namespace) as client:
        client.send(JOBS, {"n": "slow"})  # first: claimed (and, one at a time, run) first
        client.send_many(JOBS, [{"n": n} for n in fast], key=lambda c: c["n"])
    opts = ("--concurrency", "8", "--visibility-timeout", "2")
    _kill_holding(workers, r, namespace, 41, *opts)
    workers.start(APP, "b", *opts, JOB_SLEEP="0.05", SLOW_SLEEP="8")
    wait_for(lambda: set(fast) <= _finished(r, namespace).keys(), 40, "the fast jobs")
    done = _finished(r, namespace)
    assert "slow" not in done  # every fast one finished while the slow one still ran
    spread = max(done[n] for n in fast) - min(done[n] for n in fast)
    assert spread < 3.0, spread  # concurrently: 40 x 0.05 s over 8 lanes, not one at a time
    wait_for(lambda: "slow" in _finished(r, namespace) and _pending(r, namespace) == 0, 30, "the slow job")
    assert all(int(v) == 1 for v in r.hvals(f"{namespace}:test:done"))


@pytest.mark.slow
@pytest.mark.fault
def test_a_restarted_worker_re_reads_its_own_pending_entries_concurrently(
    workers: Workers, redis_url: str, namespace: str
) -> None:
    r = redis.Redis.from_url(redis_url)
    names = [str(i) for i in range(40)]
    with SyncClient(redis_url, namespace=namespace) as client:
        client.send_many(JOBS, [{"n": n} for n in names])
    opts = ("--concurrency", "8", "--visibility-timeout", "30")
    _kill_holding(workers, r, namespace, 40, *opts)
    workers.start(APP, "a", *opts, JOB_SLEEP="0.3")  # same consumer: re-reads its own pending first
    wait_for(lambda: len(_finished(r, namespace)) == 40, 40, "the re-read jobs")
    done = _finished(r, namespace)
    spread = max(done.values()) - min(done.values())
    assert spread < 5.0, spread  # 40 x 0.3 s = 12 s one at a time; ~1.5 s over 8 lanes
    assert "re-reading own pending entries" in workers.log("a")
    wait_for(lambda: _pending(r, namespace) == 0, 10, "every entry acknowledged")


@pytest.mark.slow
@pytest.mark.fault
def test_a_crash_loop_message_is_dead_lettered_after_max_attempts_and_no_bystander_is(
    workers: Workers, redis_url: str, namespace: str
) -> None:
    r = redis.Redis.from_url(redis_url)
    followers = [f"k{i}" for i in range(5)]  # same key as the crashing message: they must wait for it
    others = [str(i) for i in range(20)]
    with SyncClient(redis_url, namespace=namespace) as client:
        crash_id = client.send(JOBS, {"n": "crash"}, key="hot")
        for n in followers:
            client.send(JOBS, {"n": n}, key="hot")
        client.send_many(JOBS, [{"n": n} for n in others])
    dlq = f"{namespace}:{{redelivery.jobs:0}}:g:redelivery:dlq"
    exits = []
    for _ in range(6):  # max_attempts is 3: three crashes, then the 4th delivery goes to the DLQ
        w = workers.start(APP, "w", "--concurrency", "8", "--visibility-timeout", "30", JOB_SLEEP="0.05")
        wait_for(lambda w=w: w.poll() is not None or r.xlen(dlq) > 0, 60, "crash or DLQ")
        if w.poll() is None:
            wait_for(lambda: len(_finished(r, namespace)) == 25, 60, "the other jobs")
            w.send_signal(signal.SIGTERM)
            assert w.wait(timeout=30) == 0
            break
        exits.append(w.returncode)
    assert exits == [17, 17, 17]
    assert int(r.hget(f"{namespace}:test:crashes", "crash")) == 3
    dead = r.xrange(dlq)
    assert [f[b"id"].decode() for _, f in dead] == [crash_id]  # no bystander
    assert b"delivered 3 times (max_attempts 3) without completing" in dead[0][1][b"dlq-reason"]
    order = [v.decode() for v in r.lrange(f"{namespace}:test:order:hot", 0, -1)]
    assert list(dict.fromkeys(order)) == followers  # per-key order kept through the isolation
    assert _pending(r, namespace) == 0


@pytest.mark.anyio
async def test_keyless_messages_do_not_wait_behind_a_slow_handler_in_their_lane(redis_url: str, namespace: str) -> None:
    finished: dict[str, float] = {}
    svc = Service("keyless")

    @svc.command("keyless.jobs")
    async def job(cmd: dict) -> None:
        await anyio.sleep(3.0 if cmd["n"] == "slow" else 0.02)
        finished[cmd["n"]] = time.monotonic()

    settings = attrs.evolve(TEST_SETTINGS, concurrency=4)
    async with ServiceHarness([svc], url=redis_url, namespace=namespace, settings=settings) as h:
        await h.client.send_many("keyless.jobs", [{"n": "slow"}] + [{"n": str(i)} for i in range(40)])
        started = time.monotonic()
        await h.run_until_idle(timeout=30)
    fast = [finished[str(i)] - started for i in range(40)]
    slow = finished["slow"] - started
    assert slow >= 2.9
    # Before: keyless work was dealt round-robin to lanes up front, so ~10 of them waited ~3 s
    # behind the slow one. Now any free lane takes them: 40 x 20 ms over 3 free lanes.
    assert max(fast) < 1.5, sorted(fast)[-5:]


@pytest.mark.anyio
async def test_a_suspect_waiting_for_isolation_holds_no_lane(
    redis_url: str, namespace: str, broker: RedisBroker
) -> None:
    """Suspects run one at a time, but while a slow one runs, other work is not held up behind them."""
    finished: dict[str, float] = {}
    svc = Service("isolation", retry=RetryPolicy(max_attempts=5))

    @svc.command("isolation.jobs")
    async def job(cmd: dict) -> None:
        await anyio.sleep(3.0 if cmd["n"] == "slow" else 0.02)
        finished[cmd["n"]] = time.monotonic()

    settings = attrs.evolve(TEST_SETTINGS, concurrency=4, consumer="w", visibility_timeout=30.0)
    suspects = ["slow"] + [f"s{i}" for i in range(8)]
    ids = await Client(broker=broker).send_many("isolation.jobs", [{"n": n} for n in suspects], key=lambda c: c["n"])
    [view] = await broker.subscribe(svc.handlers[0].spec, "isolation", "earliest")
    held = await broker.read(view, "w", 100, 100)  # as a worker that then died
    assert len(held) == len(suspects)
    # each had a redelivered run that never completed: suspects on their next delivery
    await broker.redis.hset(view.keys.attempts, mapping={i: 1 for i in ids})
    async with ServiceHarness([svc], url=redis_url, namespace=namespace, settings=settings) as h:
        await anyio.sleep(0.5)  # the slow suspect is running isolated; the others wait for isolation
        sent = time.monotonic()
        await h.client.send_many("isolation.jobs", [{"n": f"f{i}"} for i in range(20)], key=lambda c: c["n"])
        with anyio.fail_after(20):
            while not all(f"f{i}" in finished for i in range(20)):
                await anyio.sleep(0.02)
        assert "slow" not in finished  # fresh work ran while the slow suspect was still running
        assert max(finished[f"f{i}"] for i in range(20)) - sent < 1.5
        await h.run_until_idle(timeout=30)
        order = sorted(suspects, key=lambda n: finished[n])
        assert order[0] == "slow"  # one suspect at a time: the others ran after it
        assert min(finished[n] for n in suspects[1:]) >= finished["slow"]
