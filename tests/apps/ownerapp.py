"""A service run as real worker processes by the ordered workload (tests/ordered_workload.py).

``owner.seq`` has 8 partitions; each message carries a key ``k`` and that key's sequence number
``s``. The handler applies ``s`` (as ``s@pid#attempt:ms``, ms = Unix ms mod 100,000, for reading a
failure's logs) to the key's list through its Redis effects
(committed atomically with the inbox mark and the ack, under the partition's fencing token), so the
list shows the order effects were applied in. While it runs it holds a per-key marker ("pid:ms the
handler was entered", SET NX, expiring after ``MARKER_MS``); finding another instance's marker
records an overlap, with both runs' pid and entry time: a key run by two instances at once.
``ctx.partition`` -> "pid:unix ms" of the last application shows which process runs a partition.
The lists and the "last" hashes carry the message's hash tag (:func:`applied_key`, :func:`last_key`),
so the app also runs on a Redis Cluster.
"""

from __future__ import annotations

import os
import time

import anyio

from framework import Context, Queue, Service

NS = os.environ.get("FRAMEWORK_NAMESPACE", "fw")
PID = str(os.getpid())
SLEEP = float(os.environ.get("OWNER_SLEEP", "0"))
MARKER_MS = int(os.environ.get("MARKER_MS", "800"))

owner = Service("owner")  # the inbox is on (the default): Redis effects are exactly once

SEQ = Queue("owner.seq", partitions=8)


def applied_key(namespace: str, tag: str, k: str) -> str:
    """The list of key ``k``'s applied sequence numbers (``tag``: its partition's hash tag)."""
    return f"{namespace}:{tag}:t:applied:{k}"


def last_key(namespace: str, tag: str) -> str:
    """Hash: partition -> "pid:unix ms" of its last application (one per partition: its hash tag)."""
    return f"{namespace}:{tag}:t:last"


@owner.command(SEQ, key=lambda m: m["k"])
async def apply(msg: dict, ctx: Context) -> None:
    """Apply one (key, seq), checking no other instance runs the key meanwhile."""
    k, s = msg["k"], msg["s"]
    me = f"{PID}:{int(time.time() * 1000)}"  # who runs it, and when the handler was entered
    marker = f"{NS}:t:running:{k}"
    if not await ctx.redis.set(marker, me, nx=True, px=MARKER_MS):
        held = await ctx.redis.get(marker)
        if held is not None and held.decode().split(":")[0] != PID:
            at = int(time.time() * 1000)
            await ctx.redis.rpush(f"{NS}:t:overlaps", f"{k}:{s}:p{ctx.partition}:{me}:{held.decode()}:{at}")
    try:
        if SLEEP:
            await anyio.sleep(SLEEP)
        tx = ctx.redis_transaction()
        applied = f"{s}@{PID}#{ctx.attempt}:{int(time.time() * 1000) % 100_000}"
        tx.rpush(applied_key(NS, ctx.hash_tag, k), applied)
        tx.hset(last_key(NS, ctx.hash_tag), str(ctx.partition), f"{PID}:{int(time.time() * 1000)}")
    finally:
        if await ctx.redis.get(marker) == me.encode():
            await ctx.redis.delete(marker)
