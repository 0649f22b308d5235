"""Checks of topic retention: replay from the earliest event, trimming by time and length, never unacked entries."""

from __future__ import annotations

import anyio

from broker.conformance.features import BrokerFactory, Features
from broker.conformance.registry import check
from broker.conformance.support import Names, event, numbers, one_broker
from broker.envelope import now_ms
from broker.protocol import Broker
from broker.topology import DestinationSpec

__all__: list[str] = []


async def _retained(broker: Broker, spec: DestinationSpec, probe: str) -> list[int]:
    """What partition 0 of the topic still keeps, read by a new group ``probe`` from the earliest event
    (acked at once, so the probe holds nothing back from trimming)."""
    [view] = await broker.subscribe(spec, probe, start="earliest")
    got = []
    while batch := await broker.read(view, "p", 1000, 10):
        got += batch
        await broker.ack(view, batch)
    return numbers(got)


@check(requires=("retention",))
async def check_new_group_can_start_at_latest(make: BrokerFactory, features: Features) -> None:
    """A new group starting at ``latest`` gets only later events; one at ``earliest`` replays what is kept."""
    names = Names()
    async with one_broker(make) as broker:
        topic = names("orders.placed")
        spec = await broker.declare(DestinationSpec(topic, "event"))
        await broker.publish([event(topic, 1)])
        [late] = await broker.subscribe(spec, "late", start="latest")
        [early] = await broker.subscribe(spec, "early", start="earliest")
        await broker.publish([event(topic, 2)])
        assert numbers(await broker.read(late, "c", 10, 10)) == [2], "a group at latest got an earlier event"
        assert numbers(await broker.read(early, "c", 10, 10)) == [1, 2], "a group at earliest missed a kept event"
        [again] = await broker.subscribe(spec, "late", start="earliest")  # an existing group keeps its place
        assert await broker.read(again, "c", 10, 10) == [], "subscribing again moved an existing group back"


@check(requires=("retention",))
async def check_trimming_never_drops_an_entry_a_group_has_not_acked(make: BrokerFactory, features: Features) -> None:
    """``trim`` removes expired events only below what every group acknowledged; once all acked, all go."""
    names = Names()
    async with one_broker(make) as broker:
        topic = names("orders.placed")
        spec = await broker.declare(DestinationSpec(topic, "event", retention_ms=1, max_length=5))
        [fast] = await broker.subscribe(spec, "fast")
        [slow] = await broker.subscribe(spec, "slow")
        await broker.publish([event(topic, i) for i in range(50)])
        await broker.ack(fast, await broker.read(fast, "f", 100, 10))
        slow_got = await broker.read(slow, "s", 10, 10)  # delivered 0..9, acks only 0..4
        await broker.ack(slow, slow_got[:5])
        await anyio.sleep(0.01)
        removed = await broker.trim(spec, 0, now_ms())
        assert removed == 5, f"trim removed {removed}: only the 5 every group acknowledged may go"
        kept = await _retained(broker, spec, "probe1")
        assert kept == list(range(5, 50)), f"the topic keeps {kept[:3]}..{kept[-3:]}, not 5..49"
        await broker.ack(slow, slow_got[5:] + await broker.read(slow, "s", 100, 10))
        await broker.trim(spec, 0, now_ms())
        assert await _retained(broker, spec, "probe2") == [], "retention 1 ms: every acked event goes"


@check(requires=("retention",))
async def check_length_retention_keeps_newest_entries(make: BrokerFactory, features: Features) -> None:
    """A topic with ``max_length`` and no time retention keeps its newest ``max_length`` acked events."""
    names = Names()
    async with one_broker(make) as broker:
        topic = names("metrics")
        spec = await broker.declare(DestinationSpec(topic, "event", retention_ms=None, max_length=10))
        [view] = await broker.subscribe(spec, "reader")
        await broker.publish([event(topic, i) for i in range(30)])
        await broker.ack(view, await broker.read(view, "r", 100, 10))
        assert await broker.trim(spec, 0, now_ms()) == 20, "trim did not remove the 20 oldest events"
        kept = await _retained(broker, spec, "probe")
        assert kept == list(range(20, 30)), f"the topic keeps {kept}, not the newest 20..29"


@check(requires=("retention",))
async def check_trimming_keeps_what_a_group_was_not_delivered(make: BrokerFactory, features: Features) -> None:
    """Events no group was delivered yet are never trimmed, however old."""
    names = Names()
    async with one_broker(make) as broker:
        topic = names("orders.placed")
        spec = await broker.declare(DestinationSpec(topic, "event", retention_ms=1, max_length=2))
        [view] = await broker.subscribe(spec, "idle")
        await broker.publish([event(topic, i) for i in range(6)])
        await anyio.sleep(0.01)
        assert await broker.trim(spec, 0, now_ms()) == 0, "trim removed events a group was not delivered"
        assert numbers(await broker.read(view, "c", 10, 10)) == list(range(6))
