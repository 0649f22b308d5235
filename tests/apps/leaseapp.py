"""Services run as real worker processes by the lease tests (tests/test_leases.py).

Each run is recorded in Redis under the test's namespace: ``runs`` counts runs per job,
``running`` holds the jobs running right now, and ``overlaps`` counts runs that started while
another run of the same job was still going. A job with ``"slow": true`` sleeps ``SLOW_SLEEP``
seconds (longer than the visibility timeout the test gives the workers); the others
``FAST_SLEEP`` seconds.
"""

from __future__ import annotations

import os
import time

import redis

from framework import Queue, Service

NS = os.environ.get("FRAMEWORK_NAMESPACE", "fw")
_redis = redis.Redis.from_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
SLOW = float(os.environ.get("SLOW_SLEEP", "5"))
FAST = float(os.environ.get("FAST_SLEEP", "0"))


def _record(job: dict) -> None:
    n = str(job["n"])
    _redis.hincrby(f"{NS}:test:runs", n, 1)
    if not _redis.sadd(f"{NS}:test:running", n):
        _redis.hincrby(f"{NS}:test:overlaps", n, 1)
    try:
        time.sleep(SLOW if job.get("slow") else FAST)
    finally:
        _redis.srem(f"{NS}:test:running", n)
    _redis.hincrby(f"{NS}:test:done", n, 1)


lease = Service("lease")  # the inbox is on (the default)


@lease.command(Queue("lease.jobs"))
def job(cmd: dict) -> None:
    """A job recorded per run; with the inbox on."""
    _record(cmd)


bare = Service("bare", inbox=False)


@bare.command(Queue("bare.jobs"))
def bare_job(cmd: dict) -> None:
    """The same job with the inbox off: nothing but the leases keeps a run from repeating."""
    _record(cmd)
