"""Partition ownership across processes: leases, fencing, take-over, and order per key under faults.

Broker level: a stale owner (its lease taken over) gets every ack and settle refused by the
fencing check, changing nothing. End to end: real worker processes (tests/apps/ownerapp.py) over
an 8-partition queue, SIGKILLed and restarted at random, one SIGSTOPped past its lease and resumed;
the handler applies (key, seq) through its Redis effects (fenced, atomic with the ack) and checks
that no key runs in two instances at once.
"""

from __future__ import annotations

import functools

import anyio
import orjson
import pytest

from broker import ConfigurationError, DestinationSpec, Envelope, LeaseLost
from broker.redis import RedisBroker
from broker.redis.effects import RedisEffects
from framework.runtime.ownership import assign
from tests.ordered_workload import run_ordered_workload
from tests.workers import Workers

# -- assignment -------------------------------------------------------------------------------------


def test_assignment_is_fair_deterministic_and_moves_little() -> None:
    three = assign(8, ["c", "a", "b"])
    assert three == assign(8, ["a", "b", "c"])
    loads = sorted(list(three.values()).count(m) for m in "abc")
    assert loads == [2, 3, 3]
    four = assign(8, ["a", "b", "c", "d"])
    assert sorted(list(four.values()).count(m) for m in "abcd") == [2, 2, 2, 2]
    assert assign(8, []) == {}
    assert set(assign(8, ["solo"]).values()) == {"solo"}


# -- broker level: leases and fencing ------------------------------------------------------------------


@pytest.mark.anyio
async def test_leases_expire_and_every_acquisition_raises_the_token(broker: RedisBroker) -> None:
    spec = await broker.declare(DestinationSpec("own.lease", "command", partitions=2))
    view = (await broker.subscribe(spec, "g"))[0]
    first = await broker.acquire_lease(view, "a", 300)
    assert first == 1
    assert await broker.acquire_lease(view, "b", 300) == 0  # live lease held by a
    assert await broker.renew_leases([(view, first)], "a", 300) == [True]
    await anyio.sleep(0.4)
    second = await broker.acquire_lease(view, "b", 300)
    assert second == 2
    assert await broker.renew_leases([(view, first)], "a", 300) == [False]  # taken over
    assert not await broker.release_lease(view, "a", first)
    state = await broker.lease_state(view)
    assert (state.owner, state.token, state.live) == ("b", 2, True)
    assert await broker.release_lease(view, "b", second)
    assert (await broker.lease_state(view)).owner == ""
    assert await broker.acquire_lease(view, "a", 300) == 3  # tokens never go back
    assert await broker.heartbeat("own.lease", "g", "b", 300) == ["b"]
    assert await broker.heartbeat("own.lease", "g", "a", 300) == ["a", "b"]
    assert await broker.heartbeat("own.lease", "g", "b", 300, leave=True) == ["a"]


@pytest.mark.anyio
async def test_a_stale_owner_gets_every_ack_and_settle_refused(broker: RedisBroker) -> None:
    spec = await broker.declare(DestinationSpec("own.fenced", "command", partitions=2))
    views = await broker.subscribe(spec, "g")
    await broker.publish(
        [
            Envelope(destination="own.fenced", kind="command", type="T", key="k", body=orjson.dumps({"n": n}))
            for n in range(4)
        ]
    )
    view = [v for v in views if await broker.redis.xlen(v.stream) == 4][0]  # noqa: RUF015 - awaits inside
    stale = await broker.acquire_lease(view, "old", 200)
    deliveries = await broker.read(view, "old", 10, 0)
    assert len(deliveries) == 4
    await anyio.sleep(0.3)  # the old owner pauses past its lease; a new owner takes over
    current = await broker.acquire_lease(view, "new", 5000)
    assert current > stale
    d0, d1, d2, d3 = deliveries
    effects_key = f"{broker.namespace}:own:effects"
    refused = 0
    for call in (
        lambda: broker.ack(view, [d0], inbox=True, token=stale),
        lambda: broker.retry_later(d1, 0, token=stale),
        lambda: broker.dead_letter(d2, {"dlq-reason": "x"}, token=stale),
        lambda: broker.commit_effects(d3, RedisEffects.of(("SET", effects_key, "1")), token=stale),
    ):
        with pytest.raises(LeaseLost):
            await call()
        refused += 1
    assert refused == 4
    # nothing changed: every entry still pending, no retry parked, no dead letter, no effect
    assert len(await broker.redis.execute_command("XPENDING", view.stream, "g", "-", "+", 10)) == 4
    assert await broker.redis.zcard(view.keys.delayed) == 0
    assert await broker.redis.xlen(view.keys.dlq) == 0
    assert await broker.redis.get(effects_key) is None
    # the new owner takes the entries over and settles them with its token
    cursors: dict[str, str] = {}
    taken = await broker.take_over(view, "new", 10, cursors)
    while not broker.taken_over(cursors):
        taken += await broker.take_over(view, "new", 10, cursors)
    assert [d.entry_id for d in taken] == [d.entry_id for d in deliveries]
    assert all(d.delivery_count == 2 for d in taken)
    assert await broker.ack(view, taken[:1], token=current) == 1
    assert await broker.retry_later(taken[1], 0, token=current)
    assert await broker.dead_letter(taken[2], {"dlq-reason": "x"}, token=current) is not None
    assert await broker.commit_effects(taken[3], RedisEffects.of(("SET", effects_key, "1")), token=current)
    assert await broker.redis.get(effects_key) == b"1"
    # without a token (an unowned destination) nothing is checked
    await broker.publish([Envelope(destination="own.fenced", kind="command", type="T", key="k", body=b"{}")])
    [fresh] = await broker.read(view, "anyone", 10, 0)
    assert await broker.ack(view, [fresh]) == 1


@pytest.mark.anyio
async def test_a_stale_owner_reads_and_claims_nothing(broker: RedisBroker) -> None:
    """A read or claim reaching the server after the lease moved (a paused process resumed past its
    local check) takes nothing: taken, the entries would wait with the old owner while the new
    one ran later entries of their keys. A fenced read of the holder waits for new entries."""
    await check_fenced_intake(broker)


async def check_fenced_intake(broker: RedisBroker) -> None:
    """The stale owner's reads and claims are refused, the holder's go on (also run on a cluster)."""
    spec = await broker.declare(DestinationSpec("own.intake", "command", partitions=1))
    [view] = await broker.subscribe(spec, "g")

    def envelopes(start: int, n: int) -> list[Envelope]:
        body = lambda i: orjson.dumps({"n": i})  # noqa: E731
        return [
            Envelope(destination="own.intake", kind="command", type="T", key="k", body=body(i))
            for i in range(start, start + n)
        ]

    await broker.publish(envelopes(0, 3))
    stale = await broker.acquire_lease(view, "old", 200)
    [first] = await broker.read(view, "old", 1, 0, token=stale)  # the holder reads
    await anyio.sleep(0.3)  # paused past the lease; a new owner acquires
    current = await broker.acquire_lease(view, "new", 5000)
    channel = broker.channel()  # the runtime's reads go on a channel (WATCH/MULTI); None on a cluster (a script)
    ways = [channel, None] if channel is not None else [None]
    for call in (
        *(
            functools.partial(broker.read, view, "old", 10, block, channel=ch, token=stale)
            for ch in ways
            for block in (0, 200)
        ),
        lambda: broker.claim_idle(view, "old", 0, 10, token=stale),
        lambda: broker.take_over(view, "old", 10, {}, token=stale),
    ):
        with pytest.raises(LeaseLost):
            await call()
    rows = await broker.redis.execute_command("XPENDING", view.stream, "g", "-", "+", 10)
    assert [(r[0].decode(), r[1].decode()) for r in rows] == [(first.entry_id, "old")]  # nothing more taken
    cursors: dict[str, str] = {}
    taken = await broker.take_over(view, "new", 10, cursors, token=current)
    while not broker.taken_over(cursors):
        taken += await broker.take_over(view, "new", 10, cursors, token=current)
    assert [d.entry_id for d in taken] == [first.entry_id]
    rest = await broker.read(view, "new", 10, 0, channel=channel, token=current)
    assert [d.envelope.body for d in rest if d.envelope] == [b'{"n":1}', b'{"n":2}']
    for n, ch in enumerate(ways, start=3):
        assert await broker.read(view, "new", 10, 0, channel=ch, token=current) == []

        async def publish_later(n: int = n) -> None:
            await anyio.sleep(0.2)
            await broker.publish(envelopes(n, 1))

        async with anyio.create_task_group() as tg:  # nothing new: the holder's read waits for the next entry
            tg.start_soon(publish_later)
            with anyio.fail_after(3):
                [woken] = await broker.read(view, "new", 10, 2000, channel=ch, token=current)
        assert woken.envelope is not None and woken.envelope.body == orjson.dumps({"n": n})
        await anyio.sleep(0.5)
        assert await broker.read(view, "new", 10, 100, channel=ch, token=current) == []  # times out empty
        # ... and its consumer was seen meanwhile (an idle owner is not taken for a departed one)
        seen = {c["name"]: c["idle"] for c in await broker.redis.xinfo_consumers(view.stream, "g")}
        assert seen[b"new"] < 400, seen
    if channel is not None:
        await channel.aclose()


@pytest.mark.anyio
async def test_changing_the_partition_count_of_a_live_destination_is_refused(broker: RedisBroker) -> None:
    """Keys would move between partitions and reorder: refused, with what to do instead."""
    await broker.declare(DestinationSpec("own.resized", "command", partitions=2))
    with pytest.raises(ConfigurationError, match=r"already has 2 partition.*cannot be declared with 8"):
        await broker.declare(DestinationSpec("own.resized", "command", partitions=8))
    with pytest.raises(ConfigurationError, match="use a new destination name"):
        await broker.subscribe(DestinationSpec("own.resized", "command", partitions=8), "g")


# -- end to end: worker processes under faults -------------------------------------------------------


@pytest.mark.slow
@pytest.mark.fault
def test_keys_keep_their_order_across_workers_killed_restarted_and_paused(
    workers: Workers, redis_url: str, namespace: str
) -> None:
    """3 workers, 8 partitions, 100 keys, 20,000 messages sent over about 20 s while workers are
    SIGKILLed and restarted at random and one is SIGSTOPped past its lease, then resumed
    (tests/ordered_workload.py; the same on a 3-master cluster in tests/test_cluster.py)."""
    run_ordered_workload(workers, redis_url, namespace, messages=20_000)
