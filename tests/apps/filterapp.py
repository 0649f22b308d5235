"""Service run as real worker processes by tests/test_patterns_and_filters.py: two handlers split one
topic by type, each with its own retry policy. A ``Crash`` event kills its process every time."""

from __future__ import annotations

import os

import redis

from framework import Context, Filter, RetryPolicy, Service

NS = os.environ.get("FRAMEWORK_NAMESPACE", "fw")
_redis = redis.Redis.from_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))

worker = Service("filtered", retry=RetryPolicy(max_attempts=6, immediate=0, backoff=0.05))


@worker.event("filtered.events", filter=Filter(type="Normal"))
def normal(event: dict, ctx: Context) -> None:
    _redis.rpush(f"{NS}:test:normal", event["n"])


@worker.event("filtered.events", filter=Filter(type="Crash"), retry=RetryPolicy(max_attempts=3, immediate=0))
def crashy(event: dict, ctx: Context) -> None:
    _redis.hincrby(f"{NS}:test:crashes", "crash", 1)
    os._exit(17)
