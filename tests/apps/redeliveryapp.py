"""Service run as real worker processes by tests/test_redelivery.py.

Sync handler (threads, bounded by ``--concurrency``). Each run records in Redis under the test's
namespace when it finished, so the test can tell what waited for what. Environment: ``JOB_SLEEP``
(seconds per ordinary job), ``SLOW_SLEEP`` (seconds for the job named "slow").
"""

from __future__ import annotations

import os
import time

import redis

from framework import Context, Queue, RetryPolicy, Service

NS = os.environ.get("FRAMEWORK_NAMESPACE", "fw")
_redis = redis.Redis.from_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
JOB_SLEEP = float(os.environ.get("JOB_SLEEP", "0.01"))
SLOW_SLEEP = float(os.environ.get("SLOW_SLEEP", "8"))

JOBS = Queue("redelivery.jobs")
worker = Service("redelivery", retry=RetryPolicy(max_attempts=3, immediate=0, backoff=0.05))


@worker.command(JOBS)
def job(cmd: dict, ctx: Context) -> None:
    """'crash' kills its process every time; 'slow' takes SLOW_SLEEP; others JOB_SLEEP. Records each run."""
    n = cmd["n"]
    if n == "crash":
        _redis.hincrby(f"{NS}:test:crashes", "crash", 1)
        os._exit(17)
    time.sleep(SLOW_SLEEP if n == "slow" else JOB_SLEEP)
    pipe = _redis.pipeline()
    pipe.hincrby(f"{NS}:test:done", n, 1)
    pipe.hsetnx(f"{NS}:test:finished", n, repr(time.time()))
    if ctx.key is not None:
        pipe.rpush(f"{NS}:test:order:{ctx.key}", n)
    pipe.execute()
