"""The runtime rides out a broker restart: actors restart with backoff, scripts reload, nothing is lost."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import anyio
import pytest

from broker.redis import EmbeddedServer
from framework import Client, Context, Runtime, Service
from framework.testing import TEST_SETTINGS

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


async def test_a_running_worker_recovers_when_the_server_restarts() -> None:
    data = Path(tempfile.mkdtemp(prefix="framework-recovery-"))
    server = EmbeddedServer(data)
    seen: set[int] = set()
    svc = Service("s")

    @svc.command("q")
    async def h(cmd: dict, ctx: Context) -> None:
        seen.add(cmd["n"])
        ctx.publish("done", {"n": cmd["n"]})

    try:
        url = server.ensure_running()
        runtime = Runtime([svc], url=url, namespace="recovery", settings=TEST_SETTINGS)
        async with anyio.create_task_group() as tg:
            await tg.start(runtime.run)
            async with Client(url, namespace="recovery") as client:
                await client.send_many("q", [{"n": i} for i in range(100)])
            await runtime.wait_idle(timeout=20)
            assert server.stop()  # the AOF is written; the worker loses every connection
            await anyio.sleep(1.5)  # its actors fail and back off meanwhile
            assert server.ensure_running() == url  # same data, same port
            async with Client(url, namespace="recovery") as client:
                await client.send_many("q", [{"n": i} for i in range(100, 200)])
            await runtime.wait_idle(timeout=30)  # the same worker picked up again
            runtime.stop()
        assert seen == set(range(200))
    finally:
        server.stop()
        shutil.rmtree(data, ignore_errors=True)
