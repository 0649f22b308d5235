"""Partitions balanced over workers on RabbitMQ by leases kept in the Redis beside it
(``broker/rabbitmq/ownership.py``, ``broker/redis/side_leases.py``): two runtimes share four partition
queues two and two, a key's messages stay in order while partitions move, and when one runtime stops the
other takes its partitions over, losing nothing.

Runs on the local RabbitMQ (skipped when unreachable, failed under CI) and the session's Redis server.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from urllib.parse import quote

import anyio
import attrs
import pytest

from framework import Queue, Runtime, Service
from framework.testing import TEST_SETTINGS, ServiceHarness

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

JOBS = Queue("rown.jobs", partitions=4)


def _owned(runtime: Runtime) -> list[int]:
    ownership = runtime.consumers[0].ownership
    assert ownership is not None, "the runtime does not own partitions on RabbitMQ with the Redis beside it"
    return ownership.owned()


async def test_two_runtimes_share_the_partitions_and_keep_key_order_while_they_move(
    rabbitmq_url: str, redis_url: str
) -> None:
    svc = Service("rown")
    seen: dict[str, list[int]] = defaultdict(list)

    @svc.command(JOBS)
    async def job(cmd: dict[str, int | str]) -> None:
        seen[str(cmd["key"])].append(int(cmd["seq"]))
        await anyio.sleep(0.002)

    url = f"{rabbitmq_url}?inbox={quote(redis_url, safe='')}"
    settings = attrs.evolve(TEST_SETTINGS, lease_ttl=1.5)
    keys = [f"k{i}" for i in range(16)]
    async with ServiceHarness([], url=url, namespace=f"rown-{uuid.uuid4().hex[:8]}") as h:
        a = Runtime([svc], broker=h.broker, settings=attrs.evolve(settings, consumer="a"))
        b = Runtime([svc], broker=h.broker, settings=attrs.evolve(settings, consumer="b"))
        async with anyio.create_task_group() as tg:
            await tg.start(a.run)
            with anyio.fail_after(15):
                while len(_owned(a)) < 4:
                    await anyio.sleep(0.05)
            await h.client.send_many(
                JOBS, [{"key": k, "seq": i} for i in range(20) for k in keys], key=lambda c: c["key"]
            )
            await tg.start(b.run)
            with anyio.fail_after(20):  # b joins: a hands two partitions back, b takes them
                while not (len(_owned(a)) == 2 and len(_owned(b)) == 2):
                    await anyio.sleep(0.05)
            assert sorted(_owned(a) + _owned(b)) == [0, 1, 2, 3]
            await h.client.send_many(
                JOBS, [{"key": k, "seq": i} for i in range(20, 40) for k in keys], key=lambda c: c["key"]
            )
            with anyio.fail_after(30):
                while sum(len(v) for v in seen.values()) < 40 * len(keys):
                    await anyio.sleep(0.05)
            a.stop()  # b takes everything over
            with anyio.fail_after(20):
                while len(_owned(b)) < 4:
                    await anyio.sleep(0.05)
            await h.client.send_many(JOBS, [{"key": k, "seq": 40} for k in keys], key=lambda c: c["key"])
            with anyio.fail_after(30):
                while sum(len(v) for v in seen.values()) < 41 * len(keys):
                    await anyio.sleep(0.05)
            b.stop()
        done = {name: r.stats()["rown.job"]["processed"] for name, r in (("a", a), ("b", b))}
    for key in keys:
        assert seen[key] == list(range(41)), f"key {key}: {seen[key]} (lost, doubled or out of order)"
    assert done["a"] > 0 and done["b"] > 0, f"one runtime did all the work: {done}"


async def test_status_shows_live_workers_on_rabbitmq_from_heartbeats_beside_it(
    rabbitmq_url: str, redis_url: str
) -> None:
    """A running worker is listed live under its group (its heartbeat in the Redis beside RabbitMQ), and
    gone once it stopped: ``framework status --json``'s ``live_workers`` on RabbitMQ as on Redis."""
    from framework.operations.overview import load_overview

    svc = Service("rlive")

    @svc.command("rlive.jobs")
    async def job(cmd: dict[str, int]) -> None: ...

    url = f"{rabbitmq_url}?inbox={quote(redis_url, safe='')}"
    async with ServiceHarness([svc], url=url, namespace=f"rlive-{uuid.uuid4().hex[:8]}") as h:
        runtime = h.runtime
        assert runtime is not None
        with anyio.fail_after(10):
            while True:
                overview = await load_overview(h.broker)
                live = overview.live_for("rlive.jobs", "rlive")
                if live:
                    break
                await anyio.sleep(0.1)
        assert [w.name for w in live] == [runtime.consumer_name], live
        group = next(g for d in overview.destinations_json() if d["name"] == "rlive.jobs" for g in d["groups"])
        assert group["live_workers"] == 1, group
        await h.stop()
        after = await load_overview(h.broker)
        assert after.live_for("rlive.jobs", "rlive") == [], "a stopped worker is still counted live"
