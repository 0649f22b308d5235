"""The in-process transport (broker/memory/): the Broker contract and its capabilities, through the contract only.

No server is needed: every test has a ``memory://`` server of its own, dropped afterwards.
"""

from __future__ import annotations

import ast
import inspect
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import orjson
import pytest

import broker as broker_pkg
from broker import (
    ConfigurationError,
    DestinationSpec,
    Envelope,
    GuardedWrite,
    LeaseLost,
    MessageTooLarge,
    now_ms,
)
from broker.capabilities import (
    DEAD_LETTER_ADMIN,
    INBOX,
    INTROSPECTION,
    OWNERSHIP,
    REDIS,
    REPLIES,
    SCHEDULING,
    STATE,
    DeadLetterAdmin,
    InboxStore,
    PartitionOwnership,
    ReplyStore,
    Scheduler,
    StateStore,
    as_introspection,
    as_redis,
)
from broker.headers import DELIVER_AT, IDEMPOTENCY_KEY
from broker.ids import new_id
from broker.introspection import DestinationUsage, Introspection
from broker.memory import MemoryBroker, connect_memory, get_server, reset
from broker.memory.broker import ROLES
from broker.protocol import Broker, Delivery, GroupPartition

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def url() -> Iterator[str]:
    """A server of the test's own, dropped afterwards."""
    name = f"memory://test-{new_id()}"
    yield name
    reset(name)


@pytest.fixture
async def broker(url: str) -> AsyncIterator[MemoryBroker]:
    b = connect_memory(url, namespace="t")
    yield b
    await b.close()


def event(topic: str, n: int, key: str | None = None) -> Envelope:
    return Envelope(destination=topic, kind="event", type="T", body=orjson.dumps({"n": n}), key=key)


def command(queue: str, n: int, key: str | None = None) -> Envelope:
    return Envelope(destination=queue, kind="command", type="C", body=orjson.dumps({"n": n}), key=key)


def numbers(deliveries: list[Delivery]) -> list[int]:
    return [orjson.loads(d.envelope.body)["n"] for d in deliveries if d.envelope is not None]


async def read_all(b: Broker, views: list[GroupPartition]) -> list[int]:
    """The numbers of every new entry of ``views``, partition by partition."""
    return [n for v in views for n in numbers(await b.read(v, "c", 100, 0))]


async def queue(
    b: Broker, name: str = "billing.refund", group: str = "billing"
) -> tuple[DestinationSpec, GroupPartition]:
    spec = await b.declare(DestinationSpec(name, "command"))
    [view] = await b.subscribe(spec, group)
    return spec, view


# -- connecting ---------------------------------------------------------------------------------


async def test_connect_by_url_gives_the_memory_transport_with_its_capabilities(url: str) -> None:
    b = await broker_pkg.connect(url, namespace="t")
    assert isinstance(b, MemoryBroker) and b.transport == "memory" and b.namespace == "t" and b.url == url
    assert b.capabilities == {INBOX, OWNERSHIP, SCHEDULING, DEAD_LETTER_ADMIN, INTROSPECTION, STATE, REPLIES}
    assert REDIS not in b.capabilities
    protocols = (InboxStore, PartitionOwnership, Scheduler, DeadLetterAdmin, Introspection, StateStore, ReplyStore)
    assert all(isinstance(b, p) for p in protocols)
    assert b.channel() is None and b.max_body_bytes == 1024 * 1024
    with pytest.raises(TypeError, match="memory transport has no 'redis'"):
        as_redis(b)
    default = await broker_pkg.connect("memory://")
    assert default.namespace == broker_pkg.default_namespace()
    reset("memory://")


async def test_connects_to_one_name_share_state_and_other_names_or_namespaces_do_not(url: str) -> None:
    a, b = connect_memory(url, namespace="t"), connect_memory(url, namespace="t")
    _, view = await queue(a)
    await a.publish([command("billing.refund", 1)])
    assert numbers(await b.read(view, "c", 10, 0)) == [1]  # b reads what a published
    other = connect_memory(f"{url}-other", namespace="t")
    assert await other.get_destination("billing.refund") is None
    elsewhere = connect_memory(url, namespace="u")  # same server, another deployment
    assert await elsewhere.list_destinations() == []
    assert get_server(url) is get_server(url) is not get_server(f"{url}-other")
    reset(url)
    assert await connect_memory(url, namespace="t").list_destinations() == []  # a new, empty server
    reset(f"{url}-other")


async def test_invalid_namespace_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="invalid namespace"):
        connect_memory("memory://x", namespace="a b")


def test_the_package_never_imports_redis() -> None:
    for path in sorted((ROOT / "broker" / "memory").glob("*.py")):
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [m for m in names if m == "redis" or m.startswith(("redis.", "broker.redis"))], path
        assert len(path.read_text().splitlines()) < 400, path


def test_the_broker_has_every_member_of_the_protocols_with_their_signatures() -> None:
    b = connect_memory("memory://signatures")
    for proto in (Broker, InboxStore, PartitionOwnership, Scheduler, DeadLetterAdmin, Introspection):
        names: set[str] = set()
        for cls in proto.__mro__:
            if cls is not object and cls.__module__ != "typing" and getattr(cls, "_is_protocol", False):
                names |= {n for n in vars(cls) if not n.startswith("_")} | set(getattr(cls, "__annotations__", {}))
        for name in sorted(names):
            assert hasattr(b, name), f"the memory broker has no {name!r}"
            declared = inspect.getattr_static(proto, name, None)
            if not inspect.isfunction(declared):
                continue
            have = inspect.signature(getattr(b, name)).parameters
            for param in list(inspect.signature(declared).parameters.values())[1:]:
                got = have.get(param.name)
                assert got is not None and (got.kind, got.default) == (param.kind, param.default), (name, param)
    reset("memory://signatures")


def test_the_roles_define_each_name_once() -> None:
    seen: dict[str, str] = {}
    for role in {c for r in ROLES for c in r.__mro__ if c.__module__.startswith("broker.memory")}:
        for name in vars(role):
            if not name.startswith("__"):
                assert name not in seen, f"{name!r} is defined by {seen[name]} and {role.__name__}"
                seen[name] = role.__name__
    assert issubclass(MemoryBroker, ROLES)


# -- publish, read, ack, retention ----------------------------------------------------------------


async def test_publish_then_read_in_order_with_envelope_intact(broker: MemoryBroker) -> None:
    spec = await broker.declare(DestinationSpec("orders.placed", "event"))
    [view] = await broker.subscribe(spec, "billing")
    sent = [event("orders.placed", i, key="k") for i in range(5)]
    sent[0].headers["traceparent"] = "00-abc-def-01"
    ids = await broker.publish(sent)
    assert all(ids) and ids == sorted(ids, key=lambda i: tuple(int(x) for x in (i or "").split("-")))
    got = await broker.read(view, "c1", 10, 100)
    assert numbers(got) == [0, 1, 2, 3, 4] and [d.entry_id for d in got] == ids
    first = got[0].envelope
    assert first is not None
    assert (first.id, first.key, first.type, first.headers, first.published_at) == (
        sent[0].id,
        "k",
        "T",
        {"traceparent": "00-abc-def-01"},
        sent[0].published_at,
    )
    assert got[0].delivery_count == 1 and got[0].attempt == 1 and got[0].field(b"key") == b"k"
    assert await broker.ack(view, got) == 5
    assert await broker.ack(view, got) == 0  # acked already


async def test_a_queue_deletes_acked_entries_and_a_topic_keeps_them_for_another_group(broker: MemoryBroker) -> None:
    spec, view = await queue(broker)
    await broker.publish([command("billing.refund", i) for i in range(4)])
    a = await broker.read(view, "a", 2, 0)
    b = await broker.read(view, "b", 5, 0)
    assert numbers(a) == [0, 1] and numbers(b) == [2, 3]  # each entry to one consumer
    assert await broker.ack(view, a + b) == 4
    with pytest.raises(ConfigurationError, match="one owning service"):
        await broker.subscribe(spec, "shipping")
    await broker.unsubscribe(spec, "billing")
    [again] = await broker.subscribe(spec, "billing")  # a new group from the earliest entry: nothing is left
    assert await broker.read(again, "a", 10, 0) == []

    topic = await broker.declare(DestinationSpec("orders.placed", "event", partitions=3))
    first = await broker.subscribe(topic, "billing")
    await broker.publish([event("orders.placed", i, key=f"k{i}") for i in range(30)])
    for v in first:
        await broker.ack(v, await broker.read(v, "c", 100, 0))
    late = await broker.subscribe(topic, "shipping")  # earliest: the retained history
    assert sorted(await read_all(broker, late)) == list(range(30))
    latest = await broker.subscribe(topic, "audit", start="latest")
    await broker.publish([event("orders.placed", 99, key="k1")])
    assert await read_all(broker, latest) == [99]


async def test_declaring_conflicts_and_routing(broker: MemoryBroker) -> None:
    await broker.declare(DestinationSpec("orders.placed", "event", partitions=2))
    with pytest.raises(ConfigurationError, match="2 partition"):
        await broker.declare(DestinationSpec("orders.placed", "event", partitions=3))
    with pytest.raises(ConfigurationError, match="topic"):
        await broker.publish([command("orders.placed", 1)])
    longer = await broker.declare(DestinationSpec("orders.placed", "event", partitions=2, retention_ms=5))
    assert longer.retention_ms == 5  # the latest retention wins
    other = connect_memory(broker.url, namespace="t")
    assert await other.route("orders.placed", "event") == longer
    [entry] = await broker.publish([event("fresh.topic", 1)])  # declared on first use
    assert entry and await other.get_destination("fresh.topic") == DestinationSpec("fresh.topic", "event")
    assert [s.name for s in await other.list_destinations()] == ["fresh.topic", "orders.placed"]
    await broker.subscribe(longer, "g")
    assert await other.list_subscriptions() == [("orders.placed", "g")]


async def test_blocked_read_wakes_on_publish_and_ends_at_its_time(broker: MemoryBroker) -> None:
    _, view = await queue(broker)
    got: list[Delivery] = []

    async def reader() -> None:
        got.extend(await broker.read(view, "c", 10, 5_000))

    start = time.monotonic()
    async with anyio.create_task_group() as tg:
        tg.start_soon(reader)
        await anyio.sleep(0.05)
        assert not got
        await broker.publish([command("billing.refund", 1)])
    assert numbers(got) == [1] and time.monotonic() - start < 1
    start = time.monotonic()
    assert await broker.read(view, "c", 10, 150) == []
    assert 0.14 <= time.monotonic() - start < 1

    results: dict[str, list[int]] = {}

    async def racer(name: str) -> None:
        results[name] = numbers(await broker.read(view, name, 10, 300))

    start = time.monotonic()
    async with anyio.create_task_group() as tg:  # two blocked readers, one entry: one gets it, the other waits on
        tg.start_soon(racer, "a")
        tg.start_soon(racer, "b")
        await anyio.sleep(0.02)
        await broker.publish([command("billing.refund", 2)])
    assert sorted(results.values()) == [[], [2]] and time.monotonic() - start >= 0.29


async def test_concurrent_movers_move_each_retry_once(broker: MemoryBroker) -> None:
    _, view = await queue(broker)
    await broker.publish([command("billing.refund", i) for i in range(200)])
    due = now_ms()
    for d in await broker.read(view, "a", 500, 0):
        assert await broker.retry_later(d, due)
    moved: list[int] = []

    async def mover() -> None:
        while n := await broker.move_due(view, now_ms(), limit=7):
            moved.append(n)

    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(mover)
    assert sum(moved) == 200 and len(moved) > 4
    assert sorted(numbers(await broker.read(view, "a", 500, 0))) == list(range(200))


async def test_trimming_never_drops_an_entry_a_group_has_not_acked(broker: MemoryBroker) -> None:
    spec = await broker.declare(DestinationSpec("orders.placed", "event", retention_ms=1, max_length=5))
    [fast] = await broker.subscribe(spec, "fast")
    [slow] = await broker.subscribe(spec, "slow")
    await broker.publish([event("orders.placed", i) for i in range(50)])
    await broker.ack(fast, await broker.read(fast, "f", 100, 0))
    slow_got = await broker.read(slow, "s", 10, 0)  # delivered 0..9, acks only 0..4
    await broker.ack(slow, slow_got[:5])
    await anyio.sleep(0.01)
    assert await broker.trim(spec, 0, now_ms()) == 5  # only what every group acknowledged
    assert await broker.trim(spec, 0, now_ms()) == 0
    await broker.ack(slow, slow_got[5:] + await broker.read(slow, "s", 100, 0))
    assert await broker.trim(spec, 0, now_ms()) == 45  # retention 1 ms: all acked events go
    [late] = await broker.subscribe(spec, "late")
    assert await broker.read(late, "l", 100, 0) == []

    metrics = await broker.declare(DestinationSpec("metrics", "event", retention_ms=None, max_length=10))
    [view] = await broker.subscribe(metrics, "reader")
    await broker.publish([event("metrics", i) for i in range(30)])
    await broker.ack(view, await broker.read(view, "r", 100, 0))
    assert await broker.trim(metrics, 0, now_ms()) == 20
    [fresh] = await broker.subscribe(metrics, "fresh")
    assert numbers(await broker.read(fresh, "r", 100, 0)) == list(range(20, 30))  # the newest kept
    queue_spec, _ = await queue(broker)
    assert await broker.trim(queue_spec, 0, now_ms()) == 0  # queues are not trimmed


async def test_a_body_over_the_limit_stores_nothing_and_a_stored_one_decodes_as_an_error(url: str) -> None:
    producer, consumer = connect_memory(url, namespace="t"), connect_memory(url, namespace="t")
    consumer.max_body_bytes = 20
    _, view = await queue(producer)
    big = command("billing.refund", 1)
    big.body = b"x" * (producer.max_body_bytes + 1)
    with pytest.raises(MessageTooLarge):
        await producer.publish([command("billing.refund", 0), big])
    await producer.publish([Envelope("billing.refund", "command", "C", b'{"n": "' + b"y" * 30 + b'"}')])
    [d] = await consumer.read(view, "c", 10, 0)
    assert d.envelope is None and "over the limit" in (d.error or "") and d.field(b"body")
    dead = await consumer.dead_letter(d, {"dlq-reason": d.error or ""})
    assert dead is not None


# -- pending entries: own pending, claims, extend, release, prune --------------------------------------


async def test_unacked_entries_are_reread_by_their_consumer_and_claimed_after_it_stops(broker: MemoryBroker) -> None:
    _, view = await queue(broker)
    await broker.publish([command("billing.refund", i) for i in range(3)])
    assert len(await broker.read(view, "a", 10, 0)) == 3
    again = await broker.read_own_pending(view, "a", 10)
    assert numbers(again) == [0, 1, 2] and {d.delivery_count for d in again} == {2}
    after = await broker.read_own_pending(view, "a", 10, {again[0].stream: again[0].entry_id})
    assert numbers(after) == [1, 2]
    assert await broker.claim_idle(view, "b", 60_000, 10) == []
    await anyio.sleep(0.05)
    claimed = await broker.claim_idle(view, "b", 20, 10)
    assert numbers(claimed) == [0, 1, 2] and [d.delivery_count for d in claimed] == [3, 4, 4]
    assert await broker.read_own_pending(view, "a", 10) == []
    assert await broker.ack(view, claimed) == 3


async def test_extend_keeps_entries_owned_and_release_makes_them_claimable_at_once(broker: MemoryBroker) -> None:
    _, view = await queue(broker)
    await broker.publish([command("billing.refund", i) for i in range(3)])
    held = await broker.read(view, "a", 10, 0)
    await anyio.sleep(0.25)
    assert await broker.extend(view, "a", held[:1]) == frozenset({held[0].entry_id})
    claimed = await broker.claim_idle(view, "b", 200, 10)
    assert numbers(claimed) == [1, 2]  # the extended one stays a's
    extension = await broker.extend(view, "a", held)
    assert extension == frozenset({held[0].entry_id}) and extension.taken == {held[1].entry_id, held[2].entry_id}
    await broker.ack(view, claimed)
    settled = await broker.extend(view, "b", claimed)  # settled meanwhile: neither owned nor taken
    assert not settled and not settled.taken
    assert await broker.release_own_pending(view, "a", 3_600_000) == 1
    [taken] = await broker.claim_idle(view, "c", 60_000, 10)
    assert taken.entry_id == held[0].entry_id
    await broker.publish([command("billing.refund", 9)])
    [kept] = await broker.read(view, "c", 10, 0)
    assert await broker.release_own_pending(view, "c", 3_600_000, keep=[kept.entry_id]) == 1


async def test_departed_consumers_with_nothing_pending_are_pruned(broker: MemoryBroker) -> None:
    _, view = await queue(broker)
    await broker.publish([command("billing.refund", i) for i in range(3)])
    [held] = await broker.read(view, "holder", 1, 0)
    for name in ("gone", "me"):
        await broker.ack(view, await broker.read(view, name, 1, 0))
    await anyio.sleep(0.05)
    assert await broker.prune_consumers(view, 10_000) == 0
    # gone on both streams, and the holder on the redeliver stream, where it holds nothing
    assert await broker.prune_consumers(view, 10, keep="me") == 3
    assert await broker.prune_consumers(view, 10, keep="me") == 0
    assert held.entry_id


# -- settling: retries, dead letters, inbox, guarded writes ----------------------------------------


async def test_retry_later_then_move_due_delivers_to_that_group_only(broker: MemoryBroker) -> None:
    spec = await broker.declare(DestinationSpec("orders.placed", "event"))
    [billing] = await broker.subscribe(spec, "billing")
    [shipping] = await broker.subscribe(spec, "shipping")
    await broker.publish([event("orders.placed", 1)])
    [d] = await broker.read(billing, "a", 10, 0)
    assert await broker.retry_later(d, now_ms() + 60_000)
    assert not await broker.retry_later(d, now_ms())  # no longer pending: nothing parked twice
    assert await broker.move_due(billing, now_ms()) == 0  # not due yet
    assert await broker.move_due(billing, now_ms() + 61_000) == 1
    assert await broker.move_due(billing, now_ms() + 61_000) == 0  # moved once
    [again] = await broker.read(billing, "a", 10, 0)
    assert again.envelope is not None and d.envelope is not None
    assert again.envelope.id == d.envelope.id and again.attempt == 2 and again.stream != billing.stream
    assert again.field(b"first-failed-at") is not None
    assert numbers(await broker.read(shipping, "s", 10, 0)) == [1]  # shipping saw it once, from the topic
    assert await broker.read(shipping, "s", 10, 0) == []
    assert await broker.ack(billing, [again]) == 1
    bad = Delivery(billing, billing.stream, d.entry_id, [b"garbage", b"1"], None, "no id")
    with pytest.raises(ValueError, match="undecodable"):
        await broker.retry_later(bad, now_ms())


async def test_dead_letters_are_written_once_then_listed_redriven_and_purged(broker: MemoryBroker) -> None:
    _, view = await queue(broker)
    await broker.publish([command("billing.refund", 7), command("billing.refund", 8)])
    first, second = await broker.read(view, "a", 10, 0)
    reason = {"dlq-reason": "boom", "dlq-error-type": "ValueError", "dlq-attempts": "3"}
    dead = await broker.dead_letter(first, reason)
    assert dead is not None
    assert await broker.dead_letter(first, reason) is None  # no longer pending: no second entry
    assert await broker.dead_letter(second, {"dlq-reason": "bang"})
    [(dlq_id, fields), (other_id, _)] = await broker.dead_letter_entries(view)
    assert dlq_id == dead and first.envelope is not None
    assert fields[b"dlq-reason"] == b"boom" and fields[b"dlq-attempts"] == b"3"
    assert fields[b"id"] == first.envelope.id.encode() and fields[b"body"] == first.fields[b"body"]
    assert len(await broker.dead_letter_entries(view, 1)) == 1
    assert await broker.read_own_pending(view, "a", 10) == []  # acked with it

    redriven = await broker.redrive(view, dlq_id)
    assert redriven is not None and await broker.redrive(view, dlq_id) is None
    [again] = await broker.read(view, "b", 10, 0)
    assert again.message_id == first.message_id and again.attempt == 1 and again.field(b"dlq-reason") is None
    assert await broker.purge_dead_letters(view, [other_id, "1-1"]) == 1
    assert await broker.dead_letter_entries(view) == []


async def test_inbox_claim_leases_new_ids_and_reports_duplicates(broker: MemoryBroker) -> None:
    _, view = await queue(broker)
    original = command("billing.refund", 1)
    copy = command("billing.refund", 1)
    copy.id = original.id  # a re-published copy: another entry, the same message id
    await broker.publish([original, copy])
    first, second = await broker.read(view, "a", 10, 0)
    assert await broker.inbox_claim(view, [first], 60_000) == [0]  # leased to us
    assert await broker.inbox_claim(view, [second], 60_000) == [2]  # running elsewhere
    second.delivery_count = 2
    assert await broker.inbox_claim(view, [second], 60_000) == [0]  # a redelivery takes over
    assert await broker.ack(view, [first], inbox=True) == 1
    assert await broker.inbox_claim(view, [second], 60_000) == [1]  # processed: a duplicate
    assert await broker.trim_inbox(view, now_ms() + 1) == 0  # a UUIDv7's record expires alone
    await broker.publish([command("billing.refund", 2), command("billing.refund", 2)])
    a, b = await broker.read(view, "a", 10, 0)
    b.envelope.id = a.message_id  # type: ignore[union-attr]  # two copies in one batch: the first runs
    assert await broker.inbox_claim(view, [a, b], 1) == [0, 2]
    await anyio.sleep(0.01)
    assert await broker.inbox_claim(view, [b], 60_000) == [0]  # the lease expired


async def test_inbox_records_of_other_ids_are_trimmed_and_dead_letters_release_leases(broker: MemoryBroker) -> None:
    _, view = await queue(broker)
    envs = [command("billing.refund", i) for i in range(3)]
    for i, env in enumerate(envs):
        env.id = f"order-{i}"  # not a UUIDv7: kept in the inbox until trimmed
    await broker.publish(envs)
    a, b, c = await broker.read(view, "a", 10, 0)
    assert await broker.inbox_claim(view, [a, b, c], 60_000, window_ms=3_600_000) == [0, 0, 0]
    await broker.ack(view, [a], inbox=True)
    assert await broker.dead_letter(b, {"dlq-reason": "x"})
    assert await broker.retry_later(c, now_ms())
    assert await broker.inbox_claim(view, [a, b, c], 60_000) == [1, 0, 0]  # leases released
    assert await broker.trim_inbox(view, now_ms() - 60_000) == 0
    assert await broker.trim_inbox(view, now_ms() + 1) == 1  # a's record went
    assert await broker.inbox_claim(view, [a], 60_000) == [0]  # forgotten: it would run again


async def test_guarded_writes_apply_with_the_ack_unless_their_guard_fails(broker: MemoryBroker) -> None:
    _, view = await queue(broker)
    await broker.publish([command("billing.refund", i) for i in range(3)])
    ok, stale, dup = await broker.read(view, "a", 10, 0)
    ok.settle_write = GuardedWrite("saga:1", "v", "", ("v", "s"), (1, "started"))
    stale.settle_write = GuardedWrite("saga:1", "v", "0", ("v",), (9,))
    assert await broker.ack(view, [ok, stale], inbox=True) == 1
    assert (ok.settle_write.outcome, stale.settle_write.outcome) == (GuardedWrite.APPLIED, GuardedWrite.CONFLICT)
    assert broker.server.hash("saga:1") == {b"v": b"1", b"s": b"started"}
    assert numbers(await broker.read_own_pending(view, "a", 10)) == [1, 2]  # left pending
    dup.envelope.id = ok.message_id  # type: ignore[union-attr]  # processed before: skipped, acked as usual
    dup.settle_write = GuardedWrite("saga:1", "v", "1", ("v",), (2,))
    assert await broker.ack(view, [dup], inbox=True) == 1
    assert dup.settle_write.outcome == GuardedWrite.SKIPPED and broker.server.hash("saga:1")[b"v"] == b"1"


async def test_attempt_counters(broker: MemoryBroker) -> None:
    _, view = await queue(broker)
    await broker.publish([command("billing.refund", i) for i in range(2)])
    a, b = await broker.read(view, "a", 10, 0)
    assert await broker.count_first_redeliveries([a, b]) == [True, True]
    assert await broker.count_first_redeliveries([a]) == [False]
    assert await broker.count_attempt(a) == 2
    a.delivery_count = 2
    await broker.ack(view, [a])  # a redelivered run's ack drops its counter
    assert await broker.count_first_redeliveries([a, b]) == [True, False]


async def test_idempotency_key_stores_a_message_once_per_window(broker: MemoryBroker) -> None:
    spec = await broker.declare(DestinationSpec("orders.placed", "event", partitions=4))
    views = await broker.subscribe(spec, "billing")

    def once(n: int, idem: str) -> Envelope:
        env = event("orders.placed", n)  # no message key: the idempotency key picks the partition
        env.headers[IDEMPOTENCY_KEY] = idem
        return env

    ids = [(await broker.publish([once(i, "POST /orders 42")]))[0] for i in range(3)]
    ids += await broker.publish([once(3, "POST /orders 42"), once(4, "POST /orders 42"), event("orders.placed", 5)])
    assert ids[0] is not None and ids[1:5] == [None] * 4 and ids[5] is not None
    assert sorted(await read_all(broker, views)) == [0, 5]
    window = 300
    assert (await broker.publish([once(6, "short")], dedup_window_ms=window))[0] is not None
    assert await broker.publish([once(7, "short")], dedup_window_ms=60_000) == [None]  # its own window counts
    await anyio.sleep(0.35)
    assert (await broker.publish([once(8, "short")], dedup_window_ms=window))[0] is not None  # expired
    # the retention job forgets keys whose window ended (here: in the future, a day's window) in their partition
    partition = spec.partition_for(None, "POST /orders 42")
    assert await broker.trim(spec, partition, now_ms() + 2 * 24 * 3600 * 1000) == 0  # (the entries are pending)
    assert (await broker.publish([once(9, "POST /orders 42")]))[0] is not None


# -- ownership: leases, fencing, take-over, heartbeats ---------------------------------------------


async def test_settling_with_a_stale_token_raises_lease_lost_and_changes_nothing(broker: MemoryBroker) -> None:
    _, view = await queue(broker)
    await broker.publish([command("billing.refund", i) for i in range(3)])
    old = await broker.acquire_lease(view, "i1", 100)
    assert old == 1 and await broker.acquire_lease(view, "i2", 60_000) == 0  # held
    held = await broker.read(view, "i1", 10, 0, token=old)
    assert await broker.renew_leases([(view, old)], "i1", 50) == [True]
    await anyio.sleep(0.08)
    new = await broker.acquire_lease(view, "i2", 60_000)  # expired: taken over
    assert new == 2 and await broker.renew_leases([(view, old)], "i1", 50) == [False]
    for settle in (
        broker.ack(view, held, token=old),
        broker.dead_letter(held[0], {"dlq-reason": "x"}, token=old),
        broker.retry_later(held[0], now_ms(), token=old),
        broker.read(view, "i1", 10, 0, token=old),
        broker.claim_idle(view, "i1", 0, 10, token=old),
    ):
        with pytest.raises(LeaseLost, match="owned by another instance"):
            await settle
    assert await broker.read(view, "i2", 10, 0, token=new) == []  # nothing new
    cursors: dict[str, str] = {}
    taken: list[Delivery] = []
    while not broker.taken_over(cursors):
        taken += await broker.take_over(view, "i2", 2, cursors, token=new)
    assert numbers(taken) == [0, 1, 2] and {d.delivery_count for d in taken} == {2}
    assert await broker.ack(view, taken, token=new) == 3
    assert not await broker.release_lease(view, "i1", old)
    assert await broker.release_lease(view, "i2", new)
    assert await broker.acquire_lease(view, "i1", 60_000) == 3  # tokens never go back
    assert await broker.acquire_lease(view, "i1", 60_000) == 4  # its own name: again


async def test_heartbeats_list_the_live_instances(broker: MemoryBroker) -> None:
    assert await broker.heartbeat("orders", "g", "b", 60_000) == ["b"]
    assert await broker.heartbeat("orders", "g", "a", 200) == ["a", "b"]
    await anyio.sleep(0.25)
    assert await broker.heartbeat("orders", "g", "b", 60_000) == ["b"]  # a's heartbeat ended
    assert await broker.heartbeat("orders", "g", "b", 60_000, leave=True) == []


# -- scheduling ------------------------------------------------------------------------------------


async def test_scheduled_messages_are_moved_when_due_or_cancelled(broker: MemoryBroker) -> None:
    _, view = await queue(broker)
    due = now_ms() + 60_000
    later = [command("billing.refund", i) for i in range(3)]
    for env in later:
        env.headers[DELIVER_AT] = str(due)
    later[2].headers[DELIVER_AT] = str(due + 1000)
    past = command("billing.refund", 9)
    past.headers[DELIVER_AT] = str(now_ms() - 1)
    replies = await broker.publish([*later, past])
    assert replies[:3] == [e.id for e in later] and replies[3] != past.id  # a past one is appended now
    assert numbers(await broker.read(view, "c", 10, 0)) == [9]
    assert await broker.count_scheduled() == 3 and await broker.count_scheduled("other") == 0
    listed = await broker.scheduled_messages(destination="billing.refund")
    assert [m.message_id for m in listed] == [e.id for e in later] and listed[0].due_ms == due
    assert listed[0].envelope is not None and listed[0].envelope.id == later[0].id
    assert [m.message_id for m in await broker.scheduled_messages(message_ids=[later[1].id])] == [later[1].id]
    assert await broker.cancel_scheduled([later[1].id, "nope"]) == 1
    result = await broker.move_scheduled(now_ms())
    assert (result.moved, result.next_due_ms, result.more) == (0, due, False)
    result = await broker.move_scheduled(due, limit=1)
    assert (result.moved, result.next_due_ms) == (1, due + 1000)
    assert numbers(await broker.read(view, "c", 10, 0)) == [0]
    assert (await broker.move_scheduled(due + 1000)).moved == 1
    assert (await broker.move_scheduled(due + 1000)).next_due_ms is None
    assert numbers(await broker.read(view, "c", 10, 0)) == [2]
    assert await broker.cancel_scheduled([later[0].id]) == 0  # delivered already


async def test_fire_tick_codes(broker: MemoryBroker) -> None:
    spec, view = await queue(broker, "jobs.nightly", "jobs")
    tick = Envelope("jobs.nightly", "command", "Tick", b"{}")
    assert await broker.fire_tick("jobs.nightly", 1000, tick) == -1  # first tick seen: the baseline
    assert await broker.fire_tick("jobs.nightly", 1000, tick) == 0
    assert await broker.fire_tick("jobs.nightly", 2000, tick) == 1  # fired
    assert await broker.fire_tick("jobs.nightly", 2000, tick) == 0  # fired before
    assert await broker.fire_tick("jobs.nightly", 1500, tick) == 0  # a later one was
    [d] = await broker.read(view, "c", 10, 0)
    assert d.envelope is not None and d.envelope.type == "Tick"
    assert spec.name == "jobs.nightly"


# -- administration ----------------------------------------------------------------------------------


async def test_unsubscribe_and_delete_destination(broker: MemoryBroker) -> None:
    spec, view = await queue(broker)
    await broker.publish([command("billing.refund", 1)])
    with pytest.raises(ConfigurationError, match="1 consumer group"):
        await broker.delete_destination(spec)
    [d] = await broker.read(view, "c", 10, 0)
    await broker.dead_letter(d, {"dlq-reason": "x"})
    await broker.unsubscribe(spec, "billing")
    assert await broker.list_subscriptions() == []
    with pytest.raises(ConfigurationError, match="NOGROUP"):
        await broker.read(view, "c", 10, 0)
    [view] = await broker.subscribe(spec, "billing")
    assert await broker.dead_letter_entries(view) == []  # went with the group
    await broker.unsubscribe(spec, "billing")
    assert await broker.delete_destination(spec) >= 1  # no group, no entry: allowed
    assert await broker.get_destination("billing.refund") is None
    assert await broker.list_destinations() == []

    spec, view = await queue(broker)
    await broker.publish([command("billing.refund", 1)])

    async def blocked() -> None:
        with pytest.raises(ConfigurationError, match="NOGROUP"):
            await broker.read(view, "c", 10, 5_000)

    await broker.read(view, "c", 10, 0)
    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(blocked)
            await anyio.sleep(0.02)
            assert await broker.delete_destination(spec, force=True) >= 1  # a blocked read learns at once


async def test_introspection_reports_depth_pending_lag_and_usage(broker: MemoryBroker) -> None:
    spec = await broker.declare(DestinationSpec("orders.placed", "event", partitions=2))
    views = await broker.subscribe(spec, "billing")
    await broker.publish([event("orders.placed", i, key="k") for i in range(5)])
    view = next(v for v in views if v.partition == spec.partition_for("k", ""))
    got = await broker.read(view, "c", 2, 0)
    assert await broker.inbox_claim(view, got, 60_000) == [0, 0]
    inspect_ = as_introspection(broker)
    state = await inspect_.group_state(view)
    assert (state.consumers, state.pending, state.lag, state.delayed, state.dead_letters) == (1, 2, 3, 0, 0)
    assert not state.idle and state.inbox.ids == 2
    await broker.retry_later(got[0], now_ms() + 60_000)
    await broker.dead_letter(got[1], {"dlq-reason": "x"})
    await broker.ack(view, await broker.read(view, "c", 10, 0))
    state = await inspect_.group_state(view)
    assert (state.pending, state.lag, state.delayed, state.dead_letters) == (0, 0, 1, 1) and state.idle
    assert await inspect_.dead_letter_count(view) == 1
    token = await broker.acquire_lease(view, "i1", 60_000)
    [described] = await inspect_.describe(["orders.placed"])
    part = described.partitions[view.partition]
    assert described.depth == 5 and part.length == 5 and [g.group for g in part.groups] == ["billing"]
    lease = part.groups[0].lease
    assert lease is not None and (lease.owner, lease.token) == ("i1", token) and lease.expires_in_ms > 0
    with pytest.raises(ValueError, match="unknown destination"):
        await inspect_.describe(["nope"])
    usage = await inspect_.group_usage(spec, "billing")
    assert (usage.start, usage.retained, usage.delivered, usage.unread, usage.dead, usage.retries) == (
        "earliest",
        5,
        5,
        0,
        1,
        1,
    )
    assert [c.name for c in usage.consumers] == ["c"] and usage.oldest_ms is not None
    assert await inspect_.destination_usage(spec) == DestinationUsage(["billing"], 5, 1)
    assert [e.key for e in await inspect_.stored_messages(spec)] == ["k"] * 5
