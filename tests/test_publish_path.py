"""The publish path a producer takes (``Client.send``; issue #33): one call at a time goes on the
broker's own connection (no pool, retry or timeout layers of redis-py: about 50 µs of the
producer's CPU per call), overlapping calls go as pipelines from the pool, and a lost connection
is retried once on a fresh one, as the client's own calls are."""

from __future__ import annotations

import anyio
import orjson
import pytest

from framework import Client, Queue
from tests.netproxy import NetProxy

pytestmark = pytest.mark.anyio

JOBS = Queue("publish.path.jobs")


async def _stored(client: Client) -> list[int]:
    """The ``n`` of every command stored in the queue's stream, in stream order."""
    spec = await client.broker.declare(JOBS.spec())
    [view] = await client.broker.subscribe(spec, "audit")
    out: list[int] = []
    while True:
        batch = await client.broker.read(view, "audit", 1000, 0)
        if not batch:
            return out
        out += [orjson.loads(d.envelope.body)["n"] for d in batch if d.envelope is not None]


async def test_sends_one_at_a_time_and_at_once_are_all_stored_in_each_senders_order(
    redis_url: str, namespace: str
) -> None:
    async with Client(redis_url, namespace=namespace) as client:
        await client.broker.declare(JOBS.spec())
        for n in range(100):  # one at a time: the broker's own connection
            await client.send(JOBS, {"n": n})

        async def sender(first: int) -> None:
            for n in range(first, first + 100):
                await client.send(JOBS, {"n": n})

        async with anyio.create_task_group() as tg:  # overlapping: pipelines from the pool as well
            for first in range(1000, 6000, 1000):
                tg.start_soon(sender, first)
        stored = await _stored(client)
    assert sorted(stored) == [*range(100), *(n for f in range(1000, 6000, 1000) for n in range(f, f + 100))]
    assert stored[:100] == list(range(100))
    for first in range(1000, 6000, 1000):  # each sender's commands in the order it sent them
        assert [n for n in stored if first <= n < first + 100] == list(range(first, first + 100))


async def test_a_send_after_the_connection_was_reset_is_stored_once(
    proxy: NetProxy, redis_url: str, namespace: str
) -> None:
    async with Client(proxy.url(redis_url), namespace=namespace) as client:
        await client.broker.declare(JOBS.spec())
        await client.send(JOBS, {"n": 1})
        assert proxy.reset_all() > 0  # every connection, the one the last send used included
        await client.send(JOBS, {"n": 2})  # no error: retried on a fresh connection
        await client.send(JOBS, {"n": 3})
    async with Client(redis_url, namespace=namespace) as direct:
        assert await _stored(direct) == [1, 2, 3]
