"""Checks of partition ownership: heartbeats, leases with fencing tokens, fenced settles and reads, take-over."""

from __future__ import annotations

import anyio

from broker.capabilities import as_ownership
from broker.conformance.features import BrokerFactory, Features
from broker.conformance.registry import check
from broker.conformance.support import Brokers, Names, close_channel, command, numbers, one_broker, raises
from broker.envelope import now_ms
from broker.errors import LeaseLost
from broker.protocol import Broker, Delivery, GroupPartition
from broker.topology import DestinationSpec

__all__: list[str] = []


async def _keyed_partition(broker: Broker, names: Names, base: str, n: int) -> tuple[GroupPartition, DestinationSpec]:
    """A 2-partition queue holding ``n`` commands of key ``k`` (0..n-1), and the view of group ``g`` on
    the partition they are in."""
    spec = await broker.declare(DestinationSpec(names(base), "command", partitions=2))
    views = await broker.subscribe(spec, "g")
    sent = [command(spec.name, i, key="k") for i in range(n)]
    await broker.publish(sent)
    return views[spec.partition_for("k", "")], spec


async def _take_over(broker: Broker, view: GroupPartition, consumer: str, token: int | None) -> list[Delivery]:
    """Everything pending in the partition, taken over by ``consumer`` (the whole scan)."""
    own = as_ownership(broker)
    cursors: dict[str, str] = {}
    taken = await own.take_over(view, consumer, 10, cursors, token=token)
    while not own.taken_over(cursors):
        taken += await own.take_over(view, consumer, 10, cursors, token=token)
    return taken


@check(requires=("ownership",))
async def check_leases_expire_and_every_acquisition_raises_the_token(make: BrokerFactory, features: Features) -> None:
    """A live lease is refused to others, renewed by its holder, free once expired or released; every
    acquisition raises the token, which never goes back; heartbeats list the live instances sorted."""
    names = Names()
    async with one_broker(make) as broker:
        own = as_ownership(broker)
        spec = await broker.declare(DestinationSpec(names("own.lease"), "command", partitions=2))
        view = (await broker.subscribe(spec, "g"))[0]
        first = await own.acquire_lease(view, "a", 300)
        assert first > 0, f"acquiring a free lease gave {first}"
        assert await own.acquire_lease(view, "b", 300) == 0, "a live lease held by a was given to b"
        assert await own.renew_leases([(view, first)], "a", 300) == [True], "the holder could not renew"
        await anyio.sleep(0.4)
        second = await own.acquire_lease(view, "b", 300)
        assert second > first, f"acquiring an expired lease gave token {second} after {first}"
        assert await own.renew_leases([(view, first)], "a", 300) == [False], "a taken-over lease was renewed"
        assert not await own.release_lease(view, "a", first), "a stale token released the lease"
        assert await own.release_lease(view, "b", second), "the holder could not release"
        third = await own.acquire_lease(view, "a", 300)
        assert third > second, f"tokens went back: {third} after {second}"
        again = await own.acquire_lease(view, "a", 300)
        assert again > third, f"re-acquiring under the holder's own name gave {again} after {third}"
        assert await own.renew_leases([], "a", 300) == []
        assert await own.heartbeat(spec.name, "g", "b", 300) == ["b"]
        assert await own.heartbeat(spec.name, "g", "a", 300) == ["a", "b"], "live instances, sorted"
        assert await own.heartbeat(spec.name, "g", "b", 300, leave=True) == ["a"], "an instance that left is listed"
        await anyio.sleep(0.4)
        assert await own.heartbeat(spec.name, "g", "c", 300) == ["c"], "an expired heartbeat is listed"


@check(requires=("ownership", "fencing"))
async def check_a_stale_owner_gets_every_settle_refused(make: BrokerFactory, features: Features) -> None:
    """Once another instance acquired the partition, the old token's ack, retry_later and dead_letter
    raise LeaseLost and change nothing; the new owner takes the entries over and settles them."""
    names = Names()
    async with one_broker(make) as broker:
        own = as_ownership(broker)
        view, spec = await _keyed_partition(broker, names, "own.fenced", 3)
        stale = await own.acquire_lease(view, "old", 200)
        deliveries = await broker.read(view, "old", 10, 0)
        assert len(deliveries) == 3
        await anyio.sleep(0.3)  # the old owner pauses past its lease; a new owner takes over
        current = await own.acquire_lease(view, "new", 5000)
        assert current > stale
        d0, d1, d2 = deliveries
        with raises(LeaseLost, doing="a stale owner's ack"):
            await broker.ack(view, [d0], inbox=True, token=stale)
        with raises(LeaseLost, doing="a stale owner's retry_later"):
            await broker.retry_later(d1, 0, token=stale)
        with raises(LeaseLost, doing="a stale owner's dead_letter"):
            await broker.dead_letter(d2, {"dlq-reason": "x"}, token=stale)
        assert await broker.move_due(view, now_ms() + 60_000) == 0, "a refused retry_later parked a retry"
        taken = await _take_over(broker, view, "new", current)
        ids = [d.entry_id for d in deliveries]
        assert [d.entry_id for d in taken] == ids, "refused settles changed what is pending (or take_over missed some)"
        assert all(d.delivery_count == 2 for d in taken), f"counts {[d.delivery_count for d in taken]}"
        assert await broker.ack(view, taken[:1], token=current) == 1
        assert await broker.retry_later(taken[1], 0, token=current)
        assert await broker.dead_letter(taken[2], {"dlq-reason": "x"}, token=current) is not None
        await broker.publish([command(spec.name, 9, key="k")])  # without a token nothing is checked
        [fresh] = await broker.read(view, "anyone", 10, 0)
        assert await broker.ack(view, [fresh]) == 1


@check(requires=("ownership", "fencing"))
async def check_a_stale_owner_reads_and_claims_nothing(make: BrokerFactory, features: Features) -> None:
    """Fenced reads, claims and take-overs with a stale token raise LeaseLost and take nothing; the new
    owner takes over what the old one held and reads the rest."""
    names = Names()
    async with one_broker(make) as broker:
        own = as_ownership(broker)
        view, _ = await _keyed_partition(broker, names, "own.intake", 3)
        stale = await own.acquire_lease(view, "old", 200)
        [first] = await broker.read(view, "old", 1, 0, token=stale)  # the holder reads
        await anyio.sleep(0.3)  # paused past the lease; a new owner acquires
        current = await own.acquire_lease(view, "new", 5000)
        channel = broker.channel()
        try:
            ways = [channel, None] if channel is not None else [None]
            for ch in ways:
                for block in (0, 200):
                    with raises(LeaseLost, doing=f"a stale read (block {block}, channel {ch is not None})"):
                        await broker.read(view, "old", 10, block, channel=ch, token=stale)
            with raises(LeaseLost, doing="a stale claim_idle"):
                await broker.claim_idle(view, "old", 0, 10, token=stale)
            with raises(LeaseLost, doing="a stale take_over"):
                await own.take_over(view, "old", 10, {}, token=stale)
            taken = await _take_over(broker, view, "new", current)
            assert [d.entry_id for d in taken] == [first.entry_id], "stale reads or claims took entries"
            rest = await broker.read(view, "new", 10, 0, channel=channel, token=current)
            assert numbers(rest) == [1, 2], f"the new owner read {numbers(rest)}"
            for ch in ways:
                assert await broker.read(view, "new", 10, 0, channel=ch, token=current) == []
        finally:
            await close_channel(channel)


@check(requires=("ownership", "blocking_reads"))
async def check_a_fenced_read_of_the_holder_waits_for_new_entries(make: BrokerFactory, features: Features) -> None:
    """A fenced read of the lease's holder waits for an entry published meanwhile, on a channel or not."""
    names = Names()
    async with one_broker(make) as broker:
        own = as_ownership(broker)
        view, spec = await _keyed_partition(broker, names, "own.wait", 0)
        token = await own.acquire_lease(view, "holder", 5000)
        channel = broker.channel()
        try:
            for n, ch in enumerate([channel, None] if channel is not None else [None]):

                async def publish_later(n: int = n) -> None:
                    await anyio.sleep(0.2)
                    await broker.publish([command(spec.name, n, key="k")])

                woken: list[Delivery] = []
                with anyio.fail_after(5):
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(publish_later)
                        woken = await broker.read(view, "holder", 10, 2000, channel=ch, token=token)
                assert numbers(woken) == [n], f"a fenced blocking read returned {numbers(woken)}"
                with anyio.fail_after(5):
                    assert await broker.read(view, "holder", 10, 100, channel=ch, token=token) == []
        finally:
            await close_channel(channel)


@check(requires=("ownership", "shared_state"))
async def check_once_its_owner_stops_reading_the_next_owner_reads_the_partition(
    make: BrokerFactory, features: Features
) -> None:
    """An owner that read part of a partition and settled it, then stopped reading it (a hand-back), leaves
    the rest to the next owner, in order, nothing lost: a server pushing messages to it stops doing so."""
    names = Names()
    async with Brokers(make) as brokers:
        first, second = await brokers(), await brokers()
        view, _ = await _keyed_partition(first, names, "own.handback", 6)
        token = await as_ownership(first).acquire_lease(view, "a", 60_000)
        got = await first.read(view, "a", 2, 2000, token=token)
        assert numbers(got) == [0, 1], f"the first owner read {numbers(got)}"
        assert await first.ack(view, got, token=token) == 2
        await as_ownership(first).stop_reading(view)
        assert await as_ownership(first).release_lease(view, "a", token)
        taken = await as_ownership(second).acquire_lease(view, "b", 60_000)
        assert taken > token
        rest: list[Delivery] = []
        with anyio.fail_after(20):
            while len(rest) < 4:
                rest += await _take_over(second, view, "b", taken)
                rest += await second.read(view, "b", 10, 500, token=taken)
        assert numbers(rest) == [2, 3, 4, 5], f"the next owner read {numbers(rest)}: lost, doubled or out of order"
