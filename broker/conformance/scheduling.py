"""Checks of scheduled messages (stored until due, moved once, cancelled) and recurring jobs' ticks."""

from __future__ import annotations

import anyio
import orjson

from broker.capabilities import as_scheduler
from broker.conformance.features import BrokerFactory, Features
from broker.conformance.registry import check
from broker.conformance.support import Brokers, Names, command, numbers, read_all
from broker.envelope import Envelope, now_ms
from broker.headers import DELIVER_AT, IDEMPOTENCY_KEY
from broker.protocol import Broker
from broker.topology import DestinationSpec

__all__: list[str] = []


def _at(env: Envelope, due_ms: int) -> Envelope:
    env.headers[DELIVER_AT] = str(due_ms)
    return env


@check(requires=("scheduling",))
async def check_a_scheduled_message_waits_is_moved_once_and_can_be_cancelled(
    make: BrokerFactory, features: Features
) -> None:
    """A message due later is stored, listed and counted, not delivered; movers racing past its due time
    deliver it once, under its id; a cancelled one never is; a past due time delivers at once."""
    names = Names()
    async with Brokers(make) as brokers:
        broker = await brokers()
        sched = as_scheduler(broker)
        target = names("sched.target")
        views = await broker.subscribe(DestinationSpec(target, "command", partitions=2), "g")
        now = now_ms()
        first = _at(command(target, 1, key="a"), now + 30_000)
        second = _at(command(target, 2, key="b"), now + 40_000)
        assert None not in await broker.publish([first, second]), "a scheduled message was not stored"
        assert await read_all(broker, views, "c") == [], "a scheduled message was delivered before it was due"
        listed = await sched.scheduled_messages(destination=target)
        assert [m.message_id for m in listed] == [first.id, second.id], "scheduled messages, earliest first"
        m = listed[0]
        assert (m.destination, m.due_ms, m.envelope is not None and m.envelope.key) == (target, now + 30_000, "a")
        assert m.partition == DestinationSpec(target, "command", partitions=2).partition_for("a", first.id)
        assert [x.message_id for x in await sched.scheduled_messages(message_ids=[second.id])] == [second.id]
        assert await sched.count_scheduled(target) == 2
        await sched.move_scheduled(now_ms(), sweep=True)
        assert await read_all(broker, views, "c") == [], "a message moved before it was due"

        movers: list[Broker] = [await brokers() for _ in range(3)] if features.shared_state else [broker] * 3
        moved: list[int] = []

        async def move(b: Broker) -> None:
            moved.append((await as_scheduler(b).move_scheduled(now + 31_000, sweep=True)).moved)

        async with anyio.create_task_group() as tg:
            for b in movers:
                tg.start_soon(move, b)
        assert sum(moved) >= 1, f"movers racing past the due time moved {moved}"
        delivered = await read_all(broker, views, "c")
        assert [d.message_id for d in delivered] == [first.id], "a due message is delivered once, under its id"

        assert await sched.cancel_scheduled([second.id], destination=target) == 1, "cancel found nothing"
        assert await sched.cancel_scheduled([second.id]) == 0, "a cancelled message was cancelled again"
        await sched.move_scheduled(now_ms() + 3_600_000, sweep=True)
        assert await read_all(broker, views, "c") == [], "a cancelled message was delivered"
        assert await sched.scheduled_messages(destination=target) == []
        assert await sched.count_scheduled(target) == 0

        assert await broker.publish([_at(command(target, 3), now_ms() - 3_600_000)]) != [None]
        assert numbers(await read_all(broker, views, "c")) == [3], "a past due time is not delivered at once"
        once = [_at(command(target, 4), now_ms() + 30_000) for _ in range(2)]
        for env in once:
            env.headers[IDEMPOTENCY_KEY] = "once"
        assert (await broker.publish(once[:1]))[0] is not None
        assert await broker.publish(once[1:]) == [None], "a repeated idempotency key was scheduled twice"
        assert await sched.count_scheduled(target) == 1
        assert await sched.cancel_scheduled([once[0].id]) == 1  # leave nothing behind in the namespace


@check(requires=("scheduling",))
async def check_concurrent_movers_deliver_each_scheduled_message_once(make: BrokerFactory, features: Features) -> None:
    """Tasks moving due scheduled messages at once deliver each exactly once."""
    names = Names()
    async with Brokers(make) as brokers:
        broker = await brokers()
        target = names("sched.many")
        views = await broker.subscribe(DestinationSpec(target, "command", partitions=3), "g")
        due = now_ms() + 200
        await broker.publish([_at(command(target, i, key=f"k{i}"), due) for i in range(60)])
        assert await as_scheduler(broker).count_scheduled(target) == 60
        while now_ms() <= due:
            await anyio.sleep(0.05)
        movers = [await brokers() for _ in range(3)] if features.shared_state else [broker] * 3

        async def move(b: Broker) -> None:
            while (await as_scheduler(b).move_scheduled(now_ms(), limit=7)).more:
                pass

        async with anyio.create_task_group() as tg:
            for b in movers:
                tg.start_soon(move, b)
        await as_scheduler(broker).move_scheduled(now_ms(), sweep=True)
        got = numbers(await read_all(broker, views, "c"))
        assert sorted(got) == list(range(60)), f"{len(got)} deliveries of 60 scheduled messages"
        assert await as_scheduler(broker).count_scheduled(target) == 0


@check(requires=("scheduling",))
async def check_a_tick_fires_once_and_missed_ticks_collapse_into_one(make: BrokerFactory, features: Features) -> None:
    """``fire_tick``: the first tick seen is the baseline (-1), a later one fires once (1, then 0), an
    older one never (0), and after downtime only the latest fires."""
    names = Names()
    async with Brokers(make) as brokers:
        broker = await brokers()
        sched = as_scheduler(broker)
        queue = names("s.job.j")
        [view] = await broker.subscribe(DestinationSpec(queue, "command"), "g")
        ticks: dict[int, Envelope] = {}

        def tick(ms: int) -> Envelope:
            if ms not in ticks:
                ticks[ms] = Envelope(destination=queue, kind="command", type="tick", body=orjson.dumps({"n": ms}))
            return ticks[ms]

        t = now_ms() // 1000 * 1000
        assert await sched.fire_tick(queue, t, tick(t)) == -1, "the first tick seen is recorded, not fired"
        assert await sched.fire_tick(queue, t + 1000, tick(t + 1000)) == 1, "the next tick fires"
        assert await sched.fire_tick(queue, t + 1000, tick(t + 1000)) == 0, "a tick fired twice"
        assert await sched.fire_tick(queue, t, tick(t)) == 0, "an older tick fired"
        assert await sched.fire_tick(queue, t + 60_000, tick(t + 60_000)) == 1, "the tick after downtime"
        fired = await broker.read(view, "c", 10, 10)
        want = [tick(t + 1000).id, tick(t + 60_000).id]
        assert [d.message_id for d in fired] == want, "missed ticks are fired once, as the latest"
