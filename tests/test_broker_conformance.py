"""The Broker contract (broker/protocol.py), checked against the real server.

Every test takes its broker from ``broker_factory``, parametrized over :data:`FACTORIES` (as
Watermill's ``TestPubSub`` takes a constructor): a second transport is run through this module by
adding one factory. Some checks read what is stored through the Redis implementation's own
``broker.redis``, ``broker.keyspace`` and ``broker.stream_groups`` (the layout of ``broker/redis/keys.py``);
a second transport would come with equivalent reads for those.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest

from broker import Broker, ConfigurationError, DestinationSpec, EffectsFailed, Envelope, connect, now_ms
from broker.codec import encode_fields
from broker.redis import RedisBroker
from broker.redis.broker import ROLES

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent

BrokerFactory = Callable[[], Awaitable[Broker]]
"""Makes a new broker on the test's server and namespace; the fixture closes every one it made."""


def redis_streams(request: pytest.FixtureRequest) -> BrokerFactory:
    """:class:`~broker.redis.RedisBroker` on the session's server (embedded Valkey unless REDIS_URL is set)."""
    url, namespace = request.getfixturevalue("redis_url"), request.getfixturevalue("namespace")
    return lambda: connect(url, namespace=namespace)


FACTORIES: dict[str, Callable[[pytest.FixtureRequest], BrokerFactory]] = {"redis": redis_streams}


@pytest.fixture(params=sorted(FACTORIES))
async def broker_factory(request: pytest.FixtureRequest) -> AsyncIterator[BrokerFactory]:
    make = FACTORIES[request.param](request)
    made: list[Broker] = []

    async def factory() -> Broker:
        made.append(await make())
        return made[-1]

    yield factory
    for b in made:
        await b.close()


@pytest.fixture
async def broker(broker_factory: BrokerFactory) -> Broker:
    return await broker_factory()


def event(topic: str, n: int, key: str | None = None) -> Envelope:
    return Envelope(destination=topic, kind="event", type="T", body=orjson.dumps({"n": n}), key=key)


def command(queue: str, n: int, key: str | None = None) -> Envelope:
    return Envelope(destination=queue, kind="command", type="C", body=orjson.dumps({"n": n}), key=key)


def numbers(deliveries: list) -> list[int]:
    return [orjson.loads(d.envelope.body)["n"] for d in deliveries]


async def test_publish_then_read_in_order_with_envelope_intact(broker: Broker) -> None:
    spec = await broker.declare(DestinationSpec("orders.placed", "event"))
    [view] = await broker.subscribe(spec, "billing")
    sent = [event("orders.placed", i, key="k") for i in range(5)]
    sent[0].headers["traceparent"] = "00-abc-def-01"
    ids = await broker.publish(sent)
    assert all(ids)
    got = await broker.read(view, "c1", 10, 100)
    assert numbers(got) == [0, 1, 2, 3, 4]
    first = got[0].envelope
    assert (first.id, first.key, first.type, first.headers, first.published_at) == (
        sent[0].id,
        "k",
        "T",
        {"traceparent": "00-abc-def-01"},
        sent[0].published_at,
    )
    assert got[0].delivery_count == 1 and got[0].attempt == 1


async def test_each_group_of_a_topic_gets_every_event(broker: Broker) -> None:
    spec = await broker.declare(DestinationSpec("orders.placed", "event", partitions=3))
    groups = {g: await broker.subscribe(spec, g) for g in ("billing", "shipping")}
    await broker.publish([event("orders.placed", i, key=f"k{i}") for i in range(30)])
    for views in groups.values():
        got = [d for v in views for d in await broker.read(v, "c", 100, 10)]
        assert sorted(numbers(got)) == list(range(30))


async def test_same_key_lands_in_one_partition_in_order(broker: Broker) -> None:
    spec = await broker.declare(DestinationSpec("orders.placed", "event", partitions=4))
    views = await broker.subscribe(spec, "billing")
    await broker.publish([event("orders.placed", i, key="same") for i in range(20)])
    per_partition = [numbers(await broker.read(v, "c", 100, 10)) for v in views]
    assert sorted(per_partition, key=len)[-1] == list(range(20))
    assert sum(len(p) for p in per_partition) == 20


async def test_queue_entry_goes_to_one_consumer_and_is_deleted_on_ack(broker: Broker) -> None:
    spec = await broker.declare(DestinationSpec("billing.refund", "command"))
    [view] = await broker.subscribe(spec, "billing")
    await broker.publish([command("billing.refund", i) for i in range(10)])
    a = await broker.read(view, "a", 6, 10)
    b = await broker.read(view, "b", 6, 10)
    assert sorted(numbers(a) + numbers(b)) == list(range(10))
    assert not set(numbers(a)) & set(numbers(b))
    assert await broker.ack(view, a + b) == 10
    assert await broker.redis.xlen(view.stream) == 0


async def test_a_queue_has_one_owning_service(broker: Broker) -> None:
    spec = await broker.declare(DestinationSpec("billing.refund", "command"))
    await broker.subscribe(spec, "billing")
    with pytest.raises(ConfigurationError, match="one owning service"):
        await broker.subscribe(spec, "shipping")


async def test_declaring_a_conflicting_destination_is_a_clear_error(broker: Broker) -> None:
    await broker.declare(DestinationSpec("orders.placed", "event", partitions=2))
    with pytest.raises(ConfigurationError, match="2 partition"):
        await broker.declare(DestinationSpec("orders.placed", "event", partitions=3))
    with pytest.raises(ConfigurationError, match="topic"):
        await broker.publish([command("orders.placed", 1)])


async def test_unacked_entries_are_reread_by_their_consumer_and_claimed_by_others(broker: Broker) -> None:
    spec = await broker.declare(DestinationSpec("billing.refund", "command"))
    [view] = await broker.subscribe(spec, "billing")
    await broker.publish([command("billing.refund", i) for i in range(3)])
    first = await broker.read(view, "a", 10, 10)
    assert len(first) == 3
    again = await broker.read_own_pending(view, "a", 10)
    assert numbers(again) == [0, 1, 2] and {d.delivery_count for d in again} == {2}
    assert await broker.claim_idle(view, "b", 60_000, 10) == []  # not idle long enough
    await anyio.sleep(0.05)
    claimed = await broker.claim_idle(view, "b", 20, 10)
    assert numbers(claimed) == [0, 1, 2] and {d.delivery_count for d in claimed} == {3}
    assert claimed[0].attempt == 3
    assert await broker.read_own_pending(view, "a", 10) == []


async def test_extend_keeps_entries_from_being_claimed(broker: Broker) -> None:
    spec = await broker.declare(DestinationSpec("billing.refund", "command"))
    [view] = await broker.subscribe(spec, "billing")
    await broker.publish([command("billing.refund", 1)])
    held = await broker.read(view, "a", 10, 10)
    await anyio.sleep(0.06)
    assert await broker.extend(view, "a", held) == {held[0].entry_id}
    assert await broker.claim_idle(view, "b", 50, 10) == []
    await anyio.sleep(0.06)
    assert len(await broker.claim_idle(view, "b", 50, 10)) == 1
    assert await broker.extend(view, "a", held) == set()  # lost to b: not touched


async def test_dead_letter_is_atomic_with_ack_and_happens_once(broker: Broker) -> None:
    spec = await broker.declare(DestinationSpec("billing.refund", "command"))
    [view] = await broker.subscribe(spec, "billing")
    await broker.publish([command("billing.refund", 7)])
    [d] = await broker.read(view, "a", 10, 10)
    assert await broker.dead_letter(d, {"dlq-reason": "boom"}) is not None
    assert await broker.dead_letter(d, {"dlq-reason": "boom"}) is None  # no longer pending: no second entry
    assert await broker.redis.xlen(view.keys.dlq) == 1
    assert await broker.redis.xlen(view.stream) == 0
    [(_, flat)] = await broker.redis.execute_command("XRANGE", view.keys.dlq, "-", "+")
    fields = dict(zip(flat[::2], flat[1::2], strict=True))
    assert fields[b"dlq-reason"] == b"boom" and fields[b"id"] == d.envelope.id.encode()


async def test_retry_path_redelivers_to_the_failing_group_only(broker: Broker) -> None:
    spec = await broker.declare(DestinationSpec("orders.placed", "event"))
    [billing] = await broker.subscribe(spec, "billing")
    [shipping] = await broker.subscribe(spec, "shipping")
    await broker.publish([event("orders.placed", 1)])
    [d] = await broker.read(billing, "a", 10, 10)
    assert await broker.retry_later(d, now_ms() + 60_000)
    assert await broker.move_due(billing, now_ms()) == 0  # not due yet
    assert await broker.move_due(billing, now_ms() + 61_000) == 1
    [again] = await broker.read(billing, "a", 10, 10)
    assert again.envelope.id == d.envelope.id and again.attempt == 2
    assert numbers(await broker.read(shipping, "s", 10, 10)) == [1]  # shipping saw it once, from the topic
    assert await broker.read(shipping, "s", 10, 10) == []


async def test_concurrent_schedulers_move_each_retry_once(broker: Broker) -> None:
    spec = await broker.declare(DestinationSpec("billing.refund", "command"))
    [view] = await broker.subscribe(spec, "billing")
    await broker.publish([command("billing.refund", i) for i in range(200)])
    due = now_ms()
    for d in await broker.read(view, "a", 500, 10):
        await broker.retry_later(d, due)
    moved: list[int] = []

    async def scheduler() -> None:
        while await broker.redis.zcard(view.keys.delayed):
            moved.append(await broker.move_due(view, now_ms(), limit=7))

    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(scheduler)
    assert sum(moved) == 200
    again = await broker.read(view, "a", 500, 10)
    assert sorted(numbers(again)) == list(range(200))


async def test_trimming_never_drops_an_entry_a_group_has_not_acked(broker: Broker) -> None:
    spec = await broker.declare(DestinationSpec("orders.placed", "event", retention_ms=1, max_length=5))
    [fast] = await broker.subscribe(spec, "fast")
    [slow] = await broker.subscribe(spec, "slow")
    await broker.publish([event("orders.placed", i) for i in range(50)])
    await broker.ack(fast, await broker.read(fast, "f", 100, 10))
    slow_got = await broker.read(slow, "s", 10, 10)  # delivered 0..9, acks only 0..4
    await broker.ack(slow, slow_got[:5])
    await anyio.sleep(0.01)
    removed = await broker.trim(spec, 0, now_ms())
    assert removed == 5  # only what every group acknowledged
    remaining = [
        orjson.loads(dict(zip(f[::2], f[1::2], strict=True))[b"body"])["n"]
        for _, f in await broker.redis.execute_command("XRANGE", slow.stream, "-", "+")
    ]
    assert remaining == list(range(5, 50))
    await broker.ack(slow, slow_got[5:] + await broker.read(slow, "s", 100, 10))
    await broker.trim(spec, 0, now_ms())
    assert await broker.redis.xlen(slow.stream) == 0  # retention 1 ms: all acked events go


async def test_length_retention_keeps_newest_entries(broker: Broker) -> None:
    spec = await broker.declare(DestinationSpec("metrics", "event", retention_ms=None, max_length=10))
    [view] = await broker.subscribe(spec, "reader")
    await broker.publish([event("metrics", i) for i in range(30)])
    await broker.ack(view, await broker.read(view, "r", 100, 10))
    assert await broker.trim(spec, 0, now_ms()) == 20
    assert await broker.redis.xlen(view.stream) == 10


async def test_new_group_can_start_at_latest(broker: Broker) -> None:
    spec = await broker.declare(DestinationSpec("orders.placed", "event"))
    await broker.publish([event("orders.placed", 1)])
    [late] = await broker.subscribe(spec, "late", start="latest")
    [early] = await broker.subscribe(spec, "early", start="earliest")
    await broker.publish([event("orders.placed", 2)])
    assert numbers(await broker.read(late, "c", 10, 10)) == [2]
    assert numbers(await broker.read(early, "c", 10, 10)) == [1, 2]


async def test_idempotency_key_stores_a_message_once(broker: Broker) -> None:
    spec = await broker.declare(DestinationSpec("billing.refund", "command"))
    [view] = await broker.subscribe(spec, "billing")
    first = command("billing.refund", 1)
    first.headers["idempotency-key"] = "req-42"
    repeat = command("billing.refund", 1)
    repeat.headers["idempotency-key"] = "req-42"
    ids = await broker.publish([first, repeat])
    assert ids[0] is not None and ids[1] is None
    assert len(await broker.read(view, "c", 10, 10)) == 1


async def test_undecodable_entries_are_delivered_with_the_reason(broker: Broker) -> None:
    spec = await broker.declare(DestinationSpec("billing.refund", "command"))
    [view] = await broker.subscribe(spec, "billing")
    await broker.redis.xadd(view.stream, {"garbage": b"\xff\x00"})
    [d] = await broker.read(view, "c", 10, 10)
    assert d.envelope is None and "id" in (d.error or "")
    assert await broker.dead_letter(d, {"dlq-reason": d.error or ""})


async def test_inbox_claim_leases_new_ids_and_reports_duplicates(broker: Broker) -> None:
    spec = await broker.declare(DestinationSpec("billing.refund", "command"))
    [view] = await broker.subscribe(spec, "billing")
    original = command("billing.refund", 1)
    copy = command("billing.refund", 1)
    copy.id = original.id  # a re-published copy: another entry, the same message id
    await broker.publish([original, copy])
    first, second = await broker.read(view, "a", 10, 10)
    assert await broker.inbox_claim(view, [first], 60_000) == [0]  # leased to us: run it
    assert await broker.inbox_claim(view, [second], 60_000) == [2]  # running elsewhere: leave it
    second.delivery_count = 2
    assert await broker.inbox_claim(view, [second], 60_000) == [0]  # a redelivery takes the lease over
    await broker.ack(view, [first], inbox=True)
    assert await broker.inbox_claim(view, [second], 60_000) == [1]  # processed: a duplicate
    # a UUIDv7 id is recorded in the inbox's buckets (they expire a window after their last write,
    # tests/test_inbox_memory.py); its lease is gone from the zset, which the trimmer keeps small
    assert await broker.redis.zscore(view.keys.inbox, original.id) is None
    assert await broker.trim_inbox(view, now_ms() + 1) == 0


async def test_a_mixed_batch_keeps_its_order_per_stream(broker: Broker) -> None:
    spec = await broker.declare(DestinationSpec("billing.refund", "command"))
    [view] = await broker.subscribe(spec, "billing")
    batch = [command("billing.refund", i) for i in range(6)]
    batch[2].headers["idempotency-key"] = "k-2"
    batch[4].headers["idempotency-key"] = "k-4"
    ids = await broker.publish(batch)
    assert all(ids) and ids == sorted(ids, key=lambda i: tuple(int(x) for x in i.split("-")))  # type: ignore[union-attr]
    assert numbers(await broker.read(view, "c", 10, 10)) == [0, 1, 2, 3, 4, 5]


async def test_idempotency_key_without_a_message_key_is_checked_in_one_partition(broker: Broker) -> None:
    spec = await broker.declare(DestinationSpec("orders.placed", "event", partitions=4))
    views = await broker.subscribe(spec, "billing")
    repeats = [event("orders.placed", i) for i in range(8)]  # no message key: each has its own random id
    for env in repeats:
        env.headers["idempotency-key"] = "POST /orders 42"
    ids = [(await broker.publish([env]))[0] for env in repeats[:4]]  # one call each
    ids += await broker.publish(repeats[4:])  # and in one batch
    assert ids[0] is not None and ids[1:] == [None] * 7
    assert sum([await broker.redis.xlen(v.stream) for v in views]) == 1
    keyed = event("orders.placed", 9, key="order-42")  # a message key still decides the partition
    keyed.headers["idempotency-key"] = "POST /orders 43"
    [entry] = await broker.publish([keyed])
    by_key = broker.keyspace.partition("orders.placed", spec.partition_for("order-42", keyed.id)).stream
    assert len(await broker.redis.xrange(by_key, entry, entry)) == 1


async def test_idempotency_key_expires_with_its_window_and_expired_keys_are_removed(broker: Broker) -> None:
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


async def effects_fixture(broker: Broker, namespace: str) -> tuple:
    spec = await broker.declare(DestinationSpec("wallet.credit", "command"))
    [view] = await broker.subscribe(spec, "wallet")
    await broker.publish([command("wallet.credit", 100)])
    [d] = await broker.read(view, "a", 10, 10)
    assert await broker.inbox_claim(view, [d], 60_000) == [0]  # leased to us
    balances, wrong = f"{namespace}:{{x}}:balances", f"{namespace}:{{x}}:not-a-hash"
    await broker.redis.set(wrong, "a string")
    return view, d, balances, wrong


async def test_effects_failing_half_way_are_dead_lettered_once_and_never_applied_again(
    broker: Broker, namespace: str
) -> None:
    view, d, balances, wrong = await effects_fixture(broker, namespace)
    commands = [("HINCRBY", balances, "a", 100), ("HSET", wrong, "f", "v"), ("HINCRBY", balances, "b", 1)]
    outgoing = [event("wallet.credited", 1)]
    reason = {"dlq-handler": "wallet.credit", "dlq-attempts": "1", "dlq-reason": "overwritten by the script"}
    with pytest.raises(EffectsFailed) as failed:
        await broker.commit_effects(d, commands, [balances, wrong], outgoing, reason=reason)
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
    assert await broker.commit_effects(d, commands[:1], [balances], reason=reason) is False
    assert await broker.redis.hgetall(balances) == {b"a": b"100"}
    assert len(await broker.dead_letter_entries(view)) == 1

    # a redrive runs the handler again (the inbox did not record the message as processed)
    assert await broker.redrive(view, dlq_id)
    [again] = await broker.read(view, "a", 10, 10)
    assert again.message_id == d.message_id and await broker.inbox_claim(view, [again], 60_000) == [0]


async def test_effects_failing_at_the_first_command_are_dead_lettered_with_nothing_applied(
    broker: Broker, namespace: str
) -> None:
    view, d, balances, wrong = await effects_fixture(broker, namespace)
    with pytest.raises(EffectsFailed) as failed:
        await broker.commit_effects(d, [("HSET", wrong, "f", "v"), ("HINCRBY", balances, "a", 1)], [balances, wrong])
    assert failed.value.applied == 0 and await broker.redis.exists(balances) == 0
    [(_, fields)] = await broker.dead_letter_entries(view)
    assert fields[b"dlq-reason"].startswith(b"effects not applied: Redis command 1 of 2 (HSET) failed: WRONGTYPE")
    assert (await broker.stream_groups(view.stream))[0]["pending"] == 0
    assert await broker.redis.zscore(view.keys.inbox, d.message_id) is None


async def test_effects_dead_letters_keep_when_the_message_first_failed(broker: Broker, namespace: str) -> None:
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
        await broker.commit_effects(first, [("HSET", wrong, "f", "v")], [wrong])
    with pytest.raises(EffectsFailed):
        await broker.commit_effects(
            second, [("HSET", wrong, "f", "v")], [wrong], reason={"dlq-first-failed-at": "1700000000123"}
        )
    letters = {fields[b"dlq-entry-id"]: fields for _, fields in await broker.dead_letter_entries(view)}
    assert letters[first.entry_id.encode()][b"dlq-first-failed-at"] == b"1700000000000"
    assert letters[second.entry_id.encode()][b"dlq-first-failed-at"] == b"1700000000123"
    assert all(list(f).count(b"dlq-first-failed-at") == 1 for f in letters.values())


async def test_effects_of_a_deleted_entry_are_dead_lettered_as_empty(broker: Broker, namespace: str) -> None:
    view, d, balances, wrong = await effects_fixture(broker, namespace)
    await broker.redis.xdel(view.stream, d.entry_id)  # gone while pending
    with pytest.raises(EffectsFailed):
        await broker.commit_effects(d, [("HINCRBY", balances, "a", 1), ("LPUSH", wrong, "x")], [balances, wrong])
    [(_, fields)] = await broker.dead_letter_entries(view)
    assert fields[b"dlq-empty"] == b"1" and b"(LPUSH)" in fields[b"dlq-reason"]


async def test_concurrent_commits_share_writes_and_keep_their_own_outcomes(broker: Broker, namespace: str) -> None:
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
        if i % 5 == 0:  # a guard that does not hold: nothing written, the entry stays pending
            commands = [("__EXPECT__", balances, "guard", "x"), ("HINCRBY", balances, "n", 1)]
        elif i % 5 == 1:  # fails half-way: dead-lettered by the same call
            commands = [("HINCRBY", balances, "partial", 1), ("HSET", wrong, "f", "v")]
        else:
            commands = [("HINCRBY", balances, "n", 1)]
        try:
            outcomes[i] = await broker.commit_effects(d, commands, [balances, wrong])  # type: ignore[arg-type]
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
    assert await broker.commit_effects(deliveries[2], [("HINCRBY", balances, "n", 1)], [balances]) is False
    assert await broker.redis.hget(balances, "n") == b"90"  # a duplicate applies nothing
    if isinstance(broker, RedisBroker) and not broker.cluster:
        batcher = broker._commit_batcher()
        assert batcher.calls == 151 and batcher.batches < 100  # calls made together shared writes
        assert batcher._busy == 0 and not batcher._queue


async def test_cancelled_commits_leave_the_shared_writes_working(broker: Broker, namespace: str) -> None:
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
                    tg.start_soon(broker.commit_effects, d, [("HINCRBY", counts, d.message_id, 1)], [counts])
    with anyio.fail_after(10):  # the rest go through, each applied once
        async with anyio.create_task_group() as tg:
            for d in deliveries[100:]:
                tg.start_soon(broker.commit_effects, d, [("HINCRBY", counts, d.message_id, 1)], [counts])
    values = await broker.redis.hgetall(counts)
    assert all(v == b"1" for v in values.values())  # sent or not, never twice
    assert {d.message_id.encode() for d in deliveries[100:]} <= set(values)
    if isinstance(broker, RedisBroker) and not broker.cluster:
        batcher = broker._commit_batcher()
        assert batcher._busy == 0 and not batcher._queue


async def _three_for_the_batcher(broker: Broker, destination: str) -> tuple[Any, list[Any]]:
    """Three commands on ``destination`` read by group ``wallet``: its view and the deliveries
    (skips where there is no batcher)."""
    if not isinstance(broker, RedisBroker) or broker.cluster:
        pytest.skip("the batcher is the Redis broker's")
    spec = await broker.declare(DestinationSpec(destination, "command"))
    [view] = await broker.subscribe(spec, "wallet")
    await broker.publish([command(destination, n) for n in range(3)])
    return view, await broker.read(view, "a", 10, 10)


async def test_a_caller_cancelled_as_it_is_handed_the_next_write_passes_it_on(broker: Broker, namespace: str) -> None:
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
        await broker.commit_effects(a, [("HINCRBY", counts, "a", 1)], [counts])
        # b was handed the slot as a's write ended and has not run yet: cancel it now, as an
        # asyncio timeout (a handler's) would (anyio's scopes wait until it has run)
        tasks["b"].cancel()

    with anyio.fail_after(10):
        tasks["a"] = asyncio.create_task(first())
        await asyncio.sleep(0)  # a's write is in flight
        for name, d in (("b", b), ("c", c)):
            tasks[name] = asyncio.create_task(broker.commit_effects(d, [("HINCRBY", counts, name, 1)], [counts]))
        await asyncio.wait(tasks.values())
    assert tasks["b"].cancelled() and tasks["c"].result() is True
    assert await broker.redis.hgetall(counts) == {b"a": b"1", b"c": b"1"}  # b's was never sent
    assert batcher._busy == 0 and not batcher._queue


async def test_two_copies_committed_in_one_script_call_apply_once(broker: Broker, namespace: str) -> None:
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
                tg.start_soon(broker.commit_effects, d, [("HINCRBY", counts, d.message_id, 1)], [counts])
    assert batcher.calls == 3 and batcher.batches == 2
    assert await broker.redis.hget(counts, one.message_id) == b"1"  # applied once
    assert (await broker.stream_groups(view.stream))[0]["pending"] == 0  # both entries acked


async def test_one_entry_committed_twice_in_one_script_call_applies_once(broker: Broker, namespace: str) -> None:
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
                tg.start_soon(broker.commit_effects, d, [("HINCRBY", counts, d.message_id, 1)], [counts])
    assert batcher.calls == 4 and batcher.batches == 2
    assert await broker.redis.hgetall(counts) == {d.message_id.encode(): b"1" for d in (first, one, other)}
    assert (await broker.stream_groups(view.stream))[0]["pending"] == 0
    assert not await broker.redis.hlen(first.source.keys.attempts)


async def test_reads_from_many_tasks_share_writes_and_get_their_own_replies(broker: Broker, namespace: str) -> None:
    """Saga steps read their state with ``read_shared``: 200 concurrent reads, each its own reply
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


async def test_hashes_are_read_together_in_one_call(broker: Broker, namespace: str) -> None:
    """A saga reads a fetched batch's states ahead with ``read_hashes``: each key's fields in
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


async def test_departed_consumers_with_nothing_pending_are_pruned(broker: Broker) -> None:
    spec = DestinationSpec("prune.q", "command")
    [view] = await broker.subscribe(spec, "g")
    await broker.publish([Envelope(destination="prune.q", kind="command", type="t", body=b"{}") for _ in range(3)])
    [held] = await broker.read(view, "holder", 1, 0)  # keeps one entry pending
    for name in ("gone", "me"):  # each reads one and acks it; "gone" then dies
        await broker.ack(view, await broker.read(view, name, 1, 0))
    await anyio.sleep(0.05)
    assert await broker.prune_consumers(view, 10_000) == 0  # nobody idle long enough
    assert await broker.prune_consumers(view, 10, keep="me") >= 1
    names = {c["name"].decode() for c in await broker.redis.xinfo_consumers(view.stream, "g")}
    assert names == {"holder", "me"}  # the holder's entry stays claimable; we are kept
    assert held.entry_id


# -- declare on first use: route (by name) and ensure_declared (a full spec) -------------------------


async def test_route_declares_on_first_use_and_refuses_the_other_kind(broker_factory: BrokerFactory) -> None:
    a, b = await broker_factory(), await broker_factory()
    spec = await a.route("audit.log", "event", partitions=3)
    assert (spec.name, spec.kind, spec.partitions) == ("audit.log", "event", 3)
    assert await b.get_destination("audit.log") == spec  # in the registry, not only in a's cache
    assert await b.route("audit.log", "event") == spec  # an existing destination keeps its partitions
    with pytest.raises(
        ConfigurationError, match=r"cannot send\(\) a command to 'audit.log': it is declared as a topic"
    ):
        await b.route("audit.log", "command")
    with pytest.raises(ConfigurationError, match="invalid destination name"):
        await a.route("no spaces", "event")
    [entry] = await a.publish([event("fresh.topic", 1)])  # publish routes the same way
    assert entry and await b.get_destination("fresh.topic") == DestinationSpec("fresh.topic", "event")


async def test_ensure_declared_declares_once_per_broker_and_reports_conflicts(broker_factory: BrokerFactory) -> None:
    a, b = await broker_factory(), await broker_factory()
    spec = DestinationSpec("billing.refund", "command", partitions=2)
    assert await a.ensure_declared(spec) == spec
    with pytest.raises(ConfigurationError, match="2 partition"):
        await b.ensure_declared(DestinationSpec("billing.refund", "command", partitions=3))
    with pytest.raises(ConfigurationError, match="already declared as a queue"):
        await b.ensure_declared(DestinationSpec("billing.refund", "event", partitions=2))
    shorter = DestinationSpec("billing.refund", "command", partitions=2, retention_ms=1000)
    assert await b.ensure_declared(shorter) == shorter  # another spec is declared again: the latest retention wins
    assert await (await broker_factory()).get_destination("billing.refund") == shorter
    assert await a.ensure_declared(spec) == spec  # a's own spec again: declared again, as it differs from b's
    await b.delete_destination(spec)  # behind a's back: a holds the spec, so it does not declare it again
    assert await a.ensure_declared(spec) == spec
    assert await (await broker_factory()).get_destination("billing.refund") is None


# -- the protocol is honest: the broker has all of it, and the framework calls nothing else ----------


def _protocol_members() -> set[str]:
    names: set[str] = set()
    for cls in Broker.__mro__:
        if cls in (Broker, object) or not getattr(cls, "_is_protocol", False) or cls.__module__ == "typing":
            continue
        names |= {n for n in vars(cls) if not n.startswith("_")} | set(getattr(cls, "__annotations__", {}))
    return names | {n for n in vars(Broker) if not n.startswith("_")}


async def test_the_broker_has_every_member_of_the_protocol(broker: Broker) -> None:
    members = _protocol_members()
    assert {"publish", "read", "ack", "route", "ensure_declared", "channel", "redis", "cluster"} <= members
    for name in sorted(members):
        assert hasattr(broker, name), f"the broker has no {name!r}"
        declared = inspect.getattr_static(Broker, name, None)
        if not inspect.isfunction(declared):
            continue  # an attribute or property
        want = inspect.signature(declared).parameters
        have = inspect.signature(getattr(broker, name)).parameters
        for param in list(want.values())[1:]:  # without self
            assert param.name in have, f"{name}() lacks parameter {param.name!r}"
            got = have[param.name]
            assert (got.kind, got.default) == (param.kind, param.default), f"{name}({param.name}) differs"
        extra = [p for p in have.values() if p.name not in want and p.default is inspect.Parameter.empty]
        assert not extra, f"{name}() requires parameters the protocol does not have: {extra}"


def test_framework_code_calls_nothing_on_a_broker_beyond_the_protocol() -> None:
    """Every ``<...>broker.<name>`` in framework/ names a member of :class:`broker.Broker`."""
    members = _protocol_members()
    outside: dict[str, set[str]] = {}
    for path in sorted((ROOT / "framework").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if name.lstrip("_").endswith("broker") and node.attr not in members:
                outside.setdefault(node.attr, set()).add(str(path.relative_to(ROOT)))
    assert outside == {}, "framework code uses broker members that are not in broker.protocol.Broker"


def test_the_redis_roles_define_each_name_once() -> None:
    """RedisBroker is made of role mixins: none may silently override another's method."""
    seen: dict[str, str] = {}
    for role in {c for r in ROLES for c in r.__mro__ if c.__module__.startswith("broker.redis")}:
        for name in vars(role):
            if not name.startswith("__"):
                assert name not in seen, f"{name!r} is defined by {seen[name]} and {role.__name__}"
                seen[name] = role.__name__
    assert issubclass(RedisBroker, ROLES)
