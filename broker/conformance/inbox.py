"""Checks of the inbox: leases while a handler runs, duplicates recognised once the ack recorded them."""

from __future__ import annotations

import anyio

from broker.capabilities import as_inbox
from broker.conformance.features import BrokerFactory, Features
from broker.conformance.registry import check
from broker.conformance.support import Names, command, one_broker
from broker.envelope import now_ms
from broker.protocol import Delivery
from broker.topology import DestinationSpec

__all__: list[str] = []

RUN, DUPLICATE, ELSEWHERE = 0, 1, 2  # inbox_claim's statuses


@check(requires=("inbox",))
async def check_inbox_claim_leases_new_ids_and_reports_duplicates(make: BrokerFactory, features: Features) -> None:
    """``inbox_claim``: a new id is leased (0), a copy of a running one left (2) unless redelivered (0: the
    lease is taken over), a copy of one acked with ``inbox=True`` is a duplicate (1)."""
    names = Names()
    async with one_broker(make) as broker:
        inbox = as_inbox(broker)
        spec = await broker.declare(DestinationSpec(names("billing.refund"), "command"))
        [view] = await broker.subscribe(spec, "billing")
        original, copy = command(spec.name, 1), command(spec.name, 1)
        copy.id = original.id  # a re-published copy: another entry, the same message id
        await broker.publish([original, copy])
        first, second = await broker.read(view, "a", 10, 10)
        assert await inbox.inbox_claim(view, [first], 60_000) == [RUN], "a new id is leased to the caller"
        assert await inbox.inbox_claim(view, [second], 60_000) == [ELSEWHERE], "a running id is leased elsewhere"
        second.delivery_count = 2
        assert await inbox.inbox_claim(view, [second], 60_000) == [RUN], "a redelivery takes the lease over"
        assert await broker.ack(view, [first], inbox=True) == 1
        assert await inbox.inbox_claim(view, [second], 60_000) == [DUPLICATE], "a processed id is a duplicate"


@check(requires=("inbox",))
async def check_inbox_leases_expire_and_extend_prolongs_them(make: BrokerFactory, features: Features) -> None:
    """An inbox lease ends after ``lease_ms`` (a copy is then leased again); ``extend`` prolongs it."""
    names = Names()
    async with one_broker(make) as broker:
        inbox = as_inbox(broker)
        spec = await broker.declare(DestinationSpec(names("billing.refund"), "command"))
        [view] = await broker.subscribe(spec, "billing")
        sent = [command(spec.name, i) for i in range(2)]
        copies = [command(spec.name, i) for i in range(2)]
        for env, copy in zip(sent, copies, strict=True):
            copy.id = env.id
        await broker.publish(sent)
        short, extended = await broker.read(view, "a", 10, 10)
        assert await inbox.inbox_claim(view, [short, extended], 100) == [RUN, RUN]
        await broker.extend(view, "a", [extended], lease_ms=60_000)
        await anyio.sleep(0.2)
        await broker.publish(copies)
        copy_short, copy_extended = await broker.read(view, "b", 10, 10)
        assert await inbox.inbox_claim(view, [copy_short], 60_000) == [RUN], "an expired lease still holds its id"
        assert await inbox.inbox_claim(view, [copy_extended], 60_000) == [ELSEWHERE], "extend did not prolong it"


@check(requires=("inbox",))
async def check_a_batch_claims_each_id_once(make: BrokerFactory, features: Features) -> None:
    """Two copies of one id in one ``inbox_claim`` batch: the first runs, the second is left (2)."""
    names = Names()
    async with one_broker(make) as broker:
        inbox = as_inbox(broker)
        spec = await broker.declare(DestinationSpec(names("billing.refund"), "command"))
        [view] = await broker.subscribe(spec, "billing")
        other, original, copy = command(spec.name, 0), command(spec.name, 1), command(spec.name, 1)
        copy.id = original.id
        await broker.publish([other, original, copy])
        batch: list[Delivery] = await broker.read(view, "a", 10, 10)
        assert await inbox.inbox_claim(view, batch, 60_000) == [RUN, RUN, ELSEWHERE]


@check(requires=("inbox",))
async def check_trim_inbox_keeps_records_inside_the_window(make: BrokerFactory, features: Features) -> None:
    """``trim_inbox`` forgets only what was recorded before ``older_than_ms``: a recent duplicate stays one."""
    names = Names()
    async with one_broker(make) as broker:
        inbox = as_inbox(broker)
        spec = await broker.declare(DestinationSpec(names("billing.refund"), "command"))
        [view] = await broker.subscribe(spec, "billing")
        original, copy = command(spec.name, 1), command(spec.name, 1)
        copy.id = original.id
        await broker.publish([original])
        [d] = await broker.read(view, "a", 10, 10)
        assert await inbox.inbox_claim(view, [d], 60_000) == [RUN]
        assert await broker.ack(view, [d], inbox=True) == 1
        trimmed = await inbox.trim_inbox(view, now_ms() - 60_000)
        assert trimmed >= 0, f"trim_inbox returned {trimmed}"
        await broker.publish([copy])
        [again] = await broker.read(view, "a", 10, 10)
        assert await inbox.inbox_claim(view, [again], 60_000) == [DUPLICATE], "trim_inbox forgot a recent record"


@check(requires=("inbox",))
async def check_read_leased_takes_the_leases_of_what_it_reads(make: BrokerFactory, features: Features) -> None:
    """``read_leased``: each delivery comes with the status ``inbox_claim`` would give it (or None for the
    caller to claim), and what it leased is held: a copy read meanwhile is left (2), a processed one is
    a duplicate (1). Ids of any shape: the transport's own, UUIDs of other versions, application ids."""
    names = Names()
    async with one_broker(make) as broker:
        inbox = as_inbox(broker)
        spec = await broker.declare(DestinationSpec(names("billing.refund"), "command"))
        [view] = await broker.subscribe(spec, "billing")
        ids = ["order-7", "0190a3f0-0000-4000-8000-000000000000", "naïve-ü-42", "x" * 200]
        sent = [command(spec.name, i) for i in range(len(ids) + 1)]
        for env, mid in zip(sent, ids, strict=False):
            env.id = mid
        await broker.publish(sent)
        got = await inbox.read_leased(view, "a", 100, 10, lease_ms=60_000)
        assert [d.message_id for d in got] == [e.id for e in sent]
        unchecked = [d for d in got if d.inbox_status is None]
        if unchecked:
            for d, status in zip(unchecked, await inbox.inbox_claim(view, unchecked, 60_000), strict=True):
                d.inbox_status = status
        assert [d.inbox_status for d in got] == [RUN] * len(sent), "new ids are leased to the reader"
        copies = [command(spec.name, i) for i in range(len(sent))]
        for env, original in zip(copies, sent, strict=True):
            env.id = original.id
        await broker.publish(copies[:2])
        assert await broker.ack(view, got[:1], inbox=True) == 1
        again = await inbox.read_leased(view, "b", 100, 10, lease_ms=60_000)
        statuses: list[int | None] = [d.inbox_status for d in again]
        if None in statuses:
            statuses = list(await inbox.inbox_claim(view, again, 60_000))
        assert statuses == [DUPLICATE, ELSEWHERE], f"a processed copy is a duplicate, one running elsewhere: {statuses}"
        assert await inbox.read_leased(view, "b", 100, 0, lease_ms=60_000) == [], "nothing new: nothing read"


@check(requires=("inbox",))
async def check_a_leased_read_that_reached_the_end_wakes_for_the_next_message(
    make: BrokerFactory, features: Features
) -> None:
    """``read_leased`` after a read that took everything there was: its wait starts where that read
    ended, so a message published during the wait comes back from it, leased, long before the wait's
    end (a wait started past it would sleep through it until the block time runs out)."""
    names = Names()
    async with one_broker(make) as broker:
        inbox = as_inbox(broker)
        spec = await broker.declare(DestinationSpec(names("billing.refund"), "command"))
        [view] = await broker.subscribe(spec, "billing")
        await broker.publish([command(spec.name, i) for i in range(3)])
        first = await inbox.read_leased(view, "a", 100, 10, lease_ms=60_000)
        assert len(first) == 3
        await broker.ack(view, first, inbox=True)  # (a queue deletes acknowledged entries)
        late = command(spec.name, 3)
        got: list[Delivery] = []

        async def wait() -> None:
            got.extend(await inbox.read_leased(view, "a", 100, 20_000, lease_ms=60_000))

        with anyio.fail_after(15):
            async with anyio.create_task_group() as tg:
                tg.start_soon(wait)
                await anyio.sleep(0.2)  # the read waits now
                await broker.publish([late])
        assert [d.message_id for d in got] == [late.id], "the wait slept through a new message"
        assert [d.inbox_status for d in got] in ([RUN], [None])
