"""Buckets finer than a millisecond (issue #33): every worker reads and follows them; writers start them when told.

A burst's ids (hundreds made in one millisecond) share one 1-ms bucket otherwise, whose listpack
each recorded id scans: the cost of the record grows with the square of the burst. The remedy, a
slot regime with S < 0 (2^-S buckets per millisecond, an id's bucket chosen by the low bits of
its rand_a), cannot be written while workers of earlier releases run (they look only in the 1-ms
bucket). So every worker reads and follows such regimes (the first tests write one by hand), and
the writers start one only once ``$FRAMEWORK_INBOX_FINE_BUCKETS`` marked the group. These tests
keep hash buckets but where they say (tests/test_inbox_flat_buckets.py has flat ones).
"""

from __future__ import annotations

import pytest

from broker import now_ms
from broker.protocol import DestinationSpec
from broker.redis import RedisBroker
from broker.redis.keys import INBOX_FINE_ENV, INBOX_FLAT_ENV, INBOX_SLOT_MS, compact_id, inbox_slot
from tests.test_inbox_check import claim_spanned
from tests.test_inbox_memory import _view, bucket_size, claim, record, uuid7_at

pytestmark = pytest.mark.anyio


def fine_bucket(inbox: str, message_id: str, shift: int) -> str:
    """The bucket a UUIDv7 id belongs to under a regime of shift ``shift`` < 0 (inbox_read.lua)."""
    raw = compact_id(message_id)
    t = int.from_bytes(raw[:6], "big")
    return f"{inbox}:b:{shift}:{t:x}.{raw[7] % 2**-shift}"


async def test_ids_recorded_under_a_finer_regime_go_to_their_own_buckets_and_are_found(broker: RedisBroker) -> None:
    view = await _view(broker, layout="hash")
    t0 = (now_ms() // INBOX_SLOT_MS) * INBOX_SLOT_MS + 1000  # inside one slot
    meta = f"{view.keys.inbox}:{inbox_slot(t0)}"
    await broker.redis.hset(meta, mapping={"r": "0:-3", "n": 0, "h": 0, "f": t0})  # as a later writer leaves it
    done = [uuid7_at(t0 + i // 400) for i in range(1200)]  # 400 ids per ms: about 50 per bucket
    await record(broker, view, done)
    for message_id in done:  # each in the bucket its own rand_a picks, none in the 1-ms bucket
        field = compact_id(message_id)[3:]
        assert await broker.redis.hexists(fine_bucket(view.keys.inbox, message_id, -3), field), message_id
    assert not [k async for k in broker.redis.scan_iter(f"{view.keys.inbox}:b:0:*")]
    assert await broker.redis.hget(meta, "r") == b"0:-3"  # the regime kept as it was
    fresh = [uuid7_at(t0 + i // 40) for i in range(40)]  # the same milliseconds, not recorded
    assert await claim(broker, view, [*done, *fresh]) == [1] * 1200 + [0] * 40
    later = [uuid7_at(t0 + 10 + i) for i in range(5)]
    assert await claim_spanned(broker, view, [done[0], *later]) == [1, 0, 0, 0, 0, 0]


async def test_a_finer_regime_after_a_coarse_one_keeps_each_id_where_its_regime_puts_it(broker: RedisBroker) -> None:
    view = await _view(broker, layout="hash")
    t0 = (now_ms() // INBOX_SLOT_MS) * INBOX_SLOT_MS + 2000
    meta = f"{view.keys.inbox}:{inbox_slot(t0)}"
    await broker.redis.hset(meta, mapping={"r": f"0:0,{t0 + 3}:-2", "n": 0, "h": 0, "f": t0})
    ids = [uuid7_at(t0 + i // 20) for i in range(120)]  # 20 per ms over 6 ms: 3 coarse, 3 fine
    await record(broker, view, ids[::2])  # half of them, the others stay new
    coarse = [k async for k in broker.redis.scan_iter(f"{view.keys.inbox}:b:0:*")]
    fine = [k async for k in broker.redis.scan_iter(f"{view.keys.inbox}:b:-2:*")]
    assert len(coarse) == 3 and 3 < len(fine) <= 12
    expected = [1 if i % 2 == 0 else 0 for i in range(120)]
    assert await claim(broker, view, ids) == expected
    assert await claim(broker, view, ids[::2]) == [1] * 60  # (the others are leased now)


async def _bytes_per_id(broker: RedisBroker, inbox: str, ids: int) -> float:
    used = 0
    async for key in broker.redis.scan_iter(f"{inbox}:*"):
        used += int(await broker.redis.memory_usage(key, samples=0) or 0) + 56
    return used / ids


@pytest.mark.parametrize("flat", ["0", "1"])
async def test_once_enabled_a_burst_is_recorded_in_buckets_finer_than_a_millisecond(
    broker: RedisBroker, flat: str
) -> None:
    """With ``fine = 1`` in the inbox's info (every worker reads such buckets), the ids of a burst
    (500 in one ms) are spread over buckets of about 64, each in the compact encoding, and found;
    ids that come slowly afterwards go back to buckets of several milliseconds."""
    view = await _view(broker, layout="hash")
    await broker.redis.hset(f"{view.keys.inbox}:info", mapping={"fine": "1", "flat": flat})
    kind, mark = ("a", ":a") if flat == "1" else ("b", "")
    t0 = (now_ms() // INBOX_SLOT_MS) * INBOX_SLOT_MS + 3000
    meta = f"{view.keys.inbox}:{inbox_slot(t0)}"
    burst = [uuid7_at(t0 + i // 500) for i in range(2000)]  # 4 ms of 500 ids each
    for i in range(0, len(burst), 500):
        await record(broker, view, burst[i : i + 500])
    assert await broker.redis.hget(meta, "r") == f"0:-3{mark}".encode()
    sizes = [await bucket_size(broker, k) async for k in broker.redis.scan_iter(f"{view.keys.inbox}:{kind}:*")]
    assert len(sizes) == 32 and max(sizes) <= 128, sizes  # 8 per ms, none past the compact size
    assert await _bytes_per_id(broker, view.keys.inbox, len(burst)) <= 32
    assert await claim(broker, view, burst) == [1] * len(burst)
    slow = [uuid7_at(t0 + 100 + 3 * i) for i in range(300)]  # one id per 3 ms, acked 10 at a time
    for i in range(0, len(slow), 10):
        await record(broker, view, slow[i : i + 10])
    regimes = (await broker.redis.hget(meta, "r")).decode().split(",")
    assert int(regimes[-1].split(":")[1]) >= 4, regimes  # 16 ms buckets or longer again
    assert await claim(broker, view, [*burst[::50], *slow]) == [1] * (40 + len(slow))
    assert await _bytes_per_id(broker, view.keys.inbox, len(burst) + len(slow)) <= 32


async def test_the_settings_turn_them_on_and_off_for_the_groups_a_process_subscribes(
    broker: RedisBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fine buckets are off by default (workers of earlier releases cannot read them); flat buckets
    are on for a new inbox (the first claim that stores the group's window marks it), and an inbox
    an earlier release used keeps what it has. ``1`` marks the groups a process subscribes, ``0``
    turns them off again (a new inbox too), unset leaves a group as it is."""

    async def info(name: str, *, claim_first: bool = True) -> tuple[bytes | None, bytes | None]:
        spec = await broker.declare(DestinationSpec(name, "command"))
        [view] = await broker.subscribe(spec, "g")
        if claim_first:
            await claim(broker, view, [uuid7_at(now_ms())], window_ms=60_000)
        got = await broker.redis.hmget(f"{view.keys.inbox}:info", "fine", "flat")
        return got[0], got[1]

    monkeypatch.delenv(INBOX_FINE_ENV, raising=False)
    monkeypatch.delenv(INBOX_FLAT_ENV, raising=False)
    assert await info("fine.new", claim_first=False) == (None, None)  # a subscribe alone writes nothing
    assert await info("fine.new") == (None, b"1")  # its first claim: a new inbox gets flat buckets
    # an inbox an earlier release used (its window stored, no flat field) keeps hash buckets
    inbox = broker.keyspace.partition("fine.old", 0).group("g").inbox
    await broker.redis.hset(f"{inbox}:info", "window", 60_000)
    assert await info("fine.old") == (None, None)
    monkeypatch.setenv(INBOX_FINE_ENV, "1")
    assert await info("fine.old") == (b"1", None)
    monkeypatch.setenv(INBOX_FLAT_ENV, "yes")
    assert await info("fine.old") == (b"1", b"1")
    monkeypatch.delenv(INBOX_FINE_ENV)
    monkeypatch.delenv(INBOX_FLAT_ENV)
    assert await info("fine.old") == (b"1", b"1")  # unset: left as it is
    monkeypatch.setenv(INBOX_FINE_ENV, "0")
    monkeypatch.setenv(INBOX_FLAT_ENV, "off")
    assert await info("fine.old") == (b"0", b"0")
    assert await info("fine.other") == (b"0", b"0")  # a new inbox too, where the setting says off
