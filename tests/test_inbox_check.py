"""The inbox check's shortcuts (issue #33): a batch newer than every id recorded in its slot is
not read id by id, and nothing recorded is ever missed for it (a duplicate that ran again)."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from broker import Envelope, now_ms
from broker.ids import new_id
from broker.protocol import GroupPartition
from broker.redis import RedisBroker
from broker.redis.keys import INBOX_SLOT_MS, inbox_records, inbox_records_spanned
from broker.redis.reading import claim_statuses
from tests.test_inbox_memory import _view, claim, record, uuid7_at

pytestmark = pytest.mark.anyio


async def claim_reply(broker: RedisBroker, view: GroupPartition, ids: list[str]) -> Any:
    """inbox_claim.lua's reply as the worker calls it: with the batch's id-time span when it has one."""
    records, span = inbox_records_spanned(ids)
    args = [now_ms(), 60_000, len(ids), 0, len(ids), *ids, records, *(span or ())]
    return await broker.scripts["inbox_claim"](broker.redis, [view.keys.inbox], args)


async def claim_spanned(broker: RedisBroker, view: GroupPartition, ids: list[str]) -> list[int]:
    return claim_statuses(await claim_reply(broker, view, ids), len(ids))


def test_the_span_is_given_only_when_text_order_is_time_order() -> None:
    ids = [uuid7_at(1_700_000_000_000 + k) for k in (5, 1, 9, 3)]
    records, span = inbox_records_spanned(ids)
    assert records == inbox_records(ids)
    assert span == (1_700_000_000_001, 1_700_000_000_009)
    assert inbox_records_spanned([*ids, ids[0].upper()])[1] is None  # (upper-case hex sorts before lower)
    assert inbox_records_spanned([*ids, "order-7"])[1] is None  # kept by its hash: no time
    assert inbox_records_spanned([])[1] is None


@pytest.mark.parametrize("spanned", [True, False], ids=["worker's call", "no span"])
async def test_a_batch_reaching_the_newest_recorded_id_still_finds_it(broker: RedisBroker, spanned: bool) -> None:
    """The shortcut compares with the slot's highest recorded time (h): an id at exactly that time,
    or below it, is looked up; only ids above it are known new without a lookup."""
    view = await _view(broker)
    check = claim_spanned if spanned else claim
    t0 = (now_ms() // INBOX_SLOT_MS) * INBOX_SLOT_MS + 1000  # (inside one slot)
    done = [uuid7_at(t0 + k) for k in range(50)]
    await record(broker, view, done)
    newest = done[-1]
    same_ms = uuid7_at(t0 + 49)  # the newest recorded id's millisecond, not recorded itself
    newer = [uuid7_at(t0 + 50 + k) for k in range(20)]
    assert await check(broker, view, [newest, same_ms, *newer]) == [1, 0, *[0] * 20]
    assert await check(broker, view, [*newer[:5], done[0], done[25]]) == [2] * 5 + [1, 1]  # (5 leased above)
    fresh = [uuid7_at(t0 + 100 + k) for k in range(20)]
    assert await check(broker, view, fresh) == [0] * 20  # all above h: the shortcut's case


async def test_an_all_new_batch_is_answered_with_its_count(broker: RedisBroker) -> None:
    """The claim's reply for a batch it leased whole is the count (claim_statuses expands it); any
    other status makes it a list, so a duplicate is never hidden in the short form."""
    view = await _view(broker)
    ids = [new_id() for _ in range(30)]
    assert await claim_reply(broker, view, ids) == 30
    await record(broker, view, ids[:1])
    assert await claim_reply(broker, view, [ids[0], new_id()]) == [1, 0]
    assert claim_statuses(3, 3) == [0, 0, 0] and claim_statuses([b"1", 2], 2) == [1, 2]


async def test_a_batch_over_two_slots_finds_what_either_slot_recorded(broker: RedisBroker) -> None:
    """The span's shortcut holds for one slot only: an older slot's h says nothing of a newer one."""
    view = await _view(broker)
    edge = (now_ms() // INBOX_SLOT_MS) * INBOX_SLOT_MS  # the first ms of this slot
    before = [uuid7_at(edge - 10 + k) for k in range(5)]  # the slot before, its last ms
    later = uuid7_at(edge + 3)
    await record(broker, view, [*before, later])
    assert await claim_spanned(broker, view, [uuid7_at(edge - 2), later]) == [0, 1]
    after = [uuid7_at(edge + 10 + k) for k in range(5)]
    assert await claim_spanned(broker, view, [*after, before[2]]) == [0] * 5 + [1]


async def test_redeliveries_mixed_with_first_deliveries_get_their_own_statuses(broker: RedisBroker) -> None:
    """The claim takes first deliveries first (they respect a live lease held elsewhere) and maps
    the statuses back to the caller's order."""
    view = await _view(broker, "mix.q")
    ids = [new_id() for _ in range(4)]
    await broker.publish([Envelope(destination="mix.q", kind="command", type="C", body=b"{}", id=i) for i in ids])
    held = await broker.read(view, "a", 10, 10)
    assert [d.message_id for d in held] == ids
    assert await broker.inbox_claim(view, held[:2], 60_000) == [0, 0]  # leased to us, live
    await record(broker, view, [ids[3]])
    mixed = [held[3], attrs.evolve(held[1], delivery_count=2), held[0], held[2]]
    # held[3] recorded: a duplicate; the redelivered held[1] takes its lease over; held[0], a first
    # delivery, meets a live lease; held[2] is new
    assert await broker.inbox_claim(view, mixed, 60_000) == [1, 0, 2, 0]


async def test_the_leased_read_derives_every_ids_record_as_the_worker_does(broker: RedisBroker) -> None:
    """intake.lua computes each read id's record in Lua (inbox_record_of); an id recorded from the
    worker's records (broker.redis.keys.inbox_record) must be found by it, in every form an id
    takes: lower and upper case UUIDv7s, v8, v4 (hashed), near-UUIDs and application ids."""
    view = await _view(broker, "rec.q")
    v7 = uuid7_at(now_ms() - 5_000)
    v8 = v7[:14] + "8" + v7[15:]
    forms = [
        v7,
        uuid7_at(now_ms() - 4_000).upper(),
        v8,
        "0193aabb-ccdd-4eef-8899-aabbccddeeff",
        v7.replace("-", ""),
        v7[:35] + "g",
        " " + v7[1:],
        "-" + v7[1:],
        "order-17",
        "ü-42",
    ]
    fresh = [uuid7_at(now_ms() - 3_000), "order-18"]
    await record(broker, view, forms)
    ids = [*forms, *fresh]
    await broker.publish([Envelope(destination="rec.q", kind="command", type="C", body=b"{}", id=i) for i in ids])
    read = await broker.read_leased(view, "c", 100, 0, lease_ms=60_000, window_ms=0)
    assert [d.message_id for d in read] == ids
    assert [d.inbox_status for d in read] == [1] * len(forms) + [0] * len(fresh)


@pytest.mark.parametrize("spanned", [True, False], ids=["worker's call", "no span"])
async def test_copies_of_a_new_id_in_one_batch_run_once_and_every_new_id_is_leased(
    broker: RedisBroker, spanned: bool
) -> None:
    """A batch of new ids (none recorded, none leased) is leased without a status per id; copies of
    one id in it still get one run (0) and a wait (2), and every id holds a live lease after."""
    view = await _view(broker)
    check = claim_spanned if spanned else claim
    t0 = now_ms()
    ids = [uuid7_at(t0 + k) for k in range(6)]
    assert await check(broker, view, [ids[0], ids[1], ids[0], ids[2], ids[0]]) == [0, 0, 2, 0, 2]
    scores = await broker.redis.zmscore(view.keys.inbox, ids)
    assert all(s is not None and -s > now_ms() + 50_000 for s in scores[:3])  # leased for the 60 s asked
    assert scores[3:] == [None, None, None]
    assert await check(broker, view, ids[3:]) == [0, 0, 0]
    assert await check(broker, view, ids) == [2] * 6  # all leased now, elsewhere for a first delivery
