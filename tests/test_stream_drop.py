"""A queue's acknowledged entries leave the stream (issue #33: by one trim when a batch is acked in
order, ``broker/redis/lua/stream_drop.lua``), and nothing else ever does: not an entry still
pending, not one the group has not read."""

from __future__ import annotations

from collections.abc import Sequence

import orjson
import pytest

from broker import Envelope
from broker.protocol import Delivery, DestinationSpec, GroupPartition
from broker.redis import RedisBroker

pytestmark = pytest.mark.anyio


async def _queue(broker: RedisBroker, n: int) -> tuple[GroupPartition, list[str]]:
    """A one-partition queue holding ``n`` commands, subscribed by group ``g``; its entry ids."""
    spec = await broker.declare(DestinationSpec("drop.q", "command"))
    [view] = await broker.subscribe(spec, "g")
    batch = [Envelope(destination="drop.q", kind="command", type="C", body=orjson.dumps({"n": i})) for i in range(n)]
    ids = await broker.publish(batch)
    return view, [i for i in ids if i is not None]


async def _left(broker: RedisBroker, view: GroupPartition) -> list[str]:
    entries = await broker.redis.xrange(view.stream)
    return [e[0].decode() if isinstance(e[0], bytes) else e[0] for e in entries]


async def _calls(broker: RedisBroker) -> dict[str, int]:
    stats = await broker.redis.info("commandstats")
    return {name: int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("xdel", "xtrim")}


async def _ack(broker: RedisBroker, view: GroupPartition, deliveries: Sequence[Delivery]) -> None:
    assert await broker.ack(view, deliveries, inbox=True) == len(deliveries)


async def test_a_batch_acked_in_order_goes_by_one_trim(broker: RedisBroker) -> None:
    view, ids = await _queue(broker, 40)
    read = await broker.read(view, "c", 30, 10)
    assert [d.entry_id for d in read] == ids[:30]
    before = await _calls(broker)
    await _ack(broker, view, read[:20])  # older than every entry still pending
    after = await _calls(broker)
    assert await _left(broker, view) == ids[20:]  # 10 pending, 10 not read yet
    assert after["xtrim"] > before["xtrim"] and after["xdel"] == before["xdel"]  # (no entry-by-entry delete)
    assert len(await broker.read(view, "c", 30, 10)) == 10  # the unread ones are still delivered


async def test_acks_behind_an_older_running_entry_delete_exactly_themselves(broker: RedisBroker) -> None:
    view, ids = await _queue(broker, 30)
    read = await broker.read(view, "c", 20, 10)
    await _ack(broker, view, read[1:12])  # the first entry still running: it is older than these
    assert await _left(broker, view) == [ids[0], *ids[12:]]
    await _ack(broker, view, [read[0]])
    assert await _left(broker, view) == ids[12:]


async def test_with_nothing_pending_only_what_was_delivered_goes(broker: RedisBroker) -> None:
    """No pending entry bounds the trim then: the group's last delivered id does (an entry published
    after the read, or never read, stays)."""
    view, ids = await _queue(broker, 30)
    read = await broker.read(view, "c", 20, 10)
    await _ack(broker, view, list(reversed(read)))  # (in any order: nothing is pending after it)
    assert await _left(broker, view) == ids[20:]
    rest = await broker.read(view, "c", 20, 10)
    assert [d.entry_id for d in rest] == ids[20:]
    await _ack(broker, view, rest)
    assert await _left(broker, view) == []
    assert await broker.ack(view, rest, inbox=True) == 0  # a repeated ack: nothing left to delete, no error


async def test_a_topics_entries_stay_for_other_groups(broker: RedisBroker) -> None:
    spec = await broker.declare(DestinationSpec("drop.t", "event"))
    [view] = await broker.subscribe(spec, "g")
    batch = [Envelope(destination="drop.t", kind="event", type="E", body=b"{}") for _ in range(20)]
    ids = [i for i in await broker.publish(batch) if i is not None]
    await _ack(broker, view, await broker.read(view, "c", 20, 10))
    assert await _left(broker, view) == ids
