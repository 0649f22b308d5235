"""Checks of what introspection reports (stored entries, pending, lag, dead letters), and what it shows is stored."""

from __future__ import annotations

from broker.capabilities import as_introspection
from broker.conformance.features import BrokerFactory, Features
from broker.conformance.registry import check
from broker.conformance.support import Names, command, event, one_broker
from broker.headers import DLQ_REASON
from broker.topology import DestinationSpec

__all__: list[str] = []


@check(requires=("introspection",))
async def check_acked_queue_entries_are_deleted(make: BrokerFactory, features: Features) -> None:
    """A queue stores only what its group has not settled: acked and dead-lettered entries are deleted."""
    names = Names()
    async with one_broker(make) as broker:
        inspect = as_introspection(broker)
        spec = await broker.declare(DestinationSpec(names("billing.refund"), "command"))
        [view] = await broker.subscribe(spec, "billing")
        sent = [command(spec.name, i) for i in range(10)]
        await broker.publish(sent)
        got = await broker.read(view, "a", 10, 10)
        assert await broker.ack(view, got[:8]) == 8
        assert await broker.dead_letter(got[8], {DLQ_REASON: "x"}) is not None
        stored = [e.id for e in await inspect.stored_messages(spec)]
        assert stored == [sent[9].id], f"the queue stores {len(stored)} entries: only the unsettled one expected"


@check(requires=("introspection",))
async def check_introspection_reports_depth_pending_lag_and_dead_letters(
    make: BrokerFactory, features: Features
) -> None:
    """``group_state``, ``describe``, ``dead_letter_count``, ``destination_usage`` and ``stored_messages``
    agree with what was published, delivered, acked and dead-lettered."""
    names = Names()
    async with one_broker(make) as broker:
        inspect = as_introspection(broker)
        topic = await broker.declare(DestinationSpec(names("orders.placed"), "event"))
        [billing] = await broker.subscribe(topic, "billing")
        [shipping] = await broker.subscribe(topic, "shipping")
        sent = [event(topic.name, i) for i in range(5)]
        await broker.publish(sent)
        got = await broker.read(billing, "a", 3, 10)  # 3 delivered: 2 left to deliver
        await broker.ack(billing, got[:1])
        await broker.dead_letter(got[1], {DLQ_REASON: "x"})
        state = await inspect.group_state(billing)
        have = (state.group, state.consumers, state.pending, state.lag, state.delayed, state.dead_letters)
        assert have == ("billing", 1, 1, 2, 0, 1), f"billing's state is {have}, not (billing, 1, 1, 2, 0, 1)"
        assert not state.idle
        fresh = await inspect.group_state(shipping)
        assert (fresh.pending, fresh.lag, fresh.dead_letters) == (0, 5, 0), f"shipping's state is {fresh}"
        assert await inspect.dead_letter_count(billing) == 1
        assert [e.id for e in await inspect.stored_messages(topic)] == [e.id for e in sent], "a topic keeps events"
        [described] = await inspect.describe([topic.name])
        assert described.spec == topic and described.depth == 5, f"described {described.spec}, depth {described.depth}"
        groups = sorted(g.group for p in described.partitions for g in p.groups)
        assert groups == ["billing", "shipping"], f"described groups {groups}"
        usage = await inspect.destination_usage(topic)
        assert (usage.groups, usage.entries, usage.dead) == (["billing", "shipping"], 5, 1), f"usage {usage}"
        await broker.ack(billing, got[2:] + await broker.read(billing, "a", 10, 10))
        assert (await inspect.group_state(billing)).idle, "a group that acked everything is not idle"
