"""At low rates a message's handler starts before the fetcher sends its next read (issue #33).

Sending a read costs the fetcher tens of microseconds of Python; a handler that waited behind it
started that much later (the latency benchmark's publish -> handler start). A small read's
handlers now run first; a full read (a backlog) keeps the read's round trip overlapping them.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from broker.redis.intake import Intake
from broker.redis.reading import Reading
from framework import Client, Service
from framework.runtime import Runtime
from framework.testing import TEST_SETTINGS

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("inbox", [True, False])
async def test_a_small_reads_handler_starts_before_the_next_read_is_sent(
    redis_url: str, namespace: str, inbox: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    for cls, name in ((Intake, "read_leased"), (Reading, "read")):
        original = getattr(cls, name)

        async def counted(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            events.append("read")
            got = await _original(self, *args, **kwargs)
            if got:
                events.append("got")
            return got

        monkeypatch.setattr(cls, name, counted)
    svc = Service("order", inbox=inbox)
    started = anyio.Event()

    @svc.command("order.jobs")
    async def handle(cmd: dict[str, int]) -> None:
        events.append(f"handler {cmd['n']}")
        started.set()

    runtime = Runtime([svc], url=redis_url, namespace=namespace, settings=TEST_SETTINGS)
    async with Client(redis_url, namespace=namespace) as client, anyio.create_task_group() as tg:
        await client.send("order.jobs", {"n": 0}, create=True)  # the queue exists; a first message runs
        await tg.start(runtime.run)
        with anyio.fail_after(10):
            await started.wait()
        started = anyio.Event()
        await client.send("order.jobs", {"n": 1})
        with anyio.fail_after(10):
            await started.wait()
        await anyio.sleep(0.05)
        runtime.stop()
    at = events.index("handler 1")
    got = at - 1 - events[at - 1 :: -1].index("got")  # the read that returned message 1
    assert events[got:at] == ["got"], events  # before the change: ["got", "read"] (the next read first)
