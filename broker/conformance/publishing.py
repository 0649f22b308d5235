"""Checks of publishing: order, partitions by key, every group of a topic, idempotency keys, limits."""

from __future__ import annotations

import anyio

from broker.conformance.features import BrokerFactory, Features
from broker.conformance.registry import check
from broker.conformance.support import Names, command, event, numbers, one_broker, raises, read_all
from broker.envelope import Envelope, now_ms
from broker.errors import MessageTooLarge
from broker.headers import IDEMPOTENCY_KEY
from broker.topology import DestinationSpec

__all__: list[str] = []


@check()
async def check_publish_then_read_in_order_with_envelope_intact(make: BrokerFactory, features: Features) -> None:
    """Envelopes of one key are read in the order published, with id, key, type, headers and time intact."""
    names = Names()
    async with one_broker(make) as broker:
        topic = names("orders.placed")
        spec = await broker.declare(DestinationSpec(topic, "event"))
        [view] = await broker.subscribe(spec, "billing")
        sent = [event(topic, i, key="k") for i in range(5)]
        sent[0].headers["traceparent"] = "00-abc-def-01"
        ids = await broker.publish(sent)
        assert all(ids), f"publish returned {ids}: an entry id per stored envelope"
        got = await broker.read(view, "c1", 10, 100)
        assert numbers(got) == [0, 1, 2, 3, 4], f"read {numbers(got)}, published 0..4 in order"
        first = got[0].envelope
        assert first is not None
        have = (first.id, first.key, first.type, first.headers, first.published_at)
        want = (sent[0].id, "k", "T", {"traceparent": "00-abc-def-01"}, sent[0].published_at)
        assert have == want, f"the envelope read back is {have}, published {want}"
        assert got[0].delivery_count == 1 and got[0].attempt == 1, "a first delivery counts 1 and is attempt 1"


@check()
async def check_each_group_of_a_topic_gets_every_event(make: BrokerFactory, features: Features) -> None:
    """Every group subscribed to a topic gets every event (across partitions)."""
    names = Names()
    async with one_broker(make) as broker:
        topic = names("orders.placed")
        spec = await broker.declare(DestinationSpec(topic, "event", partitions=3))
        groups = {g: await broker.subscribe(spec, g) for g in ("billing", "shipping")}
        await broker.publish([event(topic, i, key=f"k{i}") for i in range(30)])
        for group, views in groups.items():
            got = [d for v in views for d in await broker.read(v, "c", 100, 10)]
            assert sorted(numbers(got)) == list(range(30)), f"group {group} got {sorted(numbers(got))}, not 0..29"


@check()
async def check_same_key_lands_in_one_partition_in_order(make: BrokerFactory, features: Features) -> None:
    """Envelopes sharing a key go to one partition, in the order published."""
    names = Names()
    async with one_broker(make) as broker:
        topic = names("orders.placed")
        spec = await broker.declare(DestinationSpec(topic, "event", partitions=4))
        views = await broker.subscribe(spec, "billing")
        await broker.publish([event(topic, i, key="same") for i in range(20)])
        per_partition = [numbers(await broker.read(v, "c", 100, 10)) for v in views]
        assert sorted(per_partition, key=len)[-1] == list(range(20)), f"partitions got {per_partition}"
        assert sum(len(p) for p in per_partition) == 20, f"partitions got {per_partition}: 20 published"


@check()
async def check_a_mixed_batch_keeps_its_order(make: BrokerFactory, features: Features) -> None:
    """A batch mixing envelopes with and without idempotency keys is stored in the order given,
    each under the entry id publish returned."""
    names = Names()
    async with one_broker(make) as broker:
        queue = names("billing.refund")
        spec = await broker.declare(DestinationSpec(queue, "command"))
        [view] = await broker.subscribe(spec, "billing")
        batch = [command(queue, i) for i in range(6)]
        batch[2].headers[IDEMPOTENCY_KEY] = "k-2"
        batch[4].headers[IDEMPOTENCY_KEY] = "k-4"
        ids = await broker.publish(batch)
        assert all(ids) and len(set(ids)) == 6, f"publish returned {ids}: six distinct entry ids"
        got = await broker.read(view, "c", 10, 10)
        assert numbers(got) == [0, 1, 2, 3, 4, 5], f"read {numbers(got)}, published 0..5 in one batch"
        assert [d.entry_id for d in got] == ids, "the entries read are not those publish returned, in order"


@check(requires=("idempotency_keys",))
async def check_idempotency_key_stores_a_message_once(make: BrokerFactory, features: Features) -> None:
    """Two envelopes with one idempotency key in one publish: the second is not stored (None)."""
    names = Names()
    async with one_broker(make) as broker:
        queue = names("billing.refund")
        spec = await broker.declare(DestinationSpec(queue, "command"))
        [view] = await broker.subscribe(spec, "billing")
        first, repeat = command(queue, 1), command(queue, 1)
        first.headers[IDEMPOTENCY_KEY] = repeat.headers[IDEMPOTENCY_KEY] = "req-42"
        ids = await broker.publish([first, repeat])
        assert ids[0] is not None and ids[1] is None, f"publish returned {ids}: [entry id, None] expected"
        assert len(await broker.read(view, "c", 10, 10)) == 1, "a repeated idempotency key was stored twice"


@check(requires=("idempotency_keys",))
async def check_idempotency_key_without_a_message_key_is_checked_in_one_partition(
    make: BrokerFactory, features: Features
) -> None:
    """Repeats of an idempotency key without a message key are caught whatever partition their ids pick;
    a message key still decides the partition."""
    names = Names()
    async with one_broker(make) as broker:
        topic = names("orders.placed")
        spec = await broker.declare(DestinationSpec(topic, "event", partitions=4))
        views = await broker.subscribe(spec, "billing")
        repeats = [event(topic, i) for i in range(8)]  # no message key: each has its own random id
        for env in repeats:
            env.headers[IDEMPOTENCY_KEY] = "POST /orders 42"
        ids = [(await broker.publish([env]))[0] for env in repeats[:4]]  # one call each
        ids += await broker.publish(repeats[4:])  # and in one batch
        assert ids[0] is not None and ids[1:] == [None] * 7, f"publish returned {ids}: stored once expected"
        stored = await read_all(broker, views, "c")
        assert numbers(stored) == [0], f"the partitions hold {numbers(stored)}: one copy expected"
        keyed = event(topic, 9, key="order-42")
        keyed.headers[IDEMPOTENCY_KEY] = "POST /orders 43"
        [entry] = await broker.publish([keyed])
        in_partition = await broker.read(views[spec.partition_for("order-42", keyed.id)], "c", 10, 10)
        assert [d.entry_id for d in in_partition] == [entry], "a keyed message is not in its key's partition"


@check(requires=("idempotency_keys",))
async def check_idempotency_key_expires_with_its_window(make: BrokerFactory, features: Features) -> None:
    """A repeat inside the stored key's window is dropped (its own window does not count); after the
    window the key stores a message again."""
    names = Names()
    async with one_broker(make) as broker:
        queue = names("billing.refund")
        spec = await broker.declare(DestinationSpec(queue, "command"))
        [view] = await broker.subscribe(spec, "billing")
        window = 400  # ms: short, with room for a slow machine between the first publishes

        def once(n: int, idem: str) -> Envelope:
            env = command(queue, n)
            env.headers[IDEMPOTENCY_KEY] = idem
            return env

        stored = await broker.publish([once(1, "a"), once(2, "b")], dedup_window_ms=window)
        expiry = now_ms() + window  # the window began before the call returned
        assert None not in stored, f"publish returned {stored}: both stored expected"
        assert await broker.publish([once(3, "a")], dedup_window_ms=window) == [None], "a repeat in the window"
        assert await broker.publish([once(4, "a")], dedup_window_ms=60_000) == [None], "the stored window counts"
        while now_ms() <= expiry:
            await anyio.sleep(0.05)
        again = await broker.publish([once(5, "a")], dedup_window_ms=window)
        assert again[0] is not None, "an expired idempotency key must store the message again"
        got = numbers(await broker.read(view, "c", 10, 10))
        assert got == [1, 2, 5], f"read {got}: 1, 2 and (after the window) 5 expected"


@check()
async def check_a_body_over_the_limit_is_refused_before_anything_is_stored(
    make: BrokerFactory, features: Features
) -> None:
    """A body over ``max_body_bytes`` raises MessageTooLarge and nothing of that publish call is stored."""
    names = Names()
    async with one_broker(make) as broker:
        queue = names("billing.refund")
        spec = await broker.declare(DestinationSpec(queue, "command"))
        [view] = await broker.subscribe(spec, "billing")
        broker.max_body_bytes = 64
        big = Envelope(destination=queue, kind="command", type="C", body=b"x" * 65)
        with raises(MessageTooLarge, doing="publishing a 65-byte body under a 64-byte limit"):
            await broker.publish([command(queue, 1), big])
        assert await broker.read(view, "c", 10, 10) == [], "part of a refused publish was stored"
        await broker.publish([command(queue, 2)])
        assert numbers(await broker.read(view, "c", 10, 10)) == [2], "a body under the limit is stored"


@check(requires=("store_raw",))
async def check_undecodable_entries_are_delivered_with_the_reason(make: BrokerFactory, features: Features) -> None:
    """An entry that is not an envelope is delivered with ``envelope`` None and the reason, and can be
    dead-lettered (not retried)."""
    assert features.store_raw is not None
    names = Names()
    async with one_broker(make) as broker:
        spec = await broker.declare(DestinationSpec(names("billing.refund"), "command"))
        [view] = await broker.subscribe(spec, "billing")
        await features.store_raw(broker, view, {b"garbage": b"\xff\x00"})
        [d] = await broker.read(view, "c", 10, 10)
        assert d.envelope is None and "id" in (d.error or ""), f"decoded {d.envelope}, error {d.error!r}"
        assert d.message_id == "" and d.fields == {b"garbage": b"\xff\x00"}, "the raw fields are kept"
        with raises(ValueError, doing="retry_later of an undecodable delivery"):
            await broker.retry_later(d, now_ms())
        assert await broker.dead_letter(d, {"dlq-reason": d.error or ""}), "an undecodable entry is dead-lettered"
