"""Copies of one message id fetched together are settled as soon as the first copy's run is, and counted.

A real runtime on the session's embedded Valkey, the default 60 s visibility timeout: copies left
pending would wait a minute; settled at once, they are acknowledged within about a second.
"""

from __future__ import annotations

import time

import anyio
import attrs
import pytest
import redis
import structlog.testing

from broker import new_id
from framework import Client, Context, Runtime, Service
from framework.testing import TEST_SETTINGS

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("handler_seconds", [0.0, 0.3])
async def test_copies_fetched_together_are_acked_at_once_and_counted(
    redis_url: str, namespace: str, handler_seconds: float
) -> None:
    runs: list[str] = []
    svc = Service("copies")

    @svc.command("copies.jobs")
    async def handle(cmd: dict, ctx: Context) -> None:
        runs.append(ctx.message_id)
        await anyio.sleep(handler_seconds)

    message_id, other = new_id(), new_id()
    async with Client(redis_url, namespace=namespace) as client:  # all stored before the worker reads
        for _ in range(4):
            await client.send("copies.jobs", {"n": 1}, message_id=message_id, create=True)
        await client.send("copies.jobs", {"n": 2}, message_id=other)
    settings = attrs.evolve(TEST_SETTINGS, visibility_timeout=60.0)
    runtime = Runtime([svc], url=redis_url, namespace=namespace, settings=settings)
    r = redis.Redis.from_url(redis_url)
    stream = f"{namespace}:{{copies.jobs:0}}"
    try:
        with structlog.testing.capture_logs() as logs:
            async with anyio.create_task_group() as tg:
                await tg.start(runtime.run)
                started = time.monotonic()
                deadline = started + 10
                while time.monotonic() < deadline:
                    groups = r.xinfo_groups(stream)
                    if groups and groups[0]["pending"] == 0 and groups[0]["entries-read"] == 5:
                        break
                    await anyio.sleep(0.02)
                settled_in = time.monotonic() - started
                stats = runtime.consumers[0].stats
                duplicates = stats.duplicates
                runtime.stop()
        assert sorted(runs) == sorted([message_id, other])  # the message ran once
        assert settled_in < 2.0 + handler_seconds, f"copies settled after {settled_in:.1f} s"
        assert duplicates == 3 and stats.processed == 2
        [summary] = [e for e in logs if e["event"] == "runtime stopped"]
        assert summary["duplicates"] == 3 and summary["processed"] == 2
    finally:
        r.close()
