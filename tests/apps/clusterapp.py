"""A service run as real worker processes on a Redis Cluster by ``tests/test_cluster.py``.

Its effects are written with ``ctx.redis_transaction()`` under the message's hash tag, so they
commit on the partition's node together with the inbox mark and the ack; the test counts them.
"""

from __future__ import annotations

import os

from framework import Context, Queue, RetryPolicy, Service

NS = os.environ.get("FRAMEWORK_NAMESPACE", "fw")

jobs = Service("cljobs", retry=RetryPolicy(max_attempts=3, immediate=1, backoff=0.05))


@jobs.command(Queue("cl.jobs", partitions=8))
async def job(cmd: dict, ctx: Context) -> None:
    """Applies each job once; the job named 'poison' fails every attempt (dead-lettered after 3)."""
    if cmd["n"] == "poison":
        raise RuntimeError("poisoned job")
    tx = ctx.redis_transaction()
    tx.hincrby(f"{NS}:test:{ctx.hash_tag}:applied", str(cmd["n"]), 1)


moves = Service("clmoves")


@moves.command(Queue("cl.moves", partitions=8))
async def move(cmd: dict, ctx: Context) -> None:
    """Applies each job once (its partitions' slots are resharded while it runs)."""
    tx = ctx.redis_transaction()
    tx.hincrby(f"{NS}:test:{ctx.hash_tag}:applied", str(cmd["n"]), 1)
