"""Checks of dead-letter administration: listing, redriving and purging dead letters; unsubscribe; delete."""

from __future__ import annotations

from broker.capabilities import as_dead_letter_admin
from broker.conformance.features import BrokerFactory, Features
from broker.conformance.registry import check
from broker.conformance.support import Names, command, event, numbers, one_broker, raises
from broker.envelope import now_ms
from broker.errors import ConfigurationError
from broker.headers import DLQ_REASON
from broker.topology import DestinationSpec

__all__: list[str] = []


@check(requires=("dead_letter_admin",))
async def check_a_dead_letter_keeps_the_message_and_the_reason(make: BrokerFactory, features: Features) -> None:
    """A dead letter is listed once with the message's fields and the reason; its queue entry is gone."""
    names = Names()
    async with one_broker(make) as broker:
        admin = as_dead_letter_admin(broker)
        spec = await broker.declare(DestinationSpec(names("billing.refund"), "command"))
        [view] = await broker.subscribe(spec, "billing")
        await broker.publish([command(spec.name, 7)])
        [d] = await broker.read(view, "a", 10, 10)
        assert d.envelope is not None
        dlq_id = await broker.dead_letter(d, {DLQ_REASON: "boom"})
        assert await broker.dead_letter(d, {DLQ_REASON: "boom"}) is None
        letters = await admin.dead_letter_entries(view)
        assert [i for i, _ in letters] == [dlq_id], f"dead letters {[i for i, _ in letters]}, written {dlq_id}"
        fields = letters[0][1]
        assert fields[b"dlq-reason"] == b"boom", f"the reason is {fields.get(b'dlq-reason')!r}"
        assert fields[b"id"] == d.envelope.id.encode(), "the dead letter lost the message id"
        assert fields[b"body"] == d.envelope.body, "the dead letter lost the body"
        await admin.unsubscribe(spec, "billing")  # a new group reads what the queue still stores
        [probe] = await broker.subscribe(spec, "probe")
        assert await broker.read(probe, "p", 10, 10) == [], "a dead-lettered queue entry is still stored"


@check(requires=("dead_letter_admin",))
async def check_dead_letters_are_listed_oldest_first(make: BrokerFactory, features: Features) -> None:
    """``dead_letter_entries`` lists a group's dead letters oldest first, at most ``count`` of them."""
    names = Names()
    async with one_broker(make) as broker:
        admin = as_dead_letter_admin(broker)
        spec = await broker.declare(DestinationSpec(names("billing.refund"), "command"))
        [view] = await broker.subscribe(spec, "billing")
        await broker.publish([command(spec.name, i) for i in range(3)])
        written = [await broker.dead_letter(d, {DLQ_REASON: "x"}) for d in await broker.read(view, "a", 10, 10)]
        assert [i for i, _ in await admin.dead_letter_entries(view)] == written, "not listed oldest first"
        assert [i for i, _ in await admin.dead_letter_entries(view, 2)] == written[:2], "count is not honoured"


@check(requires=("dead_letter_admin",))
async def check_a_redriven_dead_letter_goes_to_its_group_only_as_a_first_attempt(
    make: BrokerFactory, features: Features
) -> None:
    """``redrive`` moves a dead letter back to its own group only, as attempt 1; a second redrive finds it gone."""
    names = Names()
    async with one_broker(make) as broker:
        admin = as_dead_letter_admin(broker)
        topic = names("orders.placed")
        spec = await broker.declare(DestinationSpec(topic, "event"))
        [billing] = await broker.subscribe(spec, "billing")
        [shipping] = await broker.subscribe(spec, "shipping")
        await broker.publish([event(topic, 1)])
        assert numbers(await broker.read(shipping, "s", 10, 10)) == [1]
        [d] = await broker.read(billing, "a", 10, 10)
        assert await broker.retry_later(d, now_ms())
        assert await broker.move_due(billing, now_ms() + 1) == (1 if features.parked_retries else 0)
        [retried] = await broker.read(billing, "a", 10, 10)
        assert retried.attempt == 2
        dlq_id = await broker.dead_letter(retried, {DLQ_REASON: "boom"})
        assert dlq_id is not None
        assert await admin.redrive(billing, dlq_id) is not None, "redrive found no dead letter"
        assert await admin.dead_letter_entries(billing) == [], "a redriven dead letter is still listed"
        [again] = await broker.read(billing, "a", 10, 10)
        assert again.envelope is not None and d.envelope is not None
        assert again.envelope.id == d.envelope.id, "redrive delivered another message"
        assert again.attempt == 1, f"a redriven message is attempt {again.attempt}, not a first attempt"
        assert await broker.read(shipping, "s", 10, 10) == [], "a redrive reached another group"
        assert await admin.redrive(billing, dlq_id) is None, "a dead letter was redriven twice"


@check(requires=("dead_letter_admin",))
async def check_purged_dead_letters_are_gone(make: BrokerFactory, features: Features) -> None:
    """``purge_dead_letters`` deletes dead letters and counts those that existed."""
    names = Names()
    async with one_broker(make) as broker:
        admin = as_dead_letter_admin(broker)
        spec = await broker.declare(DestinationSpec(names("billing.refund"), "command"))
        [view] = await broker.subscribe(spec, "billing")
        await broker.publish([command(spec.name, i) for i in range(3)])
        ids = [await broker.dead_letter(d, {DLQ_REASON: "x"}) for d in await broker.read(view, "a", 10, 10)]
        first, second, third = (i for i in ids if i is not None)
        assert await admin.purge_dead_letters(view, [first, second]) == 2, "purge counts what existed"
        assert await admin.purge_dead_letters(view, [first]) == 0, "a purged dead letter was counted again"
        assert await admin.purge_dead_letters(view, []) == 0
        assert [i for i, _ in await admin.dead_letter_entries(view)] == [third], "purge deleted the wrong letters"


@check(requires=("dead_letter_admin",))
async def check_unsubscribe_and_delete_destination(make: BrokerFactory, features: Features) -> None:
    """``unsubscribe`` removes a group; ``delete_destination`` refuses while a group or an entry is left,
    unless forced, and then the destination is gone."""
    names = Names()
    async with one_broker(make) as broker:
        admin = as_dead_letter_admin(broker)
        topic = names("orders.placed")
        spec = await broker.declare(DestinationSpec(topic, "event", partitions=2))
        await broker.subscribe(spec, "billing")
        await broker.subscribe(spec, "shipping")
        await admin.unsubscribe(spec, "shipping")
        subs = [s for s in await broker.list_subscriptions() if s[0] == topic]
        assert subs == [(topic, "billing")], f"after unsubscribing shipping: {subs}"
        with raises(ConfigurationError, doing="deleting a destination a group subscribes to"):
            await admin.delete_destination(spec)
        await admin.unsubscribe(spec, "billing")
        await broker.publish([event(topic, 1)])
        if features.retention:  # without retention the event reached nobody: nothing is stored
            with raises(ConfigurationError, doing="deleting a destination storing an entry"):
                await admin.delete_destination(spec)
        assert await broker.get_destination(topic) == spec, "a refused delete removed the destination"
        await admin.delete_destination(spec, force=True)
        assert await broker.get_destination(topic) is None, "a deleted destination is still declared"
        assert topic not in [s.name for s in await broker.list_destinations()], "a deleted destination is listed"
        empty = await broker.declare(DestinationSpec(names("empty.q"), "command"))
        await admin.delete_destination(empty)  # nothing subscribed or stored: no force needed
        assert await broker.get_destination(empty.name) is None
