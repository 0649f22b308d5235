"""Checks of settlement and retries: dead-letter and retry atomic with the ack, due retries moved once, attempts."""

from __future__ import annotations

import anyio

from broker.conformance.features import BrokerFactory, Features
from broker.conformance.registry import check
from broker.conformance.support import Names, command, event, numbers, one_broker
from broker.envelope import now_ms
from broker.topology import DestinationSpec

__all__: list[str] = []


@check()
async def check_dead_letter_is_atomic_with_ack_and_happens_once(make: BrokerFactory, features: Features) -> None:
    """``dead_letter`` settles the entry (no longer pending anywhere); a second call does nothing (None)."""
    names = Names()
    async with one_broker(make) as broker:
        spec = await broker.declare(DestinationSpec(names("billing.refund"), "command"))
        [view] = await broker.subscribe(spec, "billing")
        await broker.publish([command(spec.name, 7)])
        [d] = await broker.read(view, "a", 10, 10)
        assert await broker.dead_letter(d, {"dlq-reason": "boom"}) is not None, "dead_letter returned no id"
        assert await broker.dead_letter(d, {"dlq-reason": "boom"}) is None, "a settled entry was dead-lettered again"
        assert await broker.read_own_pending(view, "a", 10) == [], "a dead-lettered entry is still pending"
        assert await broker.claim_idle(view, "b", 0, 10) == [], "a dead-lettered entry can be claimed"
        assert await broker.ack(view, [d]) == 0, "a dead-lettered entry was still pending for ack"
        assert await broker.read(view, "a", 10, 10) == [], "a dead-lettered entry is delivered again"


@check()
async def check_settling_twice_is_harmless(make: BrokerFactory, features: Features) -> None:
    """Every settle step on an entry no longer pending does nothing: ack 0, retry_later False, dead_letter None."""
    names = Names()
    async with one_broker(make) as broker:
        spec = await broker.declare(DestinationSpec(names("billing.refund"), "command"))
        [view] = await broker.subscribe(spec, "billing")
        await broker.publish([command(spec.name, i) for i in range(2)])
        acked, retried = await broker.read(view, "a", 10, 10)
        assert await broker.ack(view, [acked]) == 1
        assert await broker.ack(view, [acked]) == 0, "an acked entry was acked again"
        assert await broker.retry_later(acked, now_ms()) is False, "an acked entry was parked for a retry"
        assert await broker.dead_letter(acked, {"dlq-reason": "x"}) is None, "an acked entry was dead-lettered"
        assert await broker.retry_later(retried, now_ms()) is True
        assert await broker.retry_later(retried, now_ms()) is False, "a retried entry was parked twice"
        moved = await broker.move_due(view, now_ms() + 1)
        assert moved == (1 if features.parked_retries else 0), f"one retry parked, one due: {moved} moved"
        assert numbers(await broker.read(view, "a", 10, 10)) == [1], "the retry was not delivered once"


@check(requires=("parked_retries",))
async def check_retry_path_redelivers_to_the_failing_group_only(make: BrokerFactory, features: Features) -> None:
    """``retry_later`` parks an event for its group only until due; ``move_due`` redelivers it as the next attempt."""
    names = Names()
    async with one_broker(make) as broker:
        topic = names("orders.placed")
        spec = await broker.declare(DestinationSpec(topic, "event"))
        [billing] = await broker.subscribe(spec, "billing")
        [shipping] = await broker.subscribe(spec, "shipping")
        await broker.publish([event(topic, 1)])
        [d] = await broker.read(billing, "a", 10, 10)
        assert await broker.retry_later(d, now_ms() + 60_000), "retry_later refused a pending entry"
        assert await broker.move_due(billing, now_ms()) == 0, "a retry moved before it was due"
        assert await broker.read(billing, "a", 10, 10) == [], "a parked retry was delivered before it was due"
        assert await broker.move_due(billing, now_ms() + 61_000) == 1, "a due retry was not moved"
        [again] = await broker.read(billing, "a", 10, 10)
        assert again.envelope is not None and d.envelope is not None
        assert again.envelope.id == d.envelope.id and again.attempt == 2, f"redelivered as attempt {again.attempt}"
        assert numbers(await broker.read(shipping, "s", 10, 10)) == [1], "shipping saw the event once, from the topic"
        assert await broker.read(shipping, "s", 10, 10) == [], "the retry reached another group"


@check()
async def check_retry_later_carries_the_given_attempt(make: BrokerFactory, features: Features) -> None:
    """A retry parked with ``attempt=n`` is redelivered as attempt n + 1."""
    names = Names()
    async with one_broker(make) as broker:
        spec = await broker.declare(DestinationSpec(names("billing.refund"), "command"))
        [view] = await broker.subscribe(spec, "billing")
        await broker.publish([command(spec.name, 1)])
        [d] = await broker.read(view, "a", 10, 10)
        assert await broker.retry_later(d, now_ms(), attempt=4)
        assert await broker.move_due(view, now_ms() + 1) == (1 if features.parked_retries else 0)
        [again] = await broker.read(view, "a", 10, 10)
        assert again.attempt == 5, f"a retry of attempt 4 is delivered as attempt {again.attempt}, not 5"


@check(requires=("parked_retries",))
async def check_concurrent_schedulers_move_each_retry_once(make: BrokerFactory, features: Features) -> None:
    """Several tasks moving due retries at once move each exactly once."""
    names = Names()
    async with one_broker(make) as broker:
        spec = await broker.declare(DestinationSpec(names("billing.refund"), "command"))
        [view] = await broker.subscribe(spec, "billing")
        await broker.publish([command(spec.name, i) for i in range(200)])
        due = now_ms()
        for d in await broker.read(view, "a", 500, 10):
            await broker.retry_later(d, due)
        moved: list[int] = []

        async def scheduler() -> None:
            while n := await broker.move_due(view, now_ms(), limit=7):
                moved.append(n)

        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(scheduler)
        assert sum(moved) == 200, f"the schedulers moved {sum(moved)} retries of 200"
        again = await broker.read(view, "a", 500, 10)
        assert sorted(numbers(again)) == list(range(200)), f"{len(again)} redeliveries of 200 retries"


@check()
async def check_redelivered_runs_are_counted(make: BrokerFactory, features: Features) -> None:
    """``count_attempt`` counts a message's redelivered runs; ``count_first_redeliveries`` counts the first
    one and marks a message whose earlier redelivered run never completed (False)."""
    names = Names()
    async with one_broker(make) as broker:
        spec = await broker.declare(DestinationSpec(names("billing.refund"), "command"))
        [view] = await broker.subscribe(spec, "billing")
        await broker.publish([command(spec.name, i) for i in range(2)])
        await broker.read(view, "a", 10, 10)
        one, two = await broker.read_own_pending(view, "a", 10)  # redelivered after a restart
        assert await broker.count_attempt(one) == 1, "the first redelivered run counts 1"
        assert await broker.count_attempt(one) == 2, "the second redelivered run counts 2"
        assert await broker.count_first_redeliveries([two]) == [True], "a first redelivered run is not a suspect"
        assert await broker.count_first_redeliveries([two, one]) == [False, False], "runs that did not complete"
        assert await broker.count_attempt(two) == 2, "count_first_redeliveries counted the first run"
        assert await broker.count_first_redeliveries([]) == []
