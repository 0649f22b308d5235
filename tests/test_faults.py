"""Fault tests: real worker processes killed with SIGKILL/SIGTERM; count what was lost and duplicated."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import redis

from framework import Queue, SyncClient, Topic
from tests.workers import Workers, wait_for

pytestmark = [pytest.mark.fault, pytest.mark.slow]

JOBS = Queue("jobs", partitions=2)  # as declared by tests/apps/faultapp.py
LEDGER = Topic("ledger", partitions=2)


def test_sigkill_mid_batch_loses_nothing_and_another_worker_takes_over(
    workers: Workers, redis_url: str, namespace: str
) -> None:
    r = redis.Redis.from_url(redis_url)
    total = 3000
    with SyncClient(redis_url, namespace=namespace) as client:
        client.send_many(JOBS, [{"n": str(i)} for i in range(total)], key=lambda c: c["n"])
    opts = ("--visibility-timeout", "2", "--prefetch", "50", "--concurrency", "8")
    a = workers.start("faultapp:worker", "a", *opts, JOB_SLEEP="0.002")
    wait_for(lambda: r.hlen(f"{namespace}:test:done") > 300, 60, "worker a to process some jobs")
    b = workers.start("faultapp:worker", "b", *opts, JOB_SLEEP="0.002")
    time.sleep(0.3)
    a.send_signal(signal.SIGKILL)  # mid-batch: a holds fetched, unacked entries
    a.wait()
    wait_for(lambda: r.hlen(f"{namespace}:test:done") == total, 120, "every job to be processed")
    counts = [int(v) for v in r.hvals(f"{namespace}:test:done")]
    lost = total - len(counts)
    duplicated = sum(c - 1 for c in counts)
    assert lost == 0
    # without an inbox, only entries a had fetched and finished but not acked may run twice
    assert duplicated <= 2 * 50 * 2, duplicated
    # b took a's entries over: claimed past the visibility timeout, or (queues with partitions>1 are owned
    # by one worker at a time, docs/partition-ownership.md) taken over with a's partition once a's lease lapsed
    log_b = workers.log("b")
    assert "claimed entries idle past the visibility timeout" in log_b or "took over pending entries" in log_b
    b.send_signal(signal.SIGTERM)
    assert b.wait(timeout=30) == 0
    pending = sum(g["pending"] for p in (0, 1) for g in r.xinfo_groups(f"{namespace}:{{jobs:{p}}}"))
    assert pending == 0


def test_sigterm_finishes_in_flight_work_acks_it_and_exits_zero(
    workers: Workers, redis_url: str, namespace: str
) -> None:
    r = redis.Redis.from_url(redis_url)
    with SyncClient(redis_url, namespace=namespace) as client:
        client.send_many(JOBS, [{"n": str(i)} for i in range(400)])
    w = workers.start("faultapp:worker", "w", "--prefetch", "20", "--concurrency", "4", JOB_SLEEP="0.02")
    wait_for(lambda: r.hlen(f"{namespace}:test:done") > 20, 60, "some jobs to be processed")
    w.send_signal(signal.SIGTERM)
    assert w.wait(timeout=30) == 0
    done = {k.decode(): int(v) for k, v in r.hgetall(f"{namespace}:test:done").items()}
    assert set(done.values()) == {1}
    pending = sum(g["pending"] for p in (0, 1) for g in r.xinfo_groups(f"{namespace}:{{jobs:{p}}}"))
    assert pending == 0  # everything processed was acked before exit
    remaining = sum(r.xlen(f"{namespace}:{{jobs:{p}}}") for p in (0, 1))
    assert remaining == 400 - len(done)  # and nothing unprocessed was acked
    assert "runtime stopped" in workers.log("w")


def test_order_per_key_holds_across_a_worker_restart(workers: Workers, redis_url: str, namespace: str) -> None:
    r = redis.Redis.from_url(redis_url)
    events = [{"seq": i} for i in range(100)]
    with SyncClient(redis_url, namespace=namespace) as client:
        for account in ("x", "y", "z"):
            with client.batch() as batch:
                for e in events:
                    batch.publish(LEDGER, e, key=account)
    w = workers.start("faultapp:auditor", "w", "--concurrency", "16", "--prefetch", "5", JOB_SLEEP="0.01")
    wait_for(lambda: r.llen(f"{namespace}:test:order:x") > 30, 60, "some events")
    w.send_signal(signal.SIGTERM)
    assert w.wait(timeout=30) == 0
    assert r.llen(f"{namespace}:test:order:x") < 100
    w2 = workers.start("faultapp:auditor", "w", "--concurrency", "16", JOB_SLEEP="0.01")
    wait_for(lambda: all(r.llen(f"{namespace}:test:order:{k}") == 100 for k in "xyz"), 60, "all events")
    for k in "xyz":
        assert [int(v) for v in r.lrange(f"{namespace}:test:order:{k}", 0, -1)] == list(range(100))
    w2.send_signal(signal.SIGTERM)
    assert w2.wait(timeout=30) == 0


def test_missing_broker_says_how_to_start_one(worker_env: dict[str, str]) -> None:
    env = {**worker_env, "REDIS_URL": "redis://127.0.0.1:9/0"}
    proc = subprocess.run(
        [sys.executable, "-m", "framework", "run", "faultapp:worker"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "cannot reach the broker at redis://127.0.0.1:9/0" in proc.stderr
    assert "redis-server" in proc.stderr and "framework server start" in proc.stderr
    assert "Traceback" not in proc.stderr
    _ = os.environ


def test_a_message_that_crashes_its_process_every_time_ends_in_the_dlq(
    workers: Workers, redis_url: str, namespace: str
) -> None:
    r = redis.Redis.from_url(redis_url)
    with SyncClient(redis_url, namespace=namespace) as client:
        crash_id = client.send(JOBS, {"n": "crash"})
        client.send_many(JOBS, [{"n": str(i)} for i in range(20)])
    dlq_keys = [f"{namespace}:{{jobs:{p}}}:g:worker:dlq" for p in (0, 1)]
    exits = []
    for _ in range(6):  # max_attempts is 3: three crashes, then the 4th delivery goes to the DLQ
        w = workers.start("faultapp:worker", "w", "--visibility-timeout", "30")
        wait_for(lambda w=w: w.poll() is not None or sum(r.xlen(k) for k in dlq_keys) > 0, 60, "crash or DLQ")
        if w.poll() is None:
            wait_for(lambda: r.hlen(f"{namespace}:test:done") == 20, 60, "the other jobs")
            w.send_signal(signal.SIGTERM)
            assert w.wait(timeout=30) == 0
            break
        exits.append(w.returncode)
    assert exits == [17, 17, 17]
    assert int(r.hget(f"{namespace}:test:crashes", "crash")) == 3
    dead = [e for k in dlq_keys for e in r.xrange(k)]
    assert len(dead) == 1, [(f[b"id"], f[b"dlq-reason"]) for _, f in dead]
    [(_, fields)] = dead
    assert fields[b"id"].decode() == crash_id
    assert b"delivered 3 times (max_attempts 3) without completing" in fields[b"dlq-reason"]
    assert sum(g["pending"] for p in (0, 1) for g in r.xinfo_groups(f"{namespace}:{{jobs:{p}}}")) == 0


def test_sigkill_during_dead_lettering_leaves_exactly_one_dlq_entry_per_message(
    workers: Workers, redis_url: str, namespace: str
) -> None:
    r = redis.Redis.from_url(redis_url)
    total = 60
    with SyncClient(redis_url, namespace=namespace) as client:
        client.send_many("poison.jobs", [{"n": i} for i in range(total)])
    stream, dlq = f"{namespace}:{{poison.jobs:0}}", f"{namespace}:{{poison.jobs:0}}:g:poison:dlq"
    for delay in (0.25, 0.35, 0.45, 0.55, 0.65):  # kill at different points of the DLQ moves
        w = workers.start(
            "faultapp:poison",
            "w",
            "--concurrency",
            "1",
            "--prefetch",
            "5",
            "--visibility-timeout",
            "30",
            JOB_SLEEP="0.004",
        )
        wait_for(lambda w=w: r.exists(dlq) or w.poll() is not None, 30, "the first dead letter")
        time.sleep(delay / 5)
        w.send_signal(signal.SIGKILL)
        w.wait()
    w = workers.start("faultapp:poison", "w", "--visibility-timeout", "30")
    wait_for(lambda: r.xlen(dlq) >= total and r.xlen(stream) == 0, 60, "every message dead-lettered")
    w.send_signal(signal.SIGTERM)
    assert w.wait(timeout=30) == 0
    ids = [fields[b"id"] for _, fields in r.xrange(dlq)]
    assert len(ids) == total and len(set(ids)) == total  # none lost, none doubled
    assert r.xinfo_groups(stream)[0]["pending"] == 0


def test_exactly_once_redis_effects_under_repeated_worker_kills(
    workers: Workers, redis_url: str, namespace: str
) -> None:
    r = redis.Redis.from_url(redis_url)
    total = 3000
    queue = Queue("wallet.credit", partitions=2)
    with SyncClient(redis_url, namespace=namespace) as client:
        client.send_many(queue, [{"n": str(i), "account": f"acct-{i % 7}", "amount": 1} for i in range(total)])
    opts = ("--visibility-timeout", "1", "--prefetch", "100", "--concurrency", "16")
    applied = lambda: r.hlen(f"{namespace}:test:applied")  # noqa: E731
    kills = 0
    for round_ in range(4):
        a = workers.start("faultapp:wallet", f"a{round_}", *opts, JOB_SLEEP="0.001")
        b = workers.start("faultapp:wallet", f"b{round_}", *opts, JOB_SLEEP="0.001")
        start = applied()
        wait_for(lambda start=start: applied() > start + 200 or applied() == total, 60, "progress")
        for p in (a, b):
            p.send_signal(signal.SIGKILL)
            p.wait()
            kills += 1
    last = workers.start("faultapp:wallet", "z", *opts, JOB_SLEEP="0")
    wait_for(
        lambda: applied() == total and sum(r.xlen(f"{namespace}:{{wallet.credit:{p}}}") for p in (0, 1)) == 0,
        120,
        "every credit",
    )
    last.send_signal(signal.SIGTERM)
    assert last.wait(timeout=30) == 0
    counts = [int(v) for v in r.hvals(f"{namespace}:test:applied")]
    assert len(counts) == total and set(counts) == {1}, "a credit was lost or applied twice"
    balances = {k.decode(): int(v) for k, v in r.hgetall(f"{namespace}:test:balance").items()}
    assert sum(balances.values()) == total
    assert kills == 8


def test_finished_messages_are_acked_at_once_so_a_kill_reruns_none_of_them(
    workers: Workers, redis_url: str, namespace: str
) -> None:
    r = redis.Redis.from_url(redis_url)
    total = 16
    with SyncClient(redis_url, namespace=namespace) as client:
        client.send_many(JOBS, [{"n": str(i)} for i in range(total)], key=lambda c: c["n"])
    # one lane, one fetched batch per partition: every message of a partition runs in one sub-batch
    opts = ("--concurrency", "1", "--prefetch", "20", "--visibility-timeout", "2")
    w = workers.start("faultapp:worker", "w", *opts, JOB_SLEEP="0.25")
    wait_for(lambda: r.hlen(f"{namespace}:test:done") >= 4, 30, "a few jobs to finish")
    w.send_signal(signal.SIGKILL)  # mid sub-batch: the finished ones must already be acknowledged
    w.wait()
    again = workers.start("faultapp:worker", "w", *opts, JOB_SLEEP="0.01")
    wait_for(lambda: r.hlen(f"{namespace}:test:done") == total, 60, "every job")
    counts = {k.decode(): int(v) for k, v in r.hgetall(f"{namespace}:test:done").items()}
    duplicated = sum(c - 1 for c in counts.values())
    assert len(counts) == total
    assert duplicated <= 1, counts  # at most a kill between a handler's end and its ack (milliseconds)
    again.send_signal(signal.SIGTERM)
    assert again.wait(timeout=30) == 0
    assert not r.exists(f"{namespace}:{{jobs:0}}:g:worker:dlq", f"{namespace}:{{jobs:1}}:g:worker:dlq")


def test_sigterm_keeps_its_bound_with_a_stuck_sync_handler_and_does_not_hand_its_message_over(
    workers: Workers, redis_url: str, namespace: str
) -> None:
    r = redis.Redis.from_url(redis_url)
    with SyncClient(redis_url, namespace=namespace) as client:
        client.send(JOBS, {"n": "slow"}, key="k")
    stream = f"{namespace}:{{jobs:{JOBS.spec().partition_for('k', '')}}}"
    opts = ("--shutdown-timeout", "1", "--visibility-timeout", "60")
    w = workers.start("faultapp:worker", "w", *opts, JOB_SLEEP="30")

    def running() -> bool:
        try:
            return bool(r.xpending(stream, "worker")["pending"] == 1)
        except redis.ResponseError:  # the worker has not created its group yet
            return False

    wait_for(running, 30, "the job to be running")
    time.sleep(0.3)
    started = time.monotonic()
    w.send_signal(signal.SIGTERM)
    assert w.wait(timeout=20) == 0
    assert time.monotonic() - started < 6  # the 30 s thread was abandoned, not waited for
    assert "abandoned" in workers.log("w")
    [entry] = r.xpending_range(stream, "worker", "-", "+", 10)
    assert entry["time_since_delivered"] < 60_000  # still pending (not lost) and not handed over at once
    assert not r.hlen(f"{namespace}:test:done")
