"""Checks of group reads and acks: one consumer per entry, pending entries re-read and claimed, leases, channels."""

from __future__ import annotations

import anyio

from broker.conformance.features import BrokerFactory, Features
from broker.conformance.registry import check
from broker.conformance.support import Names, close_channel, command, numbers, one_broker
from broker.protocol import Delivery
from broker.topology import DestinationSpec

__all__: list[str] = []


@check()
async def check_queue_entry_goes_to_one_consumer_until_acked(make: BrokerFactory, features: Features) -> None:
    """Each queue entry is delivered to one consumer of the group; once acked it is not delivered again."""
    names = Names()
    async with one_broker(make) as broker:
        queue = names("billing.refund")
        spec = await broker.declare(DestinationSpec(queue, "command"))
        [view] = await broker.subscribe(spec, "billing")
        await broker.publish([command(queue, i) for i in range(10)])
        a = await broker.read(view, "a", 6, 10)
        b = await broker.read(view, "b", 6, 10)
        assert sorted(numbers(a) + numbers(b)) == list(range(10)), f"a read {numbers(a)}, b {numbers(b)}"
        assert not set(numbers(a)) & set(numbers(b)), f"a and b both got {set(numbers(a)) & set(numbers(b))}"
        assert await broker.ack(view, a + b) == 10, "ack counts the entries still pending"
        assert await broker.ack(view, a) == 0, "acking again acknowledges nothing"
        for consumer in ("a", "b"):
            assert await broker.read_own_pending(view, consumer, 10) == [], f"acked entries pending for {consumer}"
        assert await broker.read(view, "c", 10, 10) == [], "acked entries are delivered again"
        assert await broker.claim_idle(view, "c", 0, 10) == [], "acked entries can be claimed"


@check()
async def check_concurrent_reads_deliver_each_entry_once(make: BrokerFactory, features: Features) -> None:
    """Consumers reading one group from concurrent tasks never get the same entry."""
    names = Names()
    async with one_broker(make) as broker:
        spec = await broker.declare(DestinationSpec(names("billing.refund"), "command"))
        [view] = await broker.subscribe(spec, "billing")
        await broker.publish([command(spec.name, i) for i in range(100)])
        got: list[int] = []

        async def consume(consumer: str) -> None:
            while batch := await broker.read(view, consumer, 7, 10):
                got.extend(numbers(batch))

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(consume, f"c{i}")
        assert sorted(got) == list(range(100)), f"{len(got)} deliveries of 100 entries ({len(set(got))} distinct)"


@check()
async def check_unacked_entries_are_reread_by_their_consumer_and_claimed_by_others(
    make: BrokerFactory, features: Features
) -> None:
    """Unacked entries are re-read by their own consumer and, once idle long enough, claimed by another
    (delivery count raised each time)."""
    names = Names()
    async with one_broker(make) as broker:
        spec = await broker.declare(DestinationSpec(names("billing.refund"), "command"))
        [view] = await broker.subscribe(spec, "billing")
        await broker.publish([command(spec.name, i) for i in range(3)])
        first = await broker.read(view, "a", 10, 10)
        assert len(first) == 3
        again = await broker.read_own_pending(view, "a", 10)
        counts = {d.delivery_count for d in again}
        assert numbers(again) == [0, 1, 2] and counts == {2}, f"re-read {numbers(again)} with counts {counts}"
        assert await broker.claim_idle(view, "b", 60_000, 10) == [], "entries claimed before idle long enough"
        await anyio.sleep(0.05)
        claimed = await broker.claim_idle(view, "b", 20, 10)
        counts = {d.delivery_count for d in claimed}
        assert numbers(claimed) == [0, 1, 2] and counts == {3}, f"claimed {numbers(claimed)} with counts {counts}"
        assert claimed[0].attempt == 3, f"a third delivery is attempt {claimed[0].attempt}, not 3"
        assert await broker.read_own_pending(view, "a", 10) == [], "claimed entries are still a's"
        assert numbers(await broker.read_own_pending(view, "b", 10)) == [0, 1, 2], "claimed entries are not b's"


@check()
async def check_read_own_pending_resumes_after_the_given_entries(make: BrokerFactory, features: Features) -> None:
    """``read_own_pending`` with ``after`` delivers only the consumer's entries after those ids."""
    names = Names()
    async with one_broker(make) as broker:
        spec = await broker.declare(DestinationSpec(names("billing.refund"), "command"))
        [view] = await broker.subscribe(spec, "billing")
        await broker.publish([command(spec.name, i) for i in range(5)])
        held = await broker.read(view, "a", 10, 10)
        page = await broker.read_own_pending(view, "a", 2)
        assert numbers(page) == [0, 1], f"the first page is {numbers(page)}"
        rest = await broker.read_own_pending(view, "a", 10, after={page[-1].stream: page[-1].entry_id})
        assert numbers(rest) == [2, 3, 4], f"after entry 1: {numbers(rest)}"
        assert [d.entry_id for d in page + rest] == [d.entry_id for d in held], "entry ids changed on re-reading"


@check()
async def check_extend_keeps_entries_from_being_claimed(make: BrokerFactory, features: Features) -> None:
    """``extend`` resets the idle time of entries the consumer still owns; once claimed away they are
    reported ``taken``, not owned."""
    names = Names()
    async with one_broker(make) as broker:
        spec = await broker.declare(DestinationSpec(names("billing.refund"), "command"))
        [view] = await broker.subscribe(spec, "billing")
        await broker.publish([command(spec.name, 1)])
        held = await broker.read(view, "a", 10, 10)
        await anyio.sleep(0.06)
        found = await broker.extend(view, "a", held)
        assert set(found) == {held[0].entry_id} and not found.taken, f"extend found {set(found)}, taken {found.taken}"
        assert await broker.claim_idle(view, "b", 50, 10) == [], "an extended entry was claimed"
        await anyio.sleep(0.06)
        assert len(await broker.claim_idle(view, "b", 50, 10)) == 1, "an idle entry was not claimed"
        lost = await broker.extend(view, "a", held)
        assert not lost and lost.taken == {held[0].entry_id}, f"after the claim: {set(lost)}, {lost.taken}"


@check()
async def check_departed_consumers_with_nothing_pending_are_pruned(make: BrokerFactory, features: Features) -> None:
    """``prune_consumers`` forgets idle consumers holding nothing, never ``keep`` nor one with pending entries."""
    names = Names()
    async with one_broker(make) as broker:
        spec = DestinationSpec(names("prune.q"), "command")
        [view] = await broker.subscribe(spec, "g")
        await broker.publish([command(spec.name, i) for i in range(3)])
        [held] = await broker.read(view, "holder", 1, 0)  # keeps one entry pending
        for name in ("gone", "me"):  # each reads one and acks it; "gone" then dies
            await broker.ack(view, await broker.read(view, name, 1, 0))
        await anyio.sleep(0.05)
        assert await broker.prune_consumers(view, 10_000) == 0, "consumers pruned before idle long enough"
        assert await broker.prune_consumers(view, 10, keep="me") >= 1, "the departed consumer was not pruned"
        # what is left: "me" (kept, holds nothing: pruned now) and the holder (pending: never pruned)
        assert await broker.prune_consumers(view, 10) >= 1, "the kept consumer was pruned with the departed one"
        assert await broker.prune_consumers(view, 10) == 0, "prune_consumers pruned a consumer holding an entry"
        assert [d.entry_id for d in await broker.read_own_pending(view, "holder", 10)] == [held.entry_id]


@check()
async def check_released_entries_are_claimable_at_once(make: BrokerFactory, features: Features) -> None:
    """``release_own_pending`` makes a consumer's entries (except ``keep``) claimable at once, still pending."""
    names = Names()
    async with one_broker(make) as broker:
        spec = await broker.declare(DestinationSpec(names("billing.refund"), "command"))
        [view] = await broker.subscribe(spec, "billing")
        await broker.publish([command(spec.name, i) for i in range(4)])
        held = await broker.read(view, "a", 10, 10)
        running = held[0].entry_id
        released = await broker.release_own_pending(view, "a", 60_000, keep=[running])
        assert released == 3, f"released {released} of the 3 entries not kept"
        claimed = await broker.claim_idle(view, "b", 60_000, 10)
        assert numbers(claimed) == [1, 2, 3], f"claimed {numbers(claimed)}: the released 1..3 expected"
        assert [d.entry_id for d in await broker.read_own_pending(view, "a", 10)] == [running], "keep was released"


@check(requires=("blocking_reads",))
async def check_a_blocking_read_wakes_for_a_new_entry(make: BrokerFactory, features: Features) -> None:
    """A read waiting up to ``block_ms`` returns an entry published meanwhile, and empty when none comes."""
    names = Names()
    async with one_broker(make) as broker:
        spec = await broker.declare(DestinationSpec(names("billing.refund"), "command"))
        [view] = await broker.subscribe(spec, "billing")

        async def publish_later() -> None:
            await anyio.sleep(0.2)
            await broker.publish([command(spec.name, 1)])

        woken: list[Delivery] = []
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(publish_later)
                woken = await broker.read(view, "a", 10, 2000)
        assert numbers(woken) == [1], f"a blocking read returned {numbers(woken)}, not the entry published meanwhile"
        with anyio.fail_after(5):
            assert await broker.read(view, "a", 10, 100) == [], "a read with nothing new returned entries"


@check()
async def check_a_channel_serves_one_tasks_reads_and_acks(make: BrokerFactory, features: Features) -> None:
    """A channel (or None: the shared pool) passed to read and ack serves them like the broker itself."""
    names = Names()
    async with one_broker(make) as broker:
        spec = await broker.declare(DestinationSpec(names("billing.refund"), "command"))
        [view] = await broker.subscribe(spec, "billing")
        await broker.publish([command(spec.name, i) for i in range(3)])
        channel = broker.channel()
        try:
            got = await broker.read(view, "a", 10, 10, channel=channel)
            assert numbers(got) == [0, 1, 2], f"read {numbers(got)} on a channel"
            assert await broker.ack(view, got, channel=channel) == 3, "ack on a channel"
            assert await broker.read(view, "a", 10, 10, channel=channel) == []
        finally:
            await close_channel(channel)
