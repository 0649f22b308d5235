"""Sagas (process managers), on real servers and real worker processes.

The example of docs/sagas.md (tests/apps/sagaapp.py): shipping waits for a payment and a stock
reservation of one order, in either order, ships once, and cancels with a compensation when its
timeout fires first. Each order must end shipped exactly once or cancelled exactly once, never
both, under duplicates, reordering, worker kills and the timeout racing the last message. And the
optimistic version check: a commit whose guard no longer holds changes nothing.
"""

from __future__ import annotations

import random
import signal
import time
from typing import Any

import anyio
import attrs
import orjson
import pytest
import redis

from broker import DestinationSpec, Envelope, GuardedWrite, LeaseLost, new_id
from broker.errors import EffectsConflict
from broker.redis import RedisBroker
from broker.redis.keys import KeySpace
from framework import Client, HandlerError, Service, SyncClient
from framework.saga import SAGA_INPUT, SagaContext, SagaError, SagaRetryPolicy
from framework.testing import TEST_SETTINGS, ServiceHarness
from tests.apps import sagaapp
from tests.apps.sagaapp import PAYMENTS, STOCK, PaymentCaptured, StockReserved, record_key
from tests.workers import Workers, wait_for

# -- the version guard, at the broker -------------------------------------------------------------


async def _pending(broker: RedisBroker, stream: str) -> int:
    return int((await broker.redis.execute_command("XPENDING", stream, "g"))[0])


@pytest.mark.anyio
async def test_a_commit_whose_version_moved_on_writes_sends_and_acks_nothing(broker: RedisBroker) -> None:
    spec = await broker.declare(DestinationSpec("saga.guard", "command"))
    [view] = await broker.subscribe(spec, "g")
    await broker.publish([Envelope(destination="saga.guard", kind="command", type="t", body=b"{}", id=new_id())])
    [d] = await broker.read(view, "c", 10, 10)
    state = f"{view.stream}:saga:o-1"  # the saga's layout: under the partition's hash tag
    out = f"{broker.keyspace.namespace}:{{saga.out:0}}"
    await broker.declare(DestinationSpec("saga.out", "command"))
    await broker.redis.hset(state, mapping={"v": 2, "s": "{}"})

    tx = broker.effects()
    tx.expect(state, "v", 1)  # the step read version 1; another step has saved 2 since
    tx.hset(state, "v", 2, "s", '{"stale": true}')
    sent = Envelope(destination="saga.out", kind="command", type="t", body=b"{}", id=new_id())
    with pytest.raises(EffectsConflict, match="run the handler again"):
        await broker.commit_effects(d, tx, [sent])
    assert await broker.redis.hgetall(state) == {b"v": b"2", b"s": b"{}"}  # nothing written
    assert await broker.redis.xlen(out) == 0  # nothing sent
    assert await _pending(broker, view.stream) == 1  # not acked: the step runs again

    tx = broker.effects()
    tx.expect(state, "v", 2)
    tx.hset(state, "v", 3, "s", '{"fresh": true}')
    assert await broker.commit_effects(d, tx, [sent]) is True
    assert await broker.redis.hget(state, "v") == b"3"
    assert await broker.redis.xlen(out) == 1
    assert await _pending(broker, view.stream) == 0

    # expect(..., None): the field must be absent (a saga's first message)
    await broker.publish([Envelope(destination="saga.guard", kind="command", type="t", body=b"{}", id=new_id())])
    [d2] = await broker.read(view, "c", 10, 10)
    tx = broker.effects()
    tx.expect(state, "v", None)
    tx.hset(state, "v", 1)
    with pytest.raises(EffectsConflict):
        await broker.commit_effects(d2, tx)
    assert await broker.redis.hget(state, "v") == b"3"


@pytest.mark.anyio
async def test_state_writes_sent_with_the_acks_are_guarded_and_hold_back_what_they_do_not_write(
    broker: RedisBroker,
) -> None:
    """``ack`` with guarded writes (how a saga step on an owned partition saves its state): a write
    whose guard holds is applied with the ack; a failed guard or a refused write leaves its message
    pending and out of the inbox; a duplicate or an entry no longer pending is acked without its
    write, so an ack repeated after a lost reply writes nothing again; a fenced call writes nothing."""
    spec = await broker.declare(DestinationSpec("saga.acked", "command"))
    [view] = await broker.subscribe(spec, "g")
    envs = [Envelope(destination="saga.acked", kind="command", type="t", body=b"{}", id=new_id()) for _ in range(4)]
    await broker.publish(envs)
    ds = await broker.read(view, "c", 10, 10)
    assert len(ds) == 4
    keys = [f"{view.stream}:saga:o-{i}" for i in range(4)]
    await broker.redis.hset(keys[1], "v", 5)  # moved on: d1's guard (absent) fails
    await broker.redis.set(keys[3], "not a hash")  # d3's write is refused (WRONGTYPE)
    for d, key in zip(ds, keys, strict=True):
        d.settle_write = GuardedWrite(key, "v", "", ("v", "s"), (1, b'{"n": 1}'))
    assert await broker.ack(view, ds, inbox=True) == 2
    outcomes = [d.settle_write.outcome for d in ds if d.settle_write is not None]
    assert outcomes == [GuardedWrite.APPLIED, GuardedWrite.CONFLICT, GuardedWrite.APPLIED, GuardedWrite.FAILED]
    assert "WRONGTYPE" in ds[3].settle_write.error  # type: ignore[union-attr]
    assert await broker.redis.hgetall(keys[0]) == {b"v": b"1", b"s": b'{"n": 1}'}
    assert await broker.redis.hgetall(keys[1]) == {b"v": b"5"}
    pending = await broker.redis.execute_command("XPENDING", view.stream, "g", "-", "+", 10)
    assert sorted(row[0].decode() for row in pending) == sorted([ds[1].entry_id, ds[3].entry_id])
    # held back: not recorded as processed (1: processed, 0: new, leased to the caller)
    assert await broker.inbox_claim(view, ds, 60_000) == [1, 0, 1, 0]

    # The same ack again (its reply was lost): the applied entries are no longer pending, so
    # nothing is written twice; d1 with its guard now right is applied.
    await broker.redis.hset(keys[0], "s", "after")
    ds[1].settle_write = GuardedWrite(keys[1], "v", "5", ("v",), (6,))
    await broker.ack(view, ds[:3], inbox=True)
    assert [d.settle_write.outcome for d in ds[:3]] == [  # type: ignore[union-attr]
        GuardedWrite.SKIPPED,
        GuardedWrite.APPLIED,
        GuardedWrite.SKIPPED,
    ]
    assert await broker.redis.hget(keys[0], "s") == b"after"
    assert await broker.redis.hget(keys[1], "v") == b"6"

    # A duplicate (its message id already processed) is acked without its write.
    await broker.publish([Envelope(destination="saga.acked", kind="command", type="t", body=b"{}", id=envs[0].id)])
    [dup] = await broker.read(view, "c", 10, 10)
    dup.settle_write = GuardedWrite(keys[0], "v", "1", ("v",), (2,))
    assert await broker.ack(view, [dup], inbox=True) == 1
    assert dup.settle_write.outcome == GuardedWrite.SKIPPED
    assert await broker.redis.hget(keys[0], "v") == b"1"

    # Fenced: a stale token writes and acks nothing.
    token = await broker.acquire_lease(view, "me", 5_000)
    ds[3].settle_write = GuardedWrite(keys[2], "v", "1", ("v",), (99,))
    with pytest.raises(LeaseLost):
        await broker.ack(view, [ds[3]], inbox=True, token=token + 1)
    assert ds[3].settle_write.outcome is None
    assert await broker.redis.hget(keys[2], "v") == b"1"

    # With the current token: applied; the same call repeated (a lost reply) is skipped by its
    # inbox record (a fenced call does not look the entry up in the pending list), even with the
    # guard holding again.
    assert await broker.ack(view, [ds[3]], inbox=True, token=token) == 1
    assert ds[3].settle_write.outcome == GuardedWrite.APPLIED
    await broker.redis.hset(keys[2], "v", 1)
    assert await broker.ack(view, [ds[3]], inbox=True, token=token) == 0
    assert ds[3].settle_write.outcome == GuardedWrite.SKIPPED
    assert await broker.redis.hget(keys[2], "v") == b"1"


@pytest.mark.anyio
async def test_guarded_writes_of_any_shape_share_one_ack(broker: RedisBroker) -> None:
    """Writes of different guards and field lists in one ack call (the call describes each list
    once): every hash gets exactly its own fields and values; one of no fields is refused."""
    spec = await broker.declare(DestinationSpec("saga.shapes", "command"))
    [view] = await broker.subscribe(spec, "g")
    shapes: list[tuple[str, tuple[str, ...], tuple[object, ...]]] = [
        ("v", ("v",), (1,)),
        ("v", ("v", "s"), (1, b"two")),
        ("g", ("a", "b", "c", "d"), ("A", b"B", 3, "D")),
        ("v", ("v", "s", "t"), (1, "x", "{}")),
        ("v", ("v", "s"), (7, b"again")),  # the second shape again
        ("v", (), ()),  # nothing to write: refused by the server
    ]
    envs = [Envelope(destination="saga.shapes", kind="command", type="t", body=b"{}", id=new_id()) for _ in shapes]
    await broker.publish(envs)
    ds = await broker.read(view, "c", 10, 10)
    keys = [f"{view.stream}:saga:shape-{i}" for i in range(len(shapes))]
    for d, key, (guard, names, values) in zip(ds, keys, shapes, strict=True):
        d.settle_write = GuardedWrite(key, guard, "", names, values)
    assert await broker.ack(view, ds, inbox=True) == len(shapes) - 1
    assert [d.settle_write.outcome for d in ds if d.settle_write] == [GuardedWrite.APPLIED] * 5 + [GuardedWrite.FAILED]
    for key, (_, names, values) in zip(keys[:-1], shapes[:-1], strict=True):
        stored = await broker.redis.hgetall(key)
        assert stored == {
            n.encode(): str(v).encode() if not isinstance(v, bytes) else v for n, v in zip(names, values, strict=True)
        }
    assert not await broker.redis.exists(keys[-1])
    with pytest.raises(ValueError, match="names 2 fields for 1 values"):
        GuardedWrite("k", "v", "", ("v", "s"), (1,))


def test_conflicts_are_retried_at_once_and_never_dead_letter_the_step() -> None:
    policy = SagaRetryPolicy(max_attempts=2)
    assert policy.decide(5, EffectsConflict("x")).action == "retry"  # past max_attempts: still retried
    assert policy.decide(2, RuntimeError("x")).action == "dead"


def test_declaration_errors_name_the_step() -> None:
    svc = Service("decl")
    saga = svc.saga("s", state=dict)

    with pytest.raises(HandlerError, match="takes \\(message, ctx: SagaContext\\)"):

        @saga.event("decl.e", correlate=lambda e: e["id"])
        async def no_ctx(event: dict) -> None: ...

    @saga.event("decl.e2", correlate=lambda e: e["id"])
    async def ok(event: dict, ctx: SagaContext[dict]) -> None: ...

    with pytest.raises(HandlerError, match="already"):

        @saga.event("decl.e2", correlate=lambda e: e["id"])
        async def again(event: dict, ctx: SagaContext[dict]) -> None: ...

    assert [h.destination.name for h in svc.handlers] == ["decl.saga.s", "decl.e2"]
    assert svc.handlers[0].destination.partitions == 4


# -- one message per saga at a time, with two runtimes on shared partitions ----------------------------

counting = Service("counting")
counter = counting.saga("counter", state=dict, partitions=1)


@counter.event("count.ticks", correlate=lambda e: e["k"])
async def tick(event: dict, ctx: SagaContext[dict]) -> None:
    n = ctx.state.get("n", 0)
    await anyio.sleep(0.03)  # widen the window between the load and the save: runs overlap
    ctx.state["n"] = n + 1


async def trickle_to_two_runtimes(
    service: Service, redis_url: str, namespace: str, topic: str, n: int, timeout: float
) -> list[dict[str, Any]]:
    """Publish ``n`` events (keys k0-k2) one at a time to ``topic`` while two runtimes of ``service``
    with ownership off share its saga queue's partition; each runtime's stats of the saga step."""
    settings = attrs.evolve(TEST_SETTINGS, ownership="off")
    step = f"{service.name}.saga_counter"
    async with (
        ServiceHarness([service], url=redis_url, namespace=namespace, settings=settings) as a,
        ServiceHarness([service], url=redis_url, namespace=namespace, settings=settings) as b,
    ):
        for i in range(n):  # a trickle: each new entry goes to whichever runtime is waiting for one
            await a.client.publish(topic, {"k": f"k{i % 3}"})
            await anyio.sleep(0.003)
        with anyio.fail_after(timeout):
            while True:
                await a.run_until_idle()
                await b.run_until_idle()
                stats = [h.stats()[step] for h in (a, b)]
                if sum(s["processed"] for s in stats) >= n:
                    return stats
                await anyio.sleep(0.1)


@pytest.mark.anyio
async def test_two_runtimes_on_one_shared_partition_lose_no_update(redis_url: str, namespace: str) -> None:
    """Ownership off: both runtimes read the saga queue's one partition, so steps of one saga run
    at once in two processes; the version check makes the loser run again on the new state."""
    stats = await trickle_to_two_runtimes(counting, redis_url, namespace, "count.ticks", 150, 30)
    key = f"{KeySpace(namespace).partition(counter.queue.name, 0).stream}:saga:"
    r = redis.Redis.from_url(redis_url)
    states = {k: orjson.loads(r.hget(key + k, "s")) for k in ("k0", "k1", "k2")}
    r.close()
    assert states == {"k0": {"n": 50}, "k1": {"n": 50}, "k2": {"n": 50}}
    assert all(s["processed"] > 0 for s in stats), stats  # both ran steps
    assert sum(s["retried"] for s in stats) > 0, stats  # and some conflicted: the check was needed
    assert sum(s["dead_lettered"] for s in stats) == 0


# -- the state a worker keeps after saving it ---------------------------------------------------------

tallies = Service("tallies")
tally = tallies.saga("tally", state=dict, partitions=1)


@tally.command("tally.add", correlate=lambda c: c["k"])
async def add(cmd: dict, ctx: SagaContext[dict]) -> None:
    ctx.state["n"] = ctx.state.get("n", 0) + cmd["n"]


@pytest.mark.anyio
async def test_a_kept_state_another_process_moved_on_from_is_read_again(redis_url: str, namespace: str) -> None:
    """The worker keeps the state it saved, so the next step of that instance skips the read; when
    another process saved a newer version meanwhile, the kept one fails the version guard, is
    dropped, and the step runs again on the stored state: no update is lost or applied on a stale one."""
    async with ServiceHarness([tallies], url=redis_url, namespace=namespace) as h:
        await h.client.send("tally.add", {"k": "a", "n": 1})
        await h.run_until_idle()
        key = f"{h.broker.keyspace.partition(tally.queue.name, 0).stream}:saga:a"
        assert await h.broker.redis.hget(key, "v") == b"1"
        # another process's step (the partition's owner before us, say) moves the instance on
        await h.broker.redis.hset(key, mapping={"v": 7, "s": orjson.dumps({"n": 100})})
        await h.client.send("tally.add", {"k": "a", "n": 1})
        await h.run_until_idle()
        assert orjson.loads(await h.broker.redis.hget(key, "s")) == {"n": 101}
        assert await h.broker.redis.hget(key, "v") == b"8"
        stats = h.stats()["tallies.saga_tally"]
        assert stats["retried"] == 1, stats  # the kept state was used, conflicted once, then read afresh
        await h.client.send("tally.add", {"k": "a", "n": 1})  # kept again after that commit: no conflict
        await h.run_until_idle()
        assert orjson.loads(await h.broker.redis.hget(key, "s")) == {"n": 102}
        assert h.stats()["tallies.saga_tally"]["retried"] == 1


@pytest.mark.anyio
async def test_kept_states_stay_within_their_byte_budget(
    redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The least recently saved states go first once the kept JSON passes ``STATE_CACHE_BYTES``."""
    monkeypatch.setattr("framework.saga.STATE_CACHE_BYTES", 40)  # {"n":1} + {}: 9 bytes an instance
    tally._cached.clear()
    tally._cached_bytes = 0
    async with ServiceHarness([tallies], url=redis_url, namespace=namespace) as h:
        for k in "abcdefgh":
            await h.client.send("tally.add", {"k": k, "n": 1})
            await h.run_until_idle()
    kept = {key.rsplit(":", 1)[1]: entry for key, entry in tally._cached.items()}
    assert list(kept) == ["e", "f", "g", "h"]  # 4 x 9 bytes fit in 40, the older ones were dropped
    assert tally._cached_bytes == sum(e.size for e in kept.values()) == 36
    assert [e.state for e in kept.values()] == [{"n": 1}] * 4  # kept decoded: the next step neither reads nor decodes


# -- owned partitions: the state saved with the ack --------------------------------------------------

journals = Service("journals")
journal = journals.saga("journal", state=dict, partitions=2)  # owned: one worker per partition


@journal.command("journal.add", correlate=lambda c: c["k"])
async def journal_add(cmd: dict, ctx: SagaContext[dict]) -> None:
    ctx.state.setdefault("seq", []).append(cmd["s"])
    if cmd.get("fail") and ctx.context.attempt == 1:
        raise RuntimeError("fails once")  # retried: its state change must not be kept or saved


def _journal_key(h: ServiceHarness, k: str) -> str:
    p = journal.queue.spec().partition_for(k, "")
    return f"{h.broker.keyspace.partition(journal.queue.name, p).stream}:saga:{k}"


@pytest.mark.anyio
async def test_steps_on_owned_partitions_save_their_state_with_the_acks(redis_url: str, namespace: str) -> None:
    """On an owned partition a step that only changes its state saves it with the message's ack (no
    effects commit of its own), and the instance's next step starts from the state kept: every
    message applied once and in order per instance, a failed attempt's change neither kept nor saved."""
    journal._cached.clear()
    journal._cached_bytes = 0
    async with ServiceHarness([journals], url=redis_url, namespace=namespace) as h:
        batch = [{"k": f"k{i % 3}", "s": i, "fail": i == 7} for i in range(90)]
        async with h.client.batch() as b:
            for cmd in batch:
                b.send("journal.add", cmd, key=cmd["k"])
        await h.run_until_idle()
        for k in ("k0", "k1", "k2"):
            state = orjson.loads(await h.broker.redis.hget(_journal_key(h, k), "s"))
            assert state == {"seq": [c["s"] for c in batch if c["k"] == k]}, k
            assert await h.broker.redis.hget(_journal_key(h, k), "v") == b"30"
        commits = h.broker._commits
        assert commits is None or commits.calls == 0  # every state went with an ack
        stats = h.stats()["journals.saga_journal"]
        assert stats["processed"] == 90 and stats["failed"] == 1, stats


@pytest.mark.anyio
async def test_a_batch_reads_its_instances_states_ahead_and_a_stale_one_runs_again(
    redis_url: str, namespace: str
) -> None:
    """The states of a fetched batch's instances are read in one call before its steps run (no
    step reads its own), and every step applies on the stored state; a state read ahead that
    another writer moved on from since fails its version guard and the step runs again on a fresh read."""
    journal._cached.clear()
    journal._cached_bytes = 0
    journal._ahead.clear()
    journal._ahead_bytes = 0
    async with ServiceHarness([journals], url=redis_url, namespace=namespace) as h:
        keys = {f"r{i}": _journal_key(h, f"r{i}") for i in range(40)}
        for key in keys.values():  # instances other processes started
            await h.broker.redis.hset(key, mapping={"v": 4, "s": orjson.dumps({"seq": [0, 1, 2, 3]})})
        async with h.client.batch() as b:
            for k in keys:
                b.send("journal.add", {"k": k, "s": 4}, key=k)
        await h.run_until_idle()
        for k, key in keys.items():
            assert orjson.loads(await h.broker.redis.hget(key, "s")) == {"seq": [0, 1, 2, 3, 4]}, k
            assert await h.broker.redis.hget(key, "v") == b"5"
        reads = h.broker._reads
        assert reads is None or reads.calls == 0  # read ahead with their batches, not one by one
        assert not journal._ahead and journal._ahead_bytes == 0  # each taken by its step

        # A state read ahead, then moved on by another writer before the step runs (what the
        # guard is for): the step conflicts, runs again on the stored state, nothing is lost.
        journal._cached.clear()
        journal._cached_bytes = 0
        key = keys["r0"]
        read_states = h.broker.read_states

        async def then_moved_on(*args: Any, **kw: Any) -> Any:
            rows = await read_states(*args, **kw)
            await h.broker.redis.hset(key, mapping={"v": 6, "s": orjson.dumps({"seq": [0, 1, 2, 3, 4, 5]})})
            return rows

        h.broker.read_states = then_moved_on  # type: ignore[method-assign]
        await h.client.send("journal.add", {"k": "r0", "s": 6}, key="r0")
        await h.run_until_idle()
        assert orjson.loads(await h.broker.redis.hget(key, "s")) == {"seq": [0, 1, 2, 3, 4, 5, 6]}
        assert await h.broker.redis.hget(key, "v") == b"7"
        assert h.stats()["journals.saga_journal"]["retried"] >= 1  # (the conflict)


@pytest.mark.anyio
async def test_a_state_write_with_the_ack_that_conflicts_leaves_its_message_to_run_again(
    redis_url: str, namespace: str
) -> None:
    """Should another process have saved the instance since (it cannot while this one owns the
    partition; a test can), the write sent with the ack fails its version guard: nothing is
    written, the message stays pending and runs again, on the stored state."""
    journal._cached.clear()
    journal._cached_bytes = 0
    async with ServiceHarness([journals], url=redis_url, namespace=namespace) as h:
        await h.client.send("journal.add", {"k": "a", "s": 1}, key="a")
        await h.run_until_idle()
        key = _journal_key(h, "a")
        assert await h.broker.redis.hget(key, "v") == b"1"
        await h.broker.redis.hset(key, mapping={"v": 7, "s": orjson.dumps({"seq": [0, 1]})})
        await h.client.send("journal.add", {"k": "a", "s": 2}, key="a")  # runs on the kept version 1
        with anyio.fail_after(30):
            while await h.broker.redis.hget(key, "v") != b"8":
                await anyio.sleep(0.05)
        await h.run_until_idle()
        assert orjson.loads(await h.broker.redis.hget(key, "s")) == {"seq": [0, 1, 2]}
        assert h.stats()["journals.saga_journal"]["retried"] >= 1
        await h.client.send("journal.add", {"k": "a", "s": 3}, key="a")
        await h.run_until_idle()
        assert orjson.loads(await h.broker.redis.hget(key, "s")) == {"seq": [0, 1, 2, 3]}
        assert await h.broker.redis.hget(key, "v") == b"9"


@pytest.mark.slow
@pytest.mark.fault
def test_states_saved_with_the_acks_survive_kills_and_a_worker_paused_past_its_lease(
    workers: Workers, redis_url: str, namespace: str
) -> None:
    """3 workers of tests/apps/journalapp.py (a saga on 4 owned partitions whose steps append their
    message's number to the instance's list, each saved with the message's ack), 40 instances,
    4,000 messages and 400 duplicates sent while a worker is SIGKILLed, another SIGSTOPped past its
    lease and resumed (its queued acks and their writes are fenced), and one killed again: every
    instance's list ends exactly 0, 1, 2, ...: nothing lost, applied twice or out of order."""
    from tests.apps.journalapp import APPEND, journal

    opts = ("--lease-ttl", "2", "--concurrency", "16", "--shutdown-timeout", "5")
    procs = {f"w{i}": workers.start("journalapp:ledger", f"w{i}", *opts) for i in range(3)}
    for name in procs:
        wait_for(lambda name=name: "runtime started" in workers.log(name), 30, f"{name} to start")
    rng = random.Random(5)
    keys = [f"j{i}" for i in range(40)]
    seq = dict.fromkeys(keys, 0)
    sent_ids: list[tuple[str, dict[str, Any]]] = []
    paused: tuple[str, float] | None = None
    with SyncClient(redis_url, namespace=namespace) as client:
        for rnd in range(40):
            batch = []
            for _ in range(100):
                k = rng.choice(keys)
                batch.append({"k": k, "s": seq[k]})
                seq[k] += 1
            ids = client.send_many(APPEND, batch, key=lambda c: c["k"])
            sent_ids += zip(ids, batch, strict=True)
            for mid, cmd in rng.sample(sent_ids, 10):  # duplicates of messages sent so far
                client.send(APPEND, cmd, key=cmd["k"], message_id=mid)
            if rnd in (4, 32):
                victim = rng.choice([n for n in procs if paused is None or n != paused[0]])
                procs[victim].send_signal(signal.SIGKILL)
                procs[victim].wait()
                procs[victim] = workers.start("journalapp:ledger", victim, *opts)
            if rnd == 8:
                name = rng.choice(list(procs))
                procs[name].send_signal(signal.SIGSTOP)
                paused = (name, time.monotonic())
            if paused is not None and time.monotonic() - paused[1] > 2 + 3:
                procs[paused[0]].send_signal(signal.SIGCONT)
                resumed = paused[0]
                wait_for(lambda n=resumed: "lost ownership of a partition" in workers.log(n), 15, "the resumed loss")
                paused = None
            time.sleep(0.25)
    if paused is not None:
        procs[paused[0]].send_signal(signal.SIGCONT)
    r = redis.Redis.from_url(redis_url)
    space = KeySpace(namespace)

    def lists() -> dict[str, list[int]]:
        out = {}
        for k in keys:
            p = journal.queue.spec().partition_for(k, "")
            raw = r.hget(f"{space.partition(journal.queue.name, p).stream}:saga:{k}", "s")
            out[k] = orjson.loads(raw)["seq"] if raw else []
        return out

    wait_for(lambda: all(len(v) >= seq[k] for k, v in lists().items()), 60, "every message to be applied")
    time.sleep(1)  # anything still in flight (a duplicate) has settled
    got = lists()
    wrong = {k: v for k, v in got.items() if v != list(range(seq[k]))}
    assert wrong == {}, {k: [(i, x) for i, x in enumerate(v) if x != i][:6] for k, v in wrong.items()}
    r.close()


# -- starts=False, cancelled timeouts, sync steps, refused delays ------------------------------------

gates = Service("gates")
gate = gates.saga("gate", state=dict, partitions=1)


@gate.command("gate.open", correlate=lambda c: c["id"])
def opened(cmd: dict, ctx: SagaContext[dict]) -> None:  # a sync step: runs in a worker thread
    timeout_id = ctx.request_timeout(0.3, {"id": cmd["id"]})
    ctx.state["timeout"] = timeout_id
    if cmd.get("cancel"):
        assert ctx.cancel_timeout(timeout_id) and not ctx.pending_timeouts


@gate.command("gate.poke", correlate=lambda c: c["id"], starts=False)
async def poked(cmd: dict, ctx: SagaContext[dict]) -> None:
    ctx.state["pokes"] = ctx.state.get("pokes", 0) + 1
    if cmd.get("later"):
        ctx.send("gate.elsewhere", {}, delay=1)  # refused: SagaError, dead-lettered at once


@gate.timeout
async def gate_expired(timeout: dict, ctx: SagaContext[dict]) -> None:
    ctx.state["expired"] = ctx.state.get("expired", 0) + 1


@pytest.mark.anyio
async def test_non_starting_inputs_cancelled_timeouts_and_refused_delays(redis_url: str, namespace: str) -> None:
    async with ServiceHarness([gates], url=redis_url, namespace=namespace) as h:
        c = h.client
        await c.send("gate.poke", {"id": "a"})  # before any open: ignored, starts nothing
        await h.run_until_idle()
        await c.send("gate.open", {"id": "a"})
        await c.send("gate.open", {"id": "b", "cancel": True})
        await h.run_until_idle()
        await c.send("gate.poke", {"id": "a"})
        await c.send("gate.poke", {"id": "b", "later": True})
        await anyio.sleep(1.5)  # both timeouts due; b's was cancelled
        await h.run_until_idle()
        stream = h.broker.keyspace.partition(gate.queue.name, 0).stream
        a = orjson.loads(await h.broker.redis.hget(f"{stream}:saga:a", "s"))
        b = orjson.loads(await h.broker.redis.hget(f"{stream}:saga:b", "s"))
        assert a["pokes"] == 1 and a["expired"] == 1  # the first poke started nothing
        assert "expired" not in b and "pokes" not in b  # cancelled timeout ignored; the refused step saved nothing
        assert h.stats()["gates.saga_gate"]["dead_lettered"] == 1


# -- the example, in this process -------------------------------------------------------------------


def _outcomes(r: redis.Redis, namespace: str) -> dict[str, Any]:
    def ids(what: str) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for member in r.smembers(record_key(namespace, f"{what}-ids")):
            order, _, message = member.decode().partition("|")
            out.setdefault(order, set()).add(message)
        return out

    return {
        "shipped": {k.decode(): int(v) for k, v in r.hgetall(record_key(namespace, "shipped")).items()},
        "cancelled": {k.decode(): int(v) for k, v in r.hgetall(record_key(namespace, "cancelled")).items()},
        "shipped_ids": ids("shipped"),
        "cancelled_ids": ids("cancelled"),
        "cancel_detail": {
            k.decode(): v.decode() for k, v in r.hgetall(record_key(namespace, "cancelled-detail")).items()
        },
    }


def _check_once(out: dict[str, Any], orders: list[str]) -> None:
    """Every order ended exactly once: one message, handled once, shipped or cancelled, never both."""
    for order in orders:
        shipped, cancelled = out["shipped"].get(order, 0), out["cancelled"].get(order, 0)
        ids = out["shipped_ids"].get(order, set()) | out["cancelled_ids"].get(order, set())
        assert (shipped, cancelled) in ((1, 0), (0, 1)), f"{order}: shipped {shipped}, cancelled {cancelled}"
        assert len(ids) == 1, f"{order}: ended by {len(ids)} messages"


class Orders:
    """Publishes the example's two inputs for named orders; each order's payment (or reservation)
    always carries the same message id, so publishing it again is a duplicate delivery."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.ids: dict[tuple[str, str], str] = {}

    async def payment(self, order: str) -> None:
        message_id = self.ids.setdefault((order, "pay"), new_id())
        await self.client.publish(PAYMENTS, PaymentCaptured(order, 1000), key=order, message_id=message_id)

    async def reserve(self, order: str) -> None:
        message_id = self.ids.setdefault((order, "stock"), new_id())
        await self.client.publish(STOCK, StockReserved(order, f"sku-{order}"), key=order, message_id=message_id)


@pytest.mark.anyio
async def test_orders_ship_once_in_either_order_with_duplicates_and_cancel_on_timeout(
    redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sagaapp, "TIMEOUT", 2.5)
    r = redis.Redis.from_url(redis_url)
    async with ServiceHarness([sagaapp.shipping, sagaapp.recorder], url=redis_url, namespace=namespace) as h:
        orders = Orders(h.client)
        payment, reserve = orders.payment, orders.reserve

        await payment("pay-first")
        await reserve("stock-first")
        await payment("dup")
        await payment("only-pay")
        await reserve("only-stock")
        await payment("late")
        await h.run_until_idle()
        # (a copy published while the first still runs waits out its inbox lease: sent after it)
        await payment("dup")  # the same message again: a second stream entry of one id
        await reserve("pay-first")
        await payment("stock-first")
        await reserve("dup")
        with anyio.fail_after(10):  # two hops each (the forward, then the step): poll for the outcome
            while len(_outcomes(r, namespace)["shipped"]) < 3:
                await anyio.sleep(0.05)
        await reserve("dup")
        await h.run_until_idle()
        out = _outcomes(r, namespace)
        assert out["shipped"] == {"pay-first": 1, "stock-first": 1, "dup": 1}
        assert out["cancelled"] == {}

        with anyio.fail_after(15):
            while len(_outcomes(r, namespace)["cancelled"]) < 3:
                await anyio.sleep(0.1)
        await reserve("late")  # after its timeout cancelled it: ignored, it starts no new saga
        await payment("dup")  # a late duplicate for a completed saga: ignored
        await h.run_until_idle()
        await anyio.sleep(3.0)  # a timeout the late message would have requested would have fired by now
        await h.run_until_idle()
        out = _outcomes(r, namespace)
        _check_once(out, ["pay-first", "stock-first", "dup", "only-pay", "only-stock", "late"])
        assert set(out["cancelled"]) == {"only-pay", "only-stock", "late"}
        assert out["cancel_detail"] == {
            "only-pay": "refund=1000 release=None",  # compensation: what the saga saw
            "only-stock": "refund=0 release=sku-only-stock",
            "late": "refund=1000 release=None",
        }
        # completed sagas leave a tombstone with an expiry, no state
        for p in range(sagaapp.fulfilment.queue.partitions):
            stream = h.broker.keyspace.partition(sagaapp.fulfilment.queue.name, p).stream
            for key in r.scan_iter(f"{stream}:saga:*"):
                assert r.hget(key, "done") == b"1" and r.hget(key, "s") is None
                assert 0 < r.pttl(key) <= sagaapp.fulfilment.keep_completed_ms


@pytest.mark.anyio
async def test_a_message_for_no_step_is_dead_lettered_not_retried(redis_url: str, namespace: str) -> None:
    async with ServiceHarness([sagaapp.shipping], url=redis_url, namespace=namespace) as h:
        await h.client.send(sagaapp.fulfilment.queue, {"x": 1}, key="o-1", headers={SAGA_INPUT: "nowhere"})
        await h.run_until_idle()
        stats = h.stats()["shipping.saga_fulfilment"]
        assert stats["dead_lettered"] == 1 and stats["retried"] == 0
    assert issubclass(SagaError, Exception)


# -- the example under faults: three worker processes, kills, races ---------------------------------


@attrs.frozen
class _Order:
    id: str
    first: str  # "pay" or "stock"
    second: bool  # the other message is sent at all
    race: bool  # the other message is sent at about the timeout


@pytest.mark.slow
@pytest.mark.parametrize("store", ["redis", pytest.param("sql", marks=pytest.mark.postgres)])
def test_each_order_ends_shipped_or_cancelled_exactly_once_across_kills_and_races(
    workers: Workers, redis_url: str, namespace: str, store: str, request: pytest.FixtureRequest
) -> None:
    """90 orders on 3 workers: a third get both messages (random order, some twice), a third one
    message (must cancel), a third their second message at about the timeout (either outcome);
    a worker is SIGKILLed while the messages flow and another while the races run. ``sql``: the
    saga's state in PostgreSQL, its messages and timeouts through each worker's outbox relay."""
    timeout = 4.0
    opts: tuple[str, ...] = ("--visibility-timeout", "2", "--lease-ttl", "2")
    env = {"SAGA_TIMEOUT": str(timeout)}
    if store == "sql":
        from framework import outbox

        pg_url = request.getfixturevalue("pg_url")

        async def tables() -> None:
            engine = outbox.create_engine(pg_url)
            await outbox.create_tables(engine)
            await engine.dispose()

        anyio.run(tables)
        env["SAGA_DATABASE_URL"] = pg_url
        opts += ("--outbox-relay", pg_url)

    def start(name: str) -> Any:
        return workers.start("sagaapp:shipping", name, *opts, **env)

    procs = {f"w{i}": start(f"w{i}") for i in range(3)}
    workers.start("sagaapp:recorder", "recorder", "--visibility-timeout", "2", "--lease-ttl", "2")
    for name in [*procs, "recorder"]:
        wait_for(lambda name=name: "runtime started" in workers.log(name), 30, f"{name} to start")
    rng = random.Random(13)
    orders = [_Order(f"o{i}", rng.choice(["pay", "stock"]), second=i % 3 != 1, race=i % 3 == 2) for i in range(90)]
    r = redis.Redis.from_url(redis_url)

    def message(client: SyncClient, order: _Order, which: str) -> None:
        if which == "pay":
            client.publish(PAYMENTS, PaymentCaptured(order.id, 500), key=order.id, message_id=ids[(order.id, which)])
        else:
            client.publish(STOCK, StockReserved(order.id, "sku"), key=order.id, message_id=ids[(order.id, which)])

    ids = {(o.id, w): new_id() for o in orders for w in ("pay", "stock")}
    later: list[tuple[float, _Order, str]] = []
    with SyncClient(redis_url, namespace=namespace) as client:
        t0 = time.monotonic()
        for n, order in enumerate(orders):
            other = "stock" if order.first == "pay" else "pay"
            message(client, order, order.first)
            if rng.random() < 0.3:
                message(client, order, order.first)  # a duplicate delivery
            if order.race:
                later.append((time.monotonic() + timeout + rng.uniform(-0.5, 1.0), order, other))
            elif order.second:
                later.append((time.monotonic() + rng.uniform(0.2, 1.5), order, other))
            if n == 45:
                procs["w0"].send_signal(signal.SIGKILL)  # mid-run, while the first messages flow
            time.sleep(0.02)
        procs["w0"].wait()
        procs["w0"] = start("w0")
        killed_in_race = False
        for due, order, which in sorted(later, key=lambda x: x[0]):
            time.sleep(max(0.0, due - time.monotonic()))
            message(client, order, which)
            if rng.random() < 0.2:
                message(client, order, which)
            if not killed_in_race and time.monotonic() - t0 > timeout + 1.0:
                procs["w1"].send_signal(signal.SIGKILL)  # while timeouts and last messages race
                killed_in_race = True
        procs["w1"].wait()
        procs["w1"] = start("w1")

    def ended() -> int:
        out = _outcomes(r, namespace)
        return len(set(out["shipped"]) | set(out["cancelled"]))

    wait_for(lambda: ended() == len(orders), 60, "every order to end")
    time.sleep(timeout)  # anything still due (a timeout of a shipped order) has fired by now
    out = _outcomes(r, namespace)
    _check_once(out, [o.id for o in orders])
    for o in orders:
        if not o.second:
            assert o.id in out["cancelled"], f"{o.id} got one message but was not cancelled"
            refund = "500" if o.first == "pay" else "0"
            assert out["cancel_detail"][o.id].startswith(f"refund={refund} "), out["cancel_detail"][o.id]
        elif not o.race:
            assert o.id in out["shipped"], f"{o.id} got both messages in time but was not shipped"
    races = [o.id for o in orders if o.race]
    assert killed_in_race
    print(
        "races shipped:",
        sum(o in out["shipped"] for o in races),
        "cancelled:",
        sum(o in out["cancelled"] for o in races),
    )
