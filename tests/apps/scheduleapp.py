"""Services run as real worker processes by the scheduling tests (tests/test_scheduling.py).

Handlers record what they saw in Redis under the test's namespace, so the test can count scheduled
messages delivered early, late, twice or never, and recurring-job ticks fired twice or missed.
"""

from __future__ import annotations

import os

import redis

from broker import now_ms
from framework import Context, Queue, RetryPolicy, Service
from framework.scheduling import Tick

NS = os.environ.get("FRAMEWORK_NAMESPACE", "fw")
_redis = redis.Redis.from_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))

TARGET = Queue("sched.target", partitions=2)

# No inbox: a scheduled message moved twice would show as two stream entries of one message id.
receiver = Service("receiver", inbox=False)


@receiver.command(TARGET)
def receive(cmd: dict, ctx: Context) -> None:
    """Records, per message, the stream entries it arrived in and when it first arrived."""
    entry = ctx._delivery.entry_id  # a second move would be a second entry; a redelivery is the same one
    pipe = _redis.pipeline()
    pipe.sadd(f"{NS}:test:entries:{cmd['n']}", entry)
    pipe.hsetnx(f"{NS}:test:arrived", cmd["n"], now_ms())
    pipe.hset(f"{NS}:test:due", cmd["n"], cmd["due"])
    pipe.execute()


stager = Service("stager", retry=RetryPolicy(max_attempts=1))


@stager.command("sched.trigger")
def trigger(cmd: dict, ctx: Context) -> None:
    """Stages a delayed command, then fails when asked: a failed run's schedule must never be stored."""
    ctx.send(TARGET, {"n": cmd["n"], "due": now_ms() + 1000}, delay=1.0)
    if cmd.get("fail"):
        raise RuntimeError("failing on purpose")


ticker = Service("ticker")


@ticker.every(1)
async def heartbeat(tick: Tick, ctx: Context) -> None:
    """Counts each tick, exactly once per tick (the count commits with the inbox mark and the ack)."""
    tx = ctx.redis_transaction()
    key = f"{NS}:{ctx.hash_tag}:test:ticks"  # the message's hash tag: Cluster-safe in one script
    tx.hincrby(key, str(int(tick.at.timestamp() * 1000)), 1)
    _redis.hincrby(f"{NS}:test:tick-runs", os.environ.get("CONSUMER_NAME", "?"), 1)
