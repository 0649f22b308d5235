"""Batch handlers under process kills (real worker processes, the embedded Valkey)."""

from __future__ import annotations

import signal

import redis

from framework import Queue, SyncClient
from tests.workers import Workers, wait_for

JOBS = Queue("crashy.jobs")


def test_a_message_that_kills_its_batch_every_time_is_dead_lettered_alone(
    workers: Workers, redis_url: str, namespace: str
) -> None:
    """The batch holding it dies twice; then its messages run alone (suspects), so only the culprit
    reaches max_attempts and goes to the DLQ; every other job runs exactly once."""
    r = redis.Redis.from_url(redis_url)
    with SyncClient(redis_url, namespace=namespace) as client:
        crash_id = client.send(JOBS, {"n": "crash"})
        client.send_many(JOBS, [{"n": str(i)} for i in range(20)])
    dlq_key = f"{namespace}:{{crashy.jobs:0}}:g:crashy:dlq"
    exits = []
    for _ in range(6):  # max_attempts is 3: three crashes, then the 4th delivery goes to the DLQ
        w = workers.start("batchapp:crashy", "w", "--visibility-timeout", "30")
        wait_for(lambda w=w: w.poll() is not None or r.xlen(dlq_key) > 0, 60, "crash or DLQ")
        if w.poll() is None:
            wait_for(lambda: r.hlen(f"{namespace}:test:done") == 20, 60, "the other jobs")
            w.send_signal(signal.SIGTERM)
            assert w.wait(timeout=30) == 0
            break
        exits.append(w.returncode)
    assert exits == [17, 17, 17]
    assert {k.decode(): int(v) for k, v in r.hgetall(f"{namespace}:test:done").items()} == {
        str(i): 1 for i in range(20)
    }
    [(_, fields)] = r.xrange(dlq_key)
    assert fields[b"id"].decode() == crash_id
    assert b"delivered 3 times (max_attempts 3) without completing" in fields[b"dlq-reason"]
    assert sum(g["pending"] for g in r.xinfo_groups(f"{namespace}:{{crashy.jobs:0}}")) == 0
