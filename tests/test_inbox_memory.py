"""The inbox's memory (issue #15): processed ids in small compact buckets, whole buckets expiring,
the old zset read as a fallback, and the memory-budget warning (status and worker start)."""

from __future__ import annotations

import os
import random
from typing import Any

import anyio
import attrs
import pytest
import structlog

from broker import DestinationSpec, Envelope, connect, now_ms
from broker.ids import derive_id, new_id
from broker.protocol import GroupPartition
from broker.redis import RedisBroker
from broker.redis.effects import RedisEffects
from broker.redis.inspect import INBOX_BYTES_PER_ID, describe, inbox_memory
from broker.redis.keys import INBOX_SLOT_MS, compact_id, inbox_record, inbox_records, inbox_slot
from broker.redis.reading import claim_statuses
from framework import Service
from framework.cli.status import over_budget
from framework.settings import RuntimeSettings, inbox_memory_budget, parse_bytes
from framework.testing import TEST_SETTINGS, ServiceHarness
from tests.conftest import run_cli

pytestmark = pytest.mark.anyio


def uuid7_at(ms: int) -> str:
    """A UUIDv7 text id carrying ``ms`` (random otherwise)."""
    r = int.from_bytes(os.urandom(10), "big")
    v = (ms << 80) | (0x7 << 76) | (((r >> 62) & 0xFFF) << 64) | (0b10 << 62) | (r & ((1 << 62) - 1))
    h = f"{v:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


async def _view(broker: RedisBroker, name: str = "mem.q", layout: str = "hash") -> GroupPartition:
    """A new group's view; its inbox in hash buckets of a millisecond or more (as
    ``FRAMEWORK_INBOX_FLAT_BUCKETS=0`` leaves it), or with ``layout="flat"`` in flat buckets (what a
    new inbox gets by default) with ``FINE_BUCKETS=1`` too."""
    spec = await broker.declare(DestinationSpec(name, "command"))
    [view] = await broker.subscribe(spec, "g")
    layouts = {"fine": "1", "flat": "1"} if layout == "flat" else {"flat": "0"}
    await broker.redis.hset(f"{view.keys.inbox}:info", mapping=layouts)
    return view


LAYOUTS = pytest.mark.parametrize("layout", ["hash", "flat"])


async def bucket_size(broker: RedisBroker, key: str | bytes) -> int:
    """The ids a bucket holds: a hash's fields, a flat bucket's 13-byte fields."""
    if await broker.redis.type(key) == b"string":
        return int(await broker.redis.strlen(key)) // 13
    return int(await broker.redis.hlen(key))


async def record(broker: RedisBroker, view: GroupPartition, ids: list[str]) -> None:
    """Make ``ids`` final the way an ack does (ack.lua; the entry id is a stand-in)."""
    for i in range(0, len(ids), 1000):
        chunk = ids[i : i + 1000]
        args = [view.group, "0", now_ms(), 1, len(chunk), 0, "0-1", *chunk, inbox_records(chunk), 0]
        await broker.scripts["ack"](broker.redis, [view.stream, view.keys.inbox, view.keys.attempts], args)


async def claim(broker: RedisBroker, view: GroupPartition, ids: list[str], *, window_ms: int = 0) -> list[int]:
    """inbox_claim.lua on message ids alone (first deliveries)."""
    args = [now_ms(), 60_000, len(ids), window_ms, len(ids), *ids, inbox_records(ids)]
    return claim_statuses(await broker.scripts["inbox_claim"](broker.redis, [view.keys.inbox], args), len(ids))


async def bucket_keys(broker: RedisBroker, view: GroupPartition) -> list[bytes]:
    return [k async for k in broker.redis.scan_iter(f"{view.keys.inbox}:*", count=1000)]


async def test_compact_ids_follow_the_scripts_rule(broker: RedisBroker) -> None:
    v7 = uuid7_at(now_ms())
    assert compact_id(v7) == bytes.fromhex(v7.replace("-", "")) and len(compact_id(v7)) == 16
    assert compact_id(v7.upper()) == compact_id(v7)
    assert compact_id("m-1") == b"" and compact_id("0" * 36) == b""
    assert compact_id("0190a3f0-0000-4000-8000-000000000000") == b""  # a UUIDv4: the zset
    assert compact_id("0190a3f0-0000-7000-8000-00000000000g") == b""  # not hex
    # commit_effects.lua converts the text id itself: the same record as ack.lua's Python-made one
    view = await _view(broker)
    await record(broker, view, [v7])
    await broker.publish([Envelope(destination="mem.q", kind="command", type="t", body=b"{}", id=v7)])
    [d] = await broker.read(view, "c", 10, 10)
    assert await claim(broker, view, [v7]) == [1]
    assert await broker.commit_effects(d, RedisEffects.of(("SET", f"{view.keys.inbox}x", "1"))) is False
    other = uuid7_at(now_ms())
    await broker.publish([Envelope(destination="mem.q", kind="command", type="t", body=b"{}", id=other)])
    [d2] = await broker.read(view, "c", 10, 10)
    assert await claim(broker, view, [other]) == [0]  # leased
    assert await broker.commit_effects(d2, RedisEffects()) is True
    assert await claim(broker, view, [other]) == [1]  # the Lua-made record, found by the Python-made form
    assert await broker.redis.zscore(view.keys.inbox, other) is None  # its lease went with the commit


def test_a_batch_of_ids_gives_the_records_each_id_gives_alone() -> None:
    """The scripts take a batch's records from inbox_records (a fast path for the framework's own
    ids) and a commit's from inbox_record: the same id must give the same record either way, or
    a message recorded by one would not be found by the other."""
    own = [new_id() for _ in range(5)] + [derive_id(new_id(), "x") for _ in range(5)]
    a, b = own[0], own[1]
    odd = [
        "order-7",
        "0" * 36,
        "0190a3f0-0000-4000-8000-000000000000",  # a UUIDv4
        "0190a3f0-0000-7000-8000-00000000000g",  # not hex
        a.upper(),
        a[:35] + " ",
        a.replace("-", "") + "----",
        a[:8] + a[9] + "-" + a[10:],  # a dash out of place
        a[:-1],  # 35 and 37 characters: 72 together
        b + "0",
    ]
    for batch in [own, *([*own[:3], x, *own[3:]] for x in odd), odd, [a[:-1], b + "0"]]:
        assert inbox_records(batch) == b"".join(inbox_record(i) for i in batch), batch
    assert inbox_records(own) == b"".join(compact_id(i) for i in own)


@LAYOUTS
async def test_a_remembered_id_costs_at_most_32_bytes_in_compact_buckets(broker: RedisBroker, layout: str) -> None:
    view = await _view(broker, layout=layout)
    t = now_ms() // INBOX_SLOT_MS * INBOX_SLOT_MS
    n = 20_000
    # the slot before had as many ids: level 0 is sized from it (the steady state)
    await broker.redis.hset(f"{view.keys.inbox}:{inbox_slot(t - INBOX_SLOT_MS)}", "n", n)
    ids = [uuid7_at(t + i * 60_000 // n) for i in range(n)]
    await record(broker, view, ids)
    keys = await bucket_keys(broker, view)  # the buckets and the slot's info
    used = 0
    for key in keys:
        if key.endswith(b":k"):  # the slot's list of its buckets (a set), a few bytes per bucket
            assert await broker.redis.type(key) == b"set"
        elif b":a:" in key:  # a flat bucket: a string of 13-byte fields
            assert layout == "flat" and await broker.redis.type(key) == b"string"
            assert 0 < await broker.redis.strlen(key) < 128 * 13 and await broker.redis.strlen(key) % 13 == 0
        else:
            assert await broker.redis.object("encoding", key) == b"listpack"
            assert await broker.redis.hlen(key) < 128
        used += int(await broker.redis.memory_usage(key, samples=0)) + 56  # + keyspace and expiry entries
    assert used / n <= 32, f"{used / n:.1f} bytes per id"
    assert used / n <= INBOX_BYTES_PER_ID
    if layout == "flat":  # 13 per id, a share of each key's, and the room an APPEND leaves for the next
        assert used / n <= 20, f"{used / n:.1f} bytes per id"
    assert await claim(broker, view, ids[:500] + ids[-500:]) == [1] * 1000
    assert await claim(broker, view, [uuid7_at(t + 5) for _ in range(200)]) == [0] * 200


@LAYOUTS
async def test_a_rate_the_slot_was_not_sized_for_starts_smaller_buckets_and_every_id_is_found(
    broker: RedisBroker, layout: str
) -> None:
    view = await _view(broker, layout=layout)
    t = now_ms() // INBOX_SLOT_MS * INBOX_SLOT_MS + 1000
    await broker.redis.hset(f"{view.keys.inbox}:{inbox_slot(t - INBOX_SLOT_MS)}", "n", 100)  # a quiet slot before
    ids = [uuid7_at(t + i // 5) for i in range(5_000)]  # then 5 ids per ms, acked 10 at a time
    for i in range(0, len(ids), 10):
        await record(broker, view, ids[i : i + 10])
    await record(broker, view, ids[:1000])  # recorded again (an ack repeated): nothing changes
    meta = f"{view.keys.inbox}:{inbox_slot(t)}"
    regimes = (await broker.redis.hget(meta, "r")).decode().split(",")
    assert len(regimes) >= 2, regimes  # sized for the quiet slot (one bucket), then much smaller ones
    assert await broker.redis.hget(meta, "n") == b"5000"
    buckets = [f"{view.keys.inbox}:{k.decode()}" for k in await broker.redis.smembers(f"{meta}:k")]
    kind = ":b:" if layout == "hash" else ":a:"
    assert buckets and all(k.startswith(f"{view.keys.inbox}{kind}") for k in buckets)
    sizes = [await bucket_size(broker, k) for k in buckets]
    assert sum(sizes) == 5_000
    compact = sum(n for n in sizes if n <= 128)  # hash-max-listpack-entries' default
    assert compact >= 4_700, sizes  # only the bucket that overflowed before the switch is large
    assert await claim(broker, view, ids) == [1] * len(ids)
    assert (await inbox_memory(broker, view)).ids == 5_100  # with the quiet slot's 100
    assert await claim(broker, view, [uuid7_at(t + 3) for _ in range(100)]) == [0] * 100


@LAYOUTS
async def test_ids_of_a_burst_after_a_quiet_spell_are_found_where_they_were_written(
    broker: RedisBroker, layout: str
) -> None:
    """A quiet spell starts longer buckets; a burst right after overflows one and asks for the span
    of before: that drops the longer span no id was recorded in yet. The burst's ids must be
    written under the span they are looked up with (before the fix: written in the longer span's
    bucket, never found again: each a duplicate that would run again)."""
    view = await _view(broker, layout=layout)
    t = now_ms() // INBOX_SLOT_MS * INBOX_SLOT_MS - INBOX_SLOT_MS + 1000  # a slot of id time ahead
    await broker.redis.hset(f"{view.keys.inbox}:{inbox_slot(t - INBOX_SLOT_MS)}", "n", 64 * INBOX_SLOT_MS)
    await record(broker, view, [uuid7_at(t)])  # 64 ids/ms before: 1 ms buckets; alone here: longer ones
    meta = f"{view.keys.inbox}:{inbox_slot(t)}"
    assert len((await broker.redis.hget(meta, "r")).split(b",")) == 2
    burst = [uuid7_at(t + 10 + i // 70) for i in range(210)]  # 70 ids/ms: back to 1 ms buckets
    await record(broker, view, burst)
    assert await claim(broker, view, burst) == [1] * len(burst)
    if layout == "hash":
        assert await broker.redis.hget(meta, "r") == b"0:0"
    else:  # the longer span dropped as well; 70 ids per ms split each ms in two (S = -1)
        regimes = (await broker.redis.hget(meta, "r")).split(b",")
        assert all(int(r.split(b":")[1]) <= 0 for r in regimes), regimes


async def test_acks_out_of_id_order_after_a_burst_keep_buckets_compact(broker: RedisBroker) -> None:
    """A backlog drained at start (3,000 ids within 100 ms), then a steady 1.6 ids/ms acked 5 at a
    time out of id order (three workers, handlers of different lengths: up to 60 ms late): the
    buckets stay in the compact encoding and near 21 bytes per id. (The SQL soak at this rate once
    measured 33-38 bytes per id with buckets past 128 ids; sizing a longer span from the slot's
    rate instead of a still-filling bucket's count was the change that followed.)"""
    view = await _view(broker)
    rng = random.Random(7)
    t0 = now_ms() // INBOX_SLOT_MS * INBOX_SLOT_MS - INBOX_SLOT_MS + 1000  # a slot of id time ahead
    burst = [uuid7_at(t0 + i // 30) for i in range(3_000)]
    for i in range(0, len(burst), 500):
        await record(broker, view, burst[i : i + 500])
    times = [t0 + 1_000 + int(i / 1.6 + rng.random()) for i in range(40_000)]
    order = sorted(range(len(times)), key=lambda i: times[i] + rng.uniform(2, 60))
    steady = [uuid7_at(times[i]) for i in order]
    for i in range(0, len(steady), 5):
        await record(broker, view, steady[i : i + 5])
    used, large = 0, 0
    for key in await bucket_keys(broker, view):
        used += int(await broker.redis.memory_usage(key, samples=0)) + 56
        if b":b:" in key and await broker.redis.hlen(key) > 128:
            large += 1
    n = len(burst) + len(steady)
    assert large <= 2, f"{large} buckets past hash-max-listpack-entries"
    assert used / n <= 26, f"{used / n:.1f} bytes per id"
    assert await claim(broker, view, steady[:500] + burst[:100]) == [1] * 600


async def test_buckets_expire_whole_after_the_window(broker: RedisBroker) -> None:
    view = await _view(broker)
    first = uuid7_at(now_ms())
    assert await claim(broker, view, [first], window_ms=400) == [0]  # the window the group runs with
    await record(broker, view, [first])
    assert await claim(broker, view, [first]) == [1]
    keys = await bucket_keys(broker, view)
    ttls = {k: await broker.redis.pttl(k) for k in keys if not k.endswith(b":info")}
    # buckets: the window + a margin (a quarter of it); the slot's keys, which say where the
    # buckets are, a margin more
    assert ttls and all(0 < t <= (500 if b":b:" in k or b":a:" in k else 600) for k, t in ttls.items())
    await anyio.sleep(0.8)
    assert await claim(broker, view, [first]) == [0]  # forgotten: the buckets expired
    assert [k for k in await bucket_keys(broker, view) if not k.endswith(b":info")] == []


@LAYOUTS
async def test_an_id_recorded_between_expiry_writes_is_kept_the_window(broker: RedisBroker, layout: str) -> None:
    """A bucket's expiry is written when less than the window is left, not on every record (a
    write the AOF and replicas take on every ack); an id recorded in between is still kept at
    least the window: with the expiry written only when the bucket is made, the second id below
    would be forgotten 300 ms early."""
    view = await _view(broker, layout=layout)
    t = now_ms()
    a, x, b = uuid7_at(t), uuid7_at(t), uuid7_at(t)  # one bucket
    assert await claim(broker, view, [a, x, b], window_ms=2000) == [0, 0, 0]
    await record(broker, view, [a])
    [bucket] = [k for k in await bucket_keys(broker, view) if b":b:" in k or b":a:" in k]
    assert 2000 < await broker.redis.pttl(bucket) <= 2500  # the window + its margin (a quarter)
    await anyio.sleep(0.1)
    await record(broker, view, [x])  # over 2 s left: the expiry is not written again
    assert 2000 <= await broker.redis.pttl(bucket) <= 2450
    await anyio.sleep(0.7)
    recorded = anyio.current_time()
    await record(broker, view, [b])  # under 2 s left: written again
    assert await broker.redis.pttl(bucket) > 2400
    await anyio.sleep(1.9 - (anyio.current_time() - recorded))
    assert await claim(broker, view, [b, a]) == [1, 1]


async def test_old_zset_records_and_other_ids_are_still_duplicates(broker: RedisBroker) -> None:
    view = await _view(broker)
    legacy = uuid7_at(now_ms() - 3_600_000)
    await broker.redis.zadd(view.keys.inbox, {legacy: now_ms() - 1000})  # written before the buckets
    assert await claim(broker, view, [legacy]) == [1]
    await broker.redis.zadd(view.keys.inbox, {"order-6": now_ms() - 1000})  # an older client's record of an app id
    assert await claim(broker, view, ["order-6"]) == [1]
    await record(broker, view, ["order-7"])  # not a UUIDv7/v8: kept by its hash, not in the zset
    assert await broker.redis.zscore(view.keys.inbox, "order-7") is None
    assert await claim(broker, view, ["order-7", "order-8"]) == [1, 0]
    assert await broker.trim_inbox(view, now_ms() + 1) == 2  # the old records in the zset are trimmed as before


async def test_unsubscribe_deletes_the_buckets(broker: RedisBroker) -> None:
    view = await _view(broker)
    t = now_ms()
    await record(broker, view, [uuid7_at(t) for _ in range(300)])
    assert await bucket_keys(broker, view)
    await broker.unsubscribe(view.spec, "g")
    assert await bucket_keys(broker, view) == []


def test_the_budget_setting_and_sizes() -> None:
    assert RuntimeSettings().inbox_memory_budget == 256 * 2**20
    assert parse_bytes("512MiB") == 512 * 2**20 and parse_bytes("1.5 GB") == 1_500_000_000
    assert parse_bytes("1024") == 1024
    with pytest.raises(ValueError):
        parse_bytes("lots")
    os.environ["FRAMEWORK_INBOX_MEMORY_BUDGET"] = "1GiB"
    try:
        assert inbox_memory_budget() == 2**30 and RuntimeSettings().inbox_memory_budget == 2**30
    finally:
        del os.environ["FRAMEWORK_INBOX_MEMORY_BUDGET"]


async def _busy_group(broker: RedisBroker, view: GroupPartition, per_slot: int) -> None:
    """Slot counts of a group that recorded ``per_slot`` ids in each of the last complete slots."""
    now = now_ms()
    for back in range(1, 5):
        await broker.redis.hset(f"{view.keys.inbox}:{inbox_slot(now - back * INBOX_SLOT_MS)}", "n", per_slot)


async def test_status_flags_a_group_past_its_memory_budget(redis_url: str, namespace: str, broker: RedisBroker) -> None:
    spec = await broker.declare(DestinationSpec("mem.busy", "command"))
    [view] = await broker.subscribe(spec, "billing")
    await broker.redis.hset(f"{view.keys.inbox}:info", "window", 7 * 24 * 3600 * 1000)
    await _busy_group(broker, view, 400 * INBOX_SLOT_MS // 1000)  # 400 ids/s
    [state] = await describe(broker, ["mem.busy"])
    [group] = state.to_json()["groups"]
    assert group["inbox_ids_per_s"] == pytest.approx(400, rel=0.01)
    expected = 400 * 7 * 24 * 3600 * INBOX_BYTES_PER_ID  # bytes per id x rate x window
    assert group["inbox_bytes"] == pytest.approx(expected, rel=0.01)
    assert group["inbox_bytes_per_id"] == INBOX_BYTES_PER_ID
    [line] = over_budget([state], 256 * 2**20)
    assert "'billing'" in line and "'mem.busy'" in line and "400.0 ids/s" in line
    assert over_budget([state], 2**40) == []
    env = {**os.environ, "REDIS_URL": redis_url, "FRAMEWORK_NAMESPACE": namespace}
    out = run_cli("status", "mem.busy", env=env)
    assert out.returncode == 0, out.stderr
    assert "inbox" in out.stdout and "more than the 256.0 MiB budget" in out.stdout
    assert f"({INBOX_BYTES_PER_ID} B/id)" in out.stdout.replace("\n", "")
    quiet = run_cli("status", "mem.busy", "--inbox-budget", "1TiB", env=env)
    assert "budget" not in quiet.stdout


async def test_a_worker_warns_at_start_when_the_inbox_outgrows_its_budget(redis_url: str, namespace: str) -> None:
    svc = Service("budget")

    @svc.command("mem.work")
    async def handle(cmd: dict) -> None:
        pass

    events: list[dict[str, Any]] = []
    settings = attrs.evolve(TEST_SETTINGS, inbox_memory_budget=1 * 2**20, inbox_window=24 * 3600.0)
    broker = await connect(redis_url, namespace=namespace)
    try:
        spec = await broker.declare(DestinationSpec("mem.work", "command"))
        view = broker.group_partition(spec, 0, "budget")
        await _busy_group(broker, view, 10 * INBOX_SLOT_MS // 1000)  # 10 ids/s x 1 day x 24 B = 19.8 MiB
    finally:
        await broker.close()
    with structlog.testing.capture_logs() as logs:
        async with ServiceHarness([svc], url=redis_url, namespace=namespace, settings=settings) as h:
            await h.client.send("mem.work", {})
            await h.run_until_idle()
        events = [e for e in logs if "budget" in e["event"]]
    assert len(events) == 1, logs
    [warning] = events
    assert warning["log_level"] == "warning" and warning["ids_per_s"] == pytest.approx(10, rel=0.01)
    assert warning["inbox_mib"] > warning["budget_mib"] == 1.0


async def test_the_leased_read_makes_the_records_python_makes(broker: RedisBroker) -> None:
    """intake.lua derives each id's record itself: for every shape of id it must be the record the
    ack (Python) wrote, or a processed message read again would run again."""
    view = await _view(broker, "mem.shapes")
    v7 = new_id()
    odd = [
        v7,
        v7.upper(),
        derive_id(new_id(), "x"),
        "0190a3f0-0000-4000-8000-000000000000",  # a UUIDv4
        "0190a3f0-0000-7000-8000-00000000000g",  # not hex
        v7[:8] + v7[9] + "-" + v7[10:],  # a dash out of place
        "order-7",
        "naïve-ü-42",
        "x" * 300,
    ]
    await record(broker, view, odd)
    await broker.publish([Envelope(destination="mem.shapes", kind="command", type="t", body=b"{}", id=i) for i in odd])
    got = await broker.read_leased(view, "c", 100, 0, lease_ms=60_000)
    assert [d.message_id for d in got] == odd
    assert [d.inbox_status for d in got] == [1] * len(odd)


async def test_application_ids_cost_at_most_32_bytes(broker: RedisBroker) -> None:
    """Ids the application chose (not UUIDv7/v8) are kept by a 128-bit hash in compact buckets:
    at most 32 bytes each, found again, new ones not mistaken for them (issue #33)."""
    view = await _view(broker, "mem.app")
    n = 20_000
    ids = [f"m{i:07d}" for i in range(n)]
    for i in range(0, n, 500):
        await record(broker, view, ids[i : i + 500])
    keys = [k async for k in broker.redis.scan_iter(f"{view.keys.inbox}:h*", count=1000)]
    used = sum([int(await broker.redis.memory_usage(k, samples=0)) + 56 for k in keys])  # + keyspace, expiry
    assert used / n <= 32, f"{used / n:.1f} bytes per id"
    assert await broker.redis.zcard(view.keys.inbox) == 0  # nothing in the zset
    assert await claim(broker, view, random.sample(ids, 1000)) == [1] * 1000
    assert await claim(broker, view, [f"m{i:07d}" for i in range(n, n + 1000)]) == [0] * 1000
    memory = await inbox_memory(broker, view)
    assert memory.bucket_ids == n and memory.ids == n + 1000  # (the zset holds the 1000 new leases)
    await broker.unsubscribe(view.spec, "g")
    assert [k async for k in broker.redis.scan_iter(f"{view.keys.inbox}*", count=1000)] == []
