"""A pricing service run as a real worker process by the request/reply fault tests.

Each run of its handler is counted in Redis under the test's namespace. ``JOB_SLEEP`` makes the
handler slow (so a test can kill its worker mid-request); ``DIE_AFTER_REPLY=1`` kills the
process with SIGKILL right after a reply is stored and before the request is acknowledged.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence

import anyio
import redis

import framework.runtime.settle as settle
from broker import Broker, Envelope
from framework import Context, Service

NS = os.environ.get("FRAMEWORK_NAMESPACE", "fw")
_redis = redis.Redis.from_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
SLEEP = float(os.environ.get("JOB_SLEEP", "0"))

pricing = Service("pricing")


@pricing.command("pricing.quote")
async def quote(q: dict, ctx: Context) -> dict:
    """Counts its runs; answers with the price."""
    _redis.hincrby(f"{NS}:test:runs", q["sku"], 1)
    _redis.set(f"{NS}:test:started", "1")
    await anyio.sleep(SLEEP)
    return {"sku": q["sku"], "cents": 250 * int(q["qty"])}


if os.environ.get("DIE_AFTER_REPLY") == "1":
    _send = settle.send_replies

    async def _send_then_die(broker: Broker, replies: Sequence[Envelope]) -> int:
        stored = await _send(broker, replies)
        os.kill(os.getpid(), signal.SIGKILL)  # the reply is out; the ack never goes
        return stored

    settle.send_replies = _send_then_die
