"""The Redis transport beyond the contract: what only Redis stores or offers, and the protocols kept honest.

The transport-neutral promises of ``broker/protocol.py`` are checked on every transport by the
conformance kit (``tests/test_broker_conformance.py``). Here: what can only be seen in Redis keys
(idempotency keys' expiry, inbox leases, entry id order), the ``redis`` capability
(``commit_effects`` of the recorder behind ``ctx.redis_transaction()``: Redis commands with a guard,
the shared-write batchers, ``read_shared``/``read_hashes`` behind the state store's reads, the
``cluster`` flag), and the structure checks: RedisBroker has
every member of the core protocol and of each capability it declares, its role mixins define
each name once, and framework code calls on a broker nothing beyond those protocols.
"""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path
from typing import Any

import anyio
import attrs
import orjson
import pytest

from broker import Broker, DestinationSpec, EffectsFailed, Envelope, new_id, now_ms
from broker.capabilities import RedisStore, StateStore, as_redis
from broker.codec import encode_fields
from broker.conformance.members import CAPABILITY_PROTOCOLS, member_problems, protocol_members
from broker.headers import DELIVER_AT
from broker.redis import RedisBroker
from broker.redis.broker import ROLES
from broker.redis.effects import RedisEffects, as_bytes, msgpack_strings
from broker.state import DeleteKey, ExpireKey, ScheduleMessage, SetFields

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent


def event(topic: str, n: int, key: str | None = None) -> Envelope:
    return Envelope(destination=topic, kind="event", type="T", body=orjson.dumps({"n": n}), key=key)


def command(queue: str, n: int, key: str | None = None) -> Envelope:
    return Envelope(destination=queue, kind="command", type="C", body=orjson.dumps({"n": n}), key=key)


def numbers(deliveries: list) -> list[int]:
    return [orjson.loads(d.envelope.body)["n"] for d in deliveries]


# -- what only the keys show -----------------------------------------------------------------------


async def test_entry_ids_of_a_mixed_batch_increase_in_stream_order(broker: RedisBroker) -> None:
    """Stream entry ids (``ms-seq``) of a batch mixing plain and idempotent appends increase in order."""
    spec = await broker.declare(DestinationSpec("billing.refund", "command"))
    [view] = await broker.subscribe(spec, "billing")
    batch = [command("billing.refund", i) for i in range(6)]
    batch[2].headers["idempotency-key"] = "k-2"
    batch[4].headers["idempotency-key"] = "k-4"
    ids = await broker.publish(batch)
    assert all(ids) and ids == sorted(ids, key=lambda i: tuple(int(x) for x in i.split("-")))  # type: ignore[union-attr]
    assert numbers(await broker.read(view, "c", 10, 10)) == [0, 1, 2, 3, 4, 5]


async def test_idempotency_key_expires_with_its_window_and_expired_keys_are_removed(broker: RedisBroker) -> None:
    spec = await broker.declare(DestinationSpec("billing.refund", "command"))
    [view] = await broker.subscribe(spec, "billing")
    published = broker.keyspace.partition("billing.refund", 0).published
    window = 400  # ms: short, with room for a slow machine between the first publishes

    def once(n: int, idem: str) -> Envelope:
        env = command("billing.refund", n)
        env.headers["idempotency-key"] = idem
        return env

    before = now_ms()
    assert (await broker.publish([once(1, "a"), once(2, "b")], dedup_window_ms=window))[0] is not None
    expiry = await broker.redis.zscore(published, "a")
    assert before + window <= expiry <= now_ms() + window  # the score is the key's expiry
    assert await broker.redis.pttl(published) > 0  # the zset goes away by itself once every key expired
    assert await broker.publish([once(3, "a")], dedup_window_ms=window) == [None]  # inside the window
    assert await broker.publish([once(4, "a")], dedup_window_ms=60_000) == [None]  # its own window counts
    while now_ms() <= expiry:
        await anyio.sleep(0.05)
    assert (await broker.publish([once(5, "a")], dedup_window_ms=window))[0] is not None  # expired: stored again
    assert await broker.redis.zscore(published, "b") is None  # expired records go on the next keyed publish
    assert await broker.redis.zcard(published) == 1
    assert numbers(await broker.read(view, "c", 10, 10)) == [1, 2, 5]
    expiry = await broker.redis.zscore(published, "a")
    while now_ms() <= expiry:
        await anyio.sleep(0.05)
    await broker.trim(spec, 0, now_ms())  # and on the retention job's runs
    assert await broker.redis.zcard(published) == 0


async def test_an_acked_inbox_lease_leaves_the_zset(broker: RedisBroker) -> None:
    """A UUIDv7 id is recorded in the inbox's buckets (they expire a window after their last write,
    tests/test_inbox_memory.py); its lease is gone from the zset, which the trimmer keeps small."""
    spec = await broker.declare(DestinationSpec("billing.refund", "command"))
    [view] = await broker.subscribe(spec, "billing")
    original = command("billing.refund", 1)
    await broker.publish([original])
    [first] = await broker.read(view, "a", 10, 10)
    assert await broker.inbox_claim(view, [first], 60_000) == [0]
    assert await broker.redis.zscore(view.keys.inbox, original.id) is not None  # leased while it runs
    await broker.ack(view, [first], inbox=True)
    assert await broker.redis.zscore(view.keys.inbox, original.id) is None
    assert await broker.trim_inbox(view, now_ms() + 1) == 0


# -- the redis capability: effects committed with the ack --------------------------------------------


async def effects_fixture(broker: RedisBroker, namespace: str) -> tuple:
    spec = await broker.declare(DestinationSpec("wallet.credit", "command"))
    [view] = await broker.subscribe(spec, "wallet")
    await broker.publish([command("wallet.credit", 100)])
    [d] = await broker.read(view, "a", 10, 10)
    assert await broker.inbox_claim(view, [d], 60_000) == [0]  # leased to us
    balances, wrong = f"{namespace}:{{x}}:balances", f"{namespace}:{{x}}:not-a-hash"
    await broker.redis.set(wrong, "a string")
    return view, d, balances, wrong


async def test_effects_failing_half_way_are_dead_lettered_once_and_never_applied_again(
    broker: RedisBroker, namespace: str
) -> None:
    view, d, balances, wrong = await effects_fixture(broker, namespace)
    commands = [("HINCRBY", balances, "a", 100), ("HSET", wrong, "f", "v"), ("HINCRBY", balances, "b", 1)]
    outgoing = [event("wallet.credited", 1)]
    reason = {"dlq-handler": "wallet.credit", "dlq-attempts": "1", "dlq-reason": "overwritten by the script"}
    with pytest.raises(EffectsFailed) as failed:
        await broker.commit_effects(d, RedisEffects.of(*commands), outgoing, reason=reason)
    assert failed.value.applied == 1 and failed.value.error.startswith("WRONGTYPE")
    assert await broker.redis.hgetall(balances) == {b"a": b"100"}  # the first write stays: no rollback
    [(dlq_id, fields)] = await broker.dead_letter_entries(view)
    assert failed.value.dlq_entry == dlq_id
    assert fields[b"id"] == d.envelope.id.encode() and fields[b"body"] == d.fields[b"body"]
    assert fields[b"dlq-handler"] == b"wallet.credit" and fields[b"dlq-attempts"] == b"1"
    why = fields[b"dlq-reason"].decode()
    assert why.startswith("effects partially applied: Redis command 2 of 3 (HSET) failed: WRONGTYPE")
    assert "the 1 command(s) before it were applied and are not rolled back" in why
    assert fields[b"dlq-error-type"] == b"redis.exceptions.ResponseError"
    assert fields[b"dlq-error-message"].startswith(b"WRONGTYPE")
    assert list(fields).count(b"dlq-reason") == 1
    # the fields the script fills in: where the entry was, when it died, when it first failed (now:
    # the message carried no first-failed-at and the caller gave none)
    assert fields[b"dlq-entry-id"] == d.entry_id.encode()
    assert abs(int(fields[b"dlq-dead-at"]) - now_ms()) < 60_000
    assert fields[b"dlq-first-failed-at"] == fields[b"dlq-dead-at"]
    assert (await broker.stream_groups(view.stream))[0]["pending"] == 0  # acked
    assert await broker.redis.xlen(view.stream) == 0  # and deleted (a queue)
    assert await broker.redis.zscore(view.keys.inbox, d.message_id) is None  # lease released, nothing final
    assert await broker.redis.hexists(view.keys.attempts, d.message_id) == 0
    credited = await broker.get_destination("wallet.credited")
    assert credited is None or await broker.redis.xlen(broker.keyspace.partition("wallet.credited", 0).stream) == 0

    # the same commit again (a retry, a second consumer): the entry is settled, nothing is applied
    assert await broker.commit_effects(d, RedisEffects.of(*commands[:1]), reason=reason) is False
    assert await broker.redis.hgetall(balances) == {b"a": b"100"}
    assert len(await broker.dead_letter_entries(view)) == 1

    # a redrive runs the handler again (the inbox did not record the message as processed)
    assert await broker.redrive(view, dlq_id)
    [again] = await broker.read(view, "a", 10, 10)
    assert again.message_id == d.message_id and await broker.inbox_claim(view, [again], 60_000) == [0]


async def test_effects_failing_at_the_first_command_are_dead_lettered_with_nothing_applied(
    broker: RedisBroker, namespace: str
) -> None:
    view, d, balances, wrong = await effects_fixture(broker, namespace)
    with pytest.raises(EffectsFailed) as failed:
        await broker.commit_effects(d, RedisEffects.of(("HSET", wrong, "f", "v"), ("HINCRBY", balances, "a", 1)))
    assert failed.value.applied == 0 and await broker.redis.exists(balances) == 0
    [(_, fields)] = await broker.dead_letter_entries(view)
    assert fields[b"dlq-reason"].startswith(b"effects not applied: Redis command 1 of 2 (HSET) failed: WRONGTYPE")
    assert (await broker.stream_groups(view.stream))[0]["pending"] == 0
    assert await broker.redis.zscore(view.keys.inbox, d.message_id) is None


async def test_effects_dead_letters_keep_when_the_message_first_failed(broker: RedisBroker, namespace: str) -> None:
    """A retried copy carries its first failure's time; the dead letter reports it (or the caller's)."""
    spec = await broker.declare(DestinationSpec("wallet.credit", "command"))
    [view] = await broker.subscribe(spec, "wallet")
    wrong = f"{namespace}:{{x}}:not-a-hash"
    await broker.redis.set(wrong, "a string")
    flat = encode_fields(command("wallet.credit", 1))  # as retry_later parks a copy: with first-failed-at
    parked = dict(zip(flat[::2], flat[1::2], strict=True))
    await broker.redis.xadd(view.stream, {**parked, "first-failed-at": "1700000000000"})
    await broker.publish([command("wallet.credit", 2)])
    first, second = await broker.read(view, "a", 10, 10)
    with pytest.raises(EffectsFailed):
        await broker.commit_effects(first, RedisEffects.of(("HSET", wrong, "f", "v")))
    with pytest.raises(EffectsFailed):
        await broker.commit_effects(
            second, RedisEffects.of(("HSET", wrong, "f", "v")), reason={"dlq-first-failed-at": "1700000000123"}
        )
    letters = {fields[b"dlq-entry-id"]: fields for _, fields in await broker.dead_letter_entries(view)}
    assert letters[first.entry_id.encode()][b"dlq-first-failed-at"] == b"1700000000000"
    assert letters[second.entry_id.encode()][b"dlq-first-failed-at"] == b"1700000000123"
    assert all(list(f).count(b"dlq-first-failed-at") == 1 for f in letters.values())


async def test_effects_of_a_deleted_entry_are_dead_lettered_as_empty(broker: RedisBroker, namespace: str) -> None:
    view, d, balances, wrong = await effects_fixture(broker, namespace)
    await broker.redis.xdel(view.stream, d.entry_id)  # gone while pending
    with pytest.raises(EffectsFailed):
        await broker.commit_effects(d, RedisEffects.of(("HINCRBY", balances, "a", 1), ("LPUSH", wrong, "x")))
    [(_, fields)] = await broker.dead_letter_entries(view)
    assert fields[b"dlq-empty"] == b"1" and b"(LPUSH)" in fields[b"dlq-reason"]


async def test_concurrent_commits_share_writes_and_keep_their_own_outcomes(broker: RedisBroker, namespace: str) -> None:
    """150 handlers commit at once (sent in shared writes): each gets its own outcome, as if alone."""
    spec = await broker.declare(DestinationSpec("wallet.batch", "command"))
    [view] = await broker.subscribe(spec, "wallet")
    await broker.publish([command("wallet.batch", n) for n in range(150)])
    deliveries = await broker.read(view, "a", 200, 10)
    assert len(deliveries) == 150 and await broker.inbox_claim(view, deliveries, 60_000) == [0] * 150
    balances, wrong = f"{namespace}:{{x}}:balances", f"{namespace}:{{x}}:not-a-hash"
    await broker.redis.set(wrong, "a string")
    outcomes: dict[int, object] = {}

    async def commit(i: int, d: object) -> None:
        tx = broker.effects()
        if i % 5 == 0:  # a guard that does not hold: nothing written, the entry stays pending
            tx.expect(balances, "guard", "x")
            tx.hincrby(balances, "n", 1)
        elif i % 5 == 1:  # fails half-way: dead-lettered by the same call
            tx.hincrby(balances, "partial", 1)
            tx.hset(wrong, "f", "v")
        else:
            tx.hincrby(balances, "n", 1)
        try:
            outcomes[i] = await broker.commit_effects(d, tx)  # type: ignore[arg-type]
        except Exception as exc:
            outcomes[i] = type(exc).__name__

    with anyio.fail_after(30):  # (a batcher that lost track of its writes would hang here)
        async with anyio.create_task_group() as tg:
            for i, d in enumerate(deliveries):
                tg.start_soon(commit, i, d)
    assert {i: o for i, o in outcomes.items() if i % 5 == 0} == {i: "EffectsConflict" for i in range(0, 150, 5)}
    assert {i: o for i, o in outcomes.items() if i % 5 == 1} == {i: "EffectsFailed" for i in range(1, 150, 5)}
    assert all(outcomes[i] is True for i in range(150) if i % 5 > 1)
    assert await broker.redis.hgetall(balances) == {b"n": b"90", b"partial": b"30"}
    assert len(await broker.dead_letter_entries(view)) == 30
    assert (await broker.stream_groups(view.stream))[0]["pending"] == 30  # the conflicts, to run again
    assert await broker.commit_effects(deliveries[2], RedisEffects.of(("HINCRBY", balances, "n", 1))) is False
    assert await broker.redis.hget(balances, "n") == b"90"  # a duplicate applies nothing
    if isinstance(broker, RedisBroker) and not broker.cluster:
        batcher = broker._commit_batcher()
        assert batcher.calls == 151 and batcher.batches < 100  # calls made together shared writes
        assert batcher._busy == 0 and not batcher._queue


async def test_cancelled_commits_leave_the_shared_writes_working(broker: RedisBroker, namespace: str) -> None:
    """Callers cancelled while their commit waits or is in flight never block the commits after them."""
    spec = await broker.declare(DestinationSpec("wallet.cancel", "command"))
    [view] = await broker.subscribe(spec, "wallet")
    await broker.publish([command("wallet.cancel", n) for n in range(120)])
    deliveries = await broker.read(view, "a", 200, 10)
    await broker.inbox_claim(view, deliveries, 60_000)
    counts = f"{namespace}:{{x}}:counts"
    for round_ in range(5):  # cancelled at different points of the writes in flight
        with anyio.move_on_after(0.001 * round_):
            async with anyio.create_task_group() as tg:
                for d in deliveries[round_ * 20 : round_ * 20 + 20]:
                    tg.start_soon(broker.commit_effects, d, RedisEffects.of(("HINCRBY", counts, d.message_id, 1)))
    with anyio.fail_after(10):  # the rest go through, each applied once
        async with anyio.create_task_group() as tg:
            for d in deliveries[100:]:
                tg.start_soon(broker.commit_effects, d, RedisEffects.of(("HINCRBY", counts, d.message_id, 1)))
    values = await broker.redis.hgetall(counts)
    assert all(v == b"1" for v in values.values())  # sent or not, never twice
    assert {d.message_id.encode() for d in deliveries[100:]} <= set(values)
    if isinstance(broker, RedisBroker) and not broker.cluster:
        batcher = broker._commit_batcher()
        assert batcher._busy == 0 and not batcher._queue


async def _three_for_the_batcher(broker: RedisBroker, destination: str) -> tuple[Any, list[Any]]:
    """Three commands on ``destination`` read by group ``wallet``: its view and the deliveries
    (skips where there is no batcher)."""
    if not isinstance(broker, RedisBroker) or broker.cluster:
        pytest.skip("the batcher is the Redis broker's")
    spec = await broker.declare(DestinationSpec(destination, "command"))
    [view] = await broker.subscribe(spec, "wallet")
    await broker.publish([command(destination, n) for n in range(3)])
    return view, await broker.read(view, "a", 10, 10)


async def test_a_caller_cancelled_as_it_is_handed_the_next_write_passes_it_on(
    broker: RedisBroker, namespace: str
) -> None:
    """The race the batcher must survive: a waiting caller is handed the next write (a slot) and is
    cancelled before it runs; the callers queued behind it still get through."""
    view, (a, b, c) = await _three_for_the_batcher(broker, "wallet.race")
    await broker.inbox_claim(view, [a, b, c], 60_000)
    counts = f"{namespace}:{{x}}:counts"
    batcher = broker._commit_batcher()
    assert batcher is not None
    batcher.width = 1  # one write in flight: b and c wait behind a
    tasks: dict[str, asyncio.Task[Any]] = {}

    async def first() -> None:
        await broker.commit_effects(a, RedisEffects.of(("HINCRBY", counts, "a", 1)))
        # b was handed the slot as a's write ended and has not run yet: cancel it now, as an
        # asyncio timeout (a handler's) would (anyio's scopes wait until it has run)
        tasks["b"].cancel()

    with anyio.fail_after(10):
        tasks["a"] = asyncio.create_task(first())
        await asyncio.sleep(0)  # a's write is in flight
        for name, d in (("b", b), ("c", c)):
            tasks[name] = asyncio.create_task(broker.commit_effects(d, RedisEffects.of(("HINCRBY", counts, name, 1))))
        await asyncio.wait(tasks.values())
    assert tasks["b"].cancelled() and tasks["c"].result() is True
    assert await broker.redis.hgetall(counts) == {b"a": b"1", b"c": b"1"}  # b's was never sent
    assert batcher._busy == 0 and not batcher._queue


async def test_two_copies_committed_in_one_script_call_apply_once(broker: RedisBroker, namespace: str) -> None:
    """Two entries of one message (a copy published twice) whose commits share a script call: the
    first applies, the second is the duplicate (the inbox record of the first is not written yet)."""
    if not isinstance(broker, RedisBroker) or broker.cluster:
        pytest.skip("the batcher is the Redis broker's")
    spec = await broker.declare(DestinationSpec("wallet.copies", "command"))
    [view] = await broker.subscribe(spec, "wallet")
    copy = command("wallet.copies", 1)
    await broker.publish([command("wallet.copies", 0), copy, copy])
    first, one, again = await broker.read(view, "a", 10, 10)
    assert one.message_id == again.message_id != first.message_id
    counts = f"{namespace}:{{x}}:counts"
    batcher = broker._commit_batcher()
    assert batcher is not None
    batcher.width = 1  # the copies queue behind the first write and go out together
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for d in (first, one, again):
                tg.start_soon(broker.commit_effects, d, RedisEffects.of(("HINCRBY", counts, d.message_id, 1)))
    assert batcher.calls == 3 and batcher.batches == 2
    assert await broker.redis.hget(counts, one.message_id) == b"1"  # applied once
    assert (await broker.stream_groups(view.stream))[0]["pending"] == 0  # both entries acked


async def test_one_entry_committed_twice_in_one_script_call_applies_once(broker: RedisBroker, namespace: str) -> None:
    """A commit repeated for the same entry in the same script call: the second finds the entry
    settled and applies nothing; the call settles each entry, its attempts counter included."""
    view, (first, one, other) = await _three_for_the_batcher(broker, "wallet.twice")
    counts = f"{namespace}:{{x}}:counts"
    for d in (one, other):
        await broker.count_attempt(d)
    batcher = broker._commit_batcher()
    assert batcher is not None
    batcher.width = 1  # the later commits queue behind the first write and go out together
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for d in (first, one, one, other):
                tg.start_soon(broker.commit_effects, d, RedisEffects.of(("HINCRBY", counts, d.message_id, 1)))
    assert batcher.calls == 4 and batcher.batches == 2
    assert await broker.redis.hgetall(counts) == {d.message_id.encode(): b"1" for d in (first, one, other)}
    assert (await broker.stream_groups(view.stream))[0]["pending"] == 0
    assert not await broker.redis.hlen(first.source.keys.attempts)


async def test_reads_from_many_tasks_share_writes_and_get_their_own_replies(
    broker: RedisBroker, namespace: str
) -> None:
    """Saga steps read their state with ``read_state`` (``read_shared``): 200 concurrent reads, each its own reply
    (an error reply raised in its own caller only), in fewer writes than reads."""
    if not isinstance(broker, RedisBroker):
        pytest.skip("read_shared is the Redis broker's")
    keys = [f"{namespace}:{{s}}:saga:{i}" for i in range(200)]
    for i, key in enumerate(keys):
        if i % 50 != 7:
            await broker.redis.hset(key, mapping={"v": i, "s": f"state-{i}"})
        else:
            await broker.redis.set(key, "not a hash")  # WRONGTYPE for HMGET
    replies: dict[int, object] = {}

    async def read(i: int) -> None:
        try:
            replies[i] = await broker.read_shared("HMGET", keys[i], "v", "s", "t")
        except Exception as exc:
            replies[i] = type(exc).__name__

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            for i in range(200):
                tg.start_soon(read, i)
    for i in range(200):
        expected = "ResponseError" if i % 50 == 7 else [str(i).encode(), f"state-{i}".encode(), None]
        assert replies[i] == expected, i
    if not broker.cluster:
        batcher = broker._reads
        assert batcher is not None and batcher.calls == 200 and batcher.batches < 100
        assert batcher._busy == 0 and not batcher._queue


async def test_hashes_are_read_together_in_one_call(broker: RedisBroker, namespace: str) -> None:
    """A saga reads a fetched batch's states ahead with ``read_states`` (``read_hashes``): each key's fields in
    order, None for a missing field or hash, None for the row of a key that is not a hash (the
    others are still read), on a fetcher's channel as through the client."""
    if not isinstance(broker, RedisBroker):
        pytest.skip("read_hashes is the Redis broker's")
    keys = [f"{namespace}:{{s}}:saga:{i}" for i in range(5)]
    await broker.redis.hset(keys[0], mapping={"v": 3, "s": "three", "t": "{}"})
    await broker.redis.hset(keys[1], mapping={"v": 1, "done": 1})
    await broker.redis.set(keys[3], "not a hash")
    await broker.redis.hset(keys[4], mapping={"v": 9})
    expected = [[b"3", b"three", b"{}", None], [b"1", None, None, b"1"], [None] * 4, None, [b"9", None, None, None]]
    assert await broker.read_hashes(keys, ("v", "s", "t", "done")) == expected
    assert await broker.read_hashes([], ("v",)) == []
    if not broker.cluster:
        channel = broker.channel()
        try:
            assert await broker.read_hashes(keys, ("v", "s", "t", "done"), channel=channel) == expected
        finally:
            await channel.aclose()


# -- the state capability: typed operations are the commands the saga wrote itself before -------------


async def test_typed_state_operations_become_the_same_commands_in_one_commit(broker: RedisBroker) -> None:
    """A saga step's typed operations reach ``commit_effects.lua`` as exactly the commands it recorded
    itself before the seam (guard, HSET, DEL, PEXPIRE; a timeout's ZADD and HSET of the partition's
    scheduled keys), in the order recorded, in one script call; a scheduled entry is packed as
    ``schedule_add.lua`` packs it (the mover reads both alike)."""
    if broker.cluster:
        pytest.skip("the batcher is the Redis broker's on a single node")
    spec = await broker.declare(DestinationSpec("saga.ops", "command"))
    [view] = await broker.subscribe(spec, "g")
    await broker.publish([command("saga.ops", 1, key="o-1")])
    [d] = await broker.read(view, "c", 10, 10)
    key = broker.state_key("saga.ops", 0, "o-1")
    assert key == f"{view.stream}:saga:o-1"  # the layout: under the partition's hash tag
    due = now_ms() + 60_000
    timeout = Envelope(destination="saga.ops", kind="command", type="T", body=b"{}", key="o-1")
    timeout.headers[DELIVER_AT] = str(due)
    tx = broker.effects()
    tx.hincrby(f"{view.stream}:mine", "n", 1)  # the handler's own command, in its place
    tx.expect(key, "v", None)
    tx.add(SetFields(key, {"v": 1, "s": b"{}", "t": b"{}"}))
    tx.add(ScheduleMessage(timeout, due))
    tx.add(DeleteKey(key))
    tx.add(ExpireKey(key, 5000))
    batcher = broker._commit_batcher()
    assert batcher is not None
    sent: list[list[Any]] = []
    call = batcher.call

    async def spy(source: Any, keys: Any, part: list[Any]) -> Any:
        sent.append(part)
        return await call(source, keys, part)

    batcher.call = spy  # type: ignore[method-assign]
    assert await broker.commit_effects(d, tx) is True
    [part] = sent
    assert part[3:5] == [7, 0]  # 7 commands (the timeout is two), no outgoing message
    pkeys = broker.keyspace.partition("saga.ops", 0)
    packed = msgpack_strings([as_bytes(f) for f in encode_fields(timeout)])
    commands = [
        ["HINCRBY", f"{view.stream}:mine", "n", 1],
        ["__EXPECT__", key, "v", ""],
        ["HSET", key, "v", 1, "s", b"{}", "t", b"{}"],
        ["ZADD", pkeys.scheduled, due, timeout.id],
        ["HSET", pkeys.scheduled_envelopes, timeout.id, packed],
        ["DEL", key],
        ["PEXPIRE", key, 5000],
    ]
    assert part[6 + 2 * part[5] :] == [x for c in commands for x in (len(c), *c)]
    assert await broker.redis.zscore(broker.keyspace.scheduled_index, "saga.ops|0") == due  # the hint, lowered
    # the packing is schedule_add.lua's: a publish of the same envelope under another id stores the same bytes
    twin = attrs.evolve(timeout, id=new_id())
    await broker.publish([twin])
    stored = await broker.redis.hget(pkeys.scheduled_envelopes, twin.id)
    assert stored == msgpack_strings([as_bytes(f) for f in encode_fields(twin)])


# -- the cluster flag ---------------------------------------------------------------------------------


async def test_a_single_node_server_is_no_cluster_and_gives_channels(broker: RedisBroker) -> None:
    """``cluster`` (RedisStore) tells a Cluster, where every write of one atomic step shares the
    delivery's hash tag and there are no channels or batchers; the test server is a single node."""
    store = as_redis(broker)
    assert store.cluster is False and isinstance(store, RedisStore)
    channel = broker.channel()
    try:
        assert channel is not None
    finally:
        await channel.aclose()
    assert broker._commit_batcher() is not None  # commits share writes (a Cluster commits each alone)


# -- the protocols are honest: the broker has all of them, and the framework calls nothing else ------


async def test_the_broker_has_every_member_of_the_core_protocol_and_of_its_capabilities(broker: RedisBroker) -> None:
    """RedisBroker declares every capability and has every member of :class:`broker.Broker` and of each
    capability protocol, with the declared parameters (the kit's ``the_broker_has_every_member_of_its_protocols``
    checks the same through ``connect``)."""
    core = protocol_members(Broker)
    assert {"publish", "read", "ack", "route", "ensure_declared", "channel", "capabilities", "transport"} <= core
    assert (
        not {"redis", "cluster", "keyspace", "commit_effects", "state_key"} & core
    )  # the capabilities', not the core's
    assert {"redis", "cluster", "effects", "commit_effects"} <= protocol_members(RedisStore)
    assert {"state_key", "read_state", "read_states", "effects", "commit_effects"} <= protocol_members(StateStore)
    assert not {"keyspace", "read_shared", "read_hashes"} & _all_protocol_members()  # the Redis broker's own
    assert RedisBroker.capabilities == set(CAPABILITY_PROTOCOLS) and broker.transport == "redis"
    problems = {"Broker": member_problems(broker, Broker)}
    for name in sorted(broker.capabilities):
        proto, narrow = CAPABILITY_PROTOCOLS[name]
        problems[proto.__name__] = member_problems(broker, proto)
        assert isinstance(broker, proto) and narrow(broker) is broker
    assert {k: v for k, v in problems.items() if v} == {}


def _all_protocol_members() -> set[str]:
    members = protocol_members(Broker)
    for proto, _ in CAPABILITY_PROTOCOLS.values():
        members |= protocol_members(proto)
    return members


def test_framework_code_calls_nothing_on_a_broker_beyond_the_protocols() -> None:
    """Every ``<...>broker.<name>`` in framework/ names a member of :class:`broker.Broker` or of a
    capability protocol of :mod:`broker.capabilities`."""
    members = _all_protocol_members()
    outside: dict[str, set[str]] = {}
    for path in sorted((ROOT / "framework").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if name.lstrip("_").endswith("broker") and node.attr not in members:
                outside.setdefault(node.attr, set()).add(str(path.relative_to(ROOT)))
    assert outside == {}, "framework code uses broker members that are in no protocol of broker.protocol/capabilities"


def test_the_redis_roles_define_each_name_once() -> None:
    """RedisBroker is made of role mixins: none may silently override another's method."""
    seen: dict[str, str] = {}
    for role in {c for r in ROLES for c in r.__mro__ if c.__module__.startswith("broker.redis")}:
        for name in vars(role):
            if not name.startswith("__"):
                assert name not in seen, f"{name!r} is defined by {seen[name]} and {role.__name__}"
                seen[name] = role.__name__
    assert issubclass(RedisBroker, ROLES)
