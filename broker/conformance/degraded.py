"""Checks of documented degraded behaviour: what a transport lacking a feature does instead (asserted, not skipped).

Each check here runs only on transports that do *not* claim the feature it names in ``unless``
(RabbitMQ: no retention, no idempotency keys, retries delivered by the server's clock, settlement
in two steps); ``docs/transports.md`` says the same in words.
"""

from __future__ import annotations

import time

import anyio

from broker.capabilities import as_dead_letter_admin, as_ownership
from broker.conformance.features import BrokerFactory, Features
from broker.conformance.registry import check
from broker.conformance.support import Brokers, Names, command, event, numbers, one_broker
from broker.envelope import now_ms
from broker.headers import DLQ_REASON, IDEMPOTENCY_KEY
from broker.topology import DestinationSpec

__all__: list[str] = []


@check(unless=("retention",))
async def check_without_retention_a_late_group_gets_only_later_events(make: BrokerFactory, features: Features) -> None:
    """Without retention a group gets only events published after it subscribed, even at ``earliest``;
    ``trim`` removes nothing."""
    names = Names()
    async with one_broker(make) as broker:
        topic = names("orders.placed")
        spec = await broker.declare(DestinationSpec(topic, "event"))
        [early] = await broker.subscribe(spec, "early")
        await broker.publish([event(topic, 1)])
        [late] = await broker.subscribe(spec, "late", start="earliest")
        await broker.publish([event(topic, 2)])
        assert numbers(await broker.read(early, "c", 10, 500)) == [1, 2], "the early group missed an event"
        got = numbers(await broker.read(late, "c", 10, 500))
        assert got == [2], f"a group that joined late read {got}: only the later event expected (no replay)"
        assert await broker.trim(spec, 0, now_ms()) == 0, "trim removed entries of a transport without retention"


@check(unless=("idempotency_keys",))
async def check_without_idempotency_keys_a_repeat_is_stored_again(make: BrokerFactory, features: Features) -> None:
    """Without idempotency keys two messages with one key are both stored (the consumer's inbox drops copies)."""
    names = Names()
    async with one_broker(make) as broker:
        spec = await broker.declare(DestinationSpec(names("billing.refund"), "command"))
        [view] = await broker.subscribe(spec, "billing")
        first, repeat = command(spec.name, 1), command(spec.name, 2)
        first.headers[IDEMPOTENCY_KEY] = repeat.headers[IDEMPOTENCY_KEY] = "req-42"
        ids = await broker.publish([first, repeat])
        assert None not in ids, f"publish returned {ids}: both stored expected"
        assert numbers(await broker.read(view, "c", 10, 500)) == [1, 2], "a repeated key was not stored again"


@check(unless=("parked_retries",))
async def check_retries_are_delivered_by_the_server_when_due(make: BrokerFactory, features: Features) -> None:
    """Without parked retries a retry comes back by itself when due (not before), to its group only, as the
    next attempt; ``move_due`` moves nothing."""
    names = Names()
    async with one_broker(make) as broker:
        topic = names("orders.placed")
        spec = await broker.declare(DestinationSpec(topic, "event"))
        [billing] = await broker.subscribe(spec, "billing")
        [shipping] = await broker.subscribe(spec, "shipping")
        await broker.publish([event(topic, 1)])
        [d] = await broker.read(billing, "a", 10, 500)
        parked = time.monotonic()
        assert await broker.retry_later(d, now_ms() + 1500), "retry_later refused a pending entry"
        assert await broker.move_due(billing, now_ms() + 60_000) == 0, "move_due moved a retry the server holds"
        assert await broker.read(billing, "a", 10, 500) == [], "a retry came back before it was due"
        [again] = await broker.read(billing, "a", 10, 10_000)
        waited = time.monotonic() - parked
        assert waited >= 1.4, f"the retry came back after {waited:.2f}s: not before its 1.5 s delay expected"
        assert again.envelope is not None and d.envelope is not None
        assert again.envelope.id == d.envelope.id and again.attempt == 2, f"redelivered as attempt {again.attempt}"
        assert numbers(await broker.read(shipping, "s", 10, 500)) == [1], "shipping saw the event once"
        assert await broker.read(shipping, "s", 10, 200) == [], "the retry reached another group"


@check(requires=("shared_state", "dead_letter_admin"), unless=("atomic_settlement",))
async def check_settling_in_two_steps_loses_nothing(make: BrokerFactory, features: Features) -> None:
    """Without atomic settlement nothing is lost: a dead letter is written before its ack, and what a
    consumer's connection held unsettled when it closed is delivered again, its count raised."""
    names = Names()
    async with Brokers(make) as brokers:
        a = await brokers()
        spec = await a.declare(DestinationSpec(names("billing.refund"), "command"))
        [view] = await a.subscribe(spec, "billing")
        await a.publish([command(spec.name, i) for i in range(2)])
        dead, held = await a.read(view, "a", 10, 500)
        dlq_id = await a.dead_letter(dead, {DLQ_REASON: "boom"})
        await a.close()  # a crash before ``held`` was settled
        b = await brokers()
        again = await b.read(view, "b", 10, 5000)
        assert numbers(again) == numbers([held]), f"after a's connection closed b read {numbers(again)}"
        assert again[0].delivery_count == 2, f"a redelivery counts {again[0].delivery_count}, not 2"
        letters = await as_dead_letter_admin(b).dead_letter_entries(view)
        assert [i for i, _ in letters] == [dlq_id], f"dead letters {[i for i, _ in letters]}, written {dlq_id}"


@check(requires=("ownership",), unless=("fencing",))
async def check_without_fencing_leases_balance_but_a_stale_ack_still_applies(
    make: BrokerFactory, features: Features
) -> None:
    """Without fencing the leases still hand tokens out in order, but a settle carrying a stale token is not
    refused: the partition's next owner must expect a paused owner's late acks (its inbox drops re-runs)."""
    names = Names()
    async with one_broker(make) as broker:
        own = as_ownership(broker)
        spec = await broker.declare(DestinationSpec(names("nofence.jobs"), "command"))
        [view] = await broker.subscribe(spec, "g")
        stale = await own.acquire_lease(view, "a", 300)
        await broker.publish([command(spec.name, 1)])
        got = await broker.read(view, "a", 10, 2000, token=stale)
        assert numbers(got) == [1]
        await anyio.sleep(0.4)  # a's lease lapses (a paused owner), b takes the partition
        current = await own.acquire_lease(view, "b", 60_000)
        assert current > stale, f"tokens went back: {current} after {stale}"
        assert await broker.ack(view, got, token=stale) == 1, "a stale token's ack was refused without fencing"
