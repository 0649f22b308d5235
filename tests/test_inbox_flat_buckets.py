"""Flat buckets (issue #33): processed ids kept as strings of 13-byte fields, one APPEND per bucket.

An id in a hash bucket costs the server a look-up along the listpack, a value and an argument of
its own; appended to a string it costs nothing per id on the server. Workers of earlier releases
look only in hash buckets, so the writers use flat ones once the group says ``flat = 1`` (every
new inbox: its first claim marks it; ``$FRAMEWORK_INBOX_FLAT_BUCKETS`` turns it on or off for the
groups a process subscribes), and a slot that switches keeps every id already recorded where it was
written.
"""

from __future__ import annotations

import pytest

from broker import DestinationSpec, now_ms
from broker.redis import RedisBroker
from broker.redis.keys import INBOX_SLOT_MS, inbox_slot
from tests.test_inbox_memory import _view, bucket_size, claim, record, uuid7_at

pytestmark = pytest.mark.anyio


def uuid_of(raw: bytes) -> str:
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


async def test_a_slot_switching_layouts_finds_every_id_where_it_was_written(broker: RedisBroker) -> None:
    view = await _view(broker, layout="hash")
    info = f"{view.keys.inbox}:info"
    t0 = (now_ms() // INBOX_SLOT_MS) * INBOX_SLOT_MS + 1000
    meta = f"{view.keys.inbox}:{inbox_slot(t0)}"
    early = [uuid7_at(t0 + i // 20) for i in range(400)]  # 20 ms of ids, in hash buckets
    await record(broker, view, early)
    await broker.redis.hset(info, "flat", "1")  # every worker runs this release now
    later = [uuid7_at(t0 + 20 + i // 20) for i in range(400)]
    await record(broker, view, later)
    await broker.redis.hset(info, "flat", "0")  # off again (an older worker joins)
    last = [uuid7_at(t0 + 40 + i // 20) for i in range(400)]
    await record(broker, view, last)
    regimes = (await broker.redis.hget(meta, "r")).decode().split(",")
    assert [r.endswith(":a") for r in regimes] == [False, True, False], regimes
    keys = [k.decode() async for k in broker.redis.scan_iter(f"{view.keys.inbox}:*")]
    flat = [k for k in keys if ":a:" in k]
    assert flat and {await broker.redis.type(k) for k in flat} == {b"string"}
    assert sum([await bucket_size(broker, k) for k in flat]) == 400  # the middle batch alone
    fresh = [uuid7_at(t0 + i) for i in range(0, 60, 3)]  # the same milliseconds, never recorded
    assert await claim(broker, view, [*early, *later, *last, *fresh]) == [1] * 1200 + [0] * len(fresh)


async def test_a_field_made_of_two_neighbours_is_not_found(broker: RedisBroker) -> None:
    """A flat bucket is one string: an id whose 13-byte field equals the end of one recorded field
    and the start of the next must not be taken for recorded (it would be dropped as a duplicate:
    a message lost). A match counts only at a field's boundary."""
    view = await _view(broker, layout="hash")
    await broker.redis.hset(f"{view.keys.inbox}:info", "flat", "1")
    t = now_ms() - 1000
    stamp = t.to_bytes(6, "big")
    low = stamp[3:]  # the id time's low bytes: the first 3 of a field (ids 4..16)
    a = low + bytes([0x70, 0x11]) + low + bytes([0x72, 0x33, 0x44, 0x55, 0x66])
    b = low + bytes([0x75, 0x77]) + bytes(range(1, 9))
    c = a[5:] + b[:5]  # a's last 8 bytes and b's first 5: a valid field of the same millisecond
    assert len(c) == 13 and c[:3] == low and c[3] >> 4 == 7
    ida, idb, idc = (uuid_of(stamp[:3] + f) for f in (a, b, c))
    await record(broker, view, [ida, idb])
    [bucket] = [k async for k in broker.redis.scan_iter(f"{view.keys.inbox}:a:*")]
    assert c in await broker.redis.get(bucket)  # there, but across the two fields
    assert await claim(broker, view, [ida, idb, idc]) == [1, 1, 0]


async def test_a_repeated_ack_appends_nothing(broker: RedisBroker) -> None:
    view = await _view(broker, layout="flat")
    t0 = now_ms() - 5000
    ids = [uuid7_at(t0 + i // 50) for i in range(500)]
    await record(broker, view, ids[:300])
    sizes = {k: await bucket_size(broker, k) async for k in broker.redis.scan_iter(f"{view.keys.inbox}:a:*")}
    assert sum(sizes.values()) == 300
    await record(broker, view, ids)  # the first 300 again (a lost reply's ack), 200 new
    await record(broker, view, ids[::7])  # all recorded already, some out of id order
    after = {k: await bucket_size(broker, k) async for k in broker.redis.scan_iter(f"{view.keys.inbox}:a:*")}
    assert sum(after.values()) == 500
    assert await claim(broker, view, ids) == [1] * 500


async def test_a_new_inbox_records_in_flat_buckets_with_no_setting(broker: RedisBroker) -> None:
    """The worker's first claim stores the group's window and marks the new inbox flat: its acks
    append to flat buckets, and not one hash bucket is written."""
    spec = await broker.declare(DestinationSpec("flat.new", "command"))
    [view] = await broker.subscribe(spec, "g")
    ids = [uuid7_at(now_ms() - 2000 + i // 20) for i in range(200)]
    assert await claim(broker, view, ids, window_ms=3_600_000) == [0] * 200
    await record(broker, view, ids)
    keys = [k async for k in broker.redis.scan_iter(f"{view.keys.inbox}:*")]
    flat = [k for k in keys if b":a:" in k]
    assert flat and not [k for k in keys if b":b:" in k]
    assert sum([await bucket_size(broker, k) for k in flat]) == 200
    assert await claim(broker, view, ids) == [1] * 200
