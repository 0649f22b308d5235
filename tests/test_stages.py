"""Each stage of the message lifecycle alone, against the real broker: the ledger's accounts,
admission's sorting, the attempt stage's routing decisions and what settlement does with them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import attrs
import pytest

from broker import Envelope
from broker.redis import RedisBroker
from broker.redis.inspect import group_state
from framework import Queue, RetryPolicy, Service
from framework._messages import Outgoing
from framework.middleware import Outcome
from framework.retries import HandlerTimeout
from framework.runtime.admit import Admission
from framework.runtime.attempt import Attempts
from framework.runtime.lanes import Batch, LanePool
from framework.runtime.ledger import Ledger, Slot
from framework.runtime.settle import SETTLED, Finished, Settlement
from framework.runtime.wiring import Wiring
from framework.testing import TEST_SETTINGS

pytestmark = pytest.mark.anyio

QUEUE = Queue("stage.jobs")


class Stages:
    """One consumer's stages over one partition, wired by hand (no Runtime)."""

    def __init__(self, broker: RedisBroker, service: Service, ledger: Ledger, **wiring: Any) -> None:
        self.published: list[Envelope] = []
        self.broker = broker
        self.ledger = ledger
        self.wiring = Wiring(
            broker=broker,
            settings=TEST_SETTINGS,
            consumer_name="c1",
            lanes=LanePool(4),
            publish=self._publish,
            handler=service.handlers[0],
            **wiring,
        )
        self.settle = Settlement(self.wiring)
        self.attempts = Attempts(self.wiring, self.settle)
        self.submitted: list[Batch] = []
        self.admission = Admission(self.wiring, self.settle, self)

    async def _publish(self, outgoing: Sequence[Outgoing]) -> None:
        self.published += [env for env, _ in outgoing]
        await self.broker.publish([env for env, _ in outgoing])

    async def process(self, view: Any, batch: Batch) -> None:  # the lanes' Worker: not run here
        raise AssertionError("not used")

    def abandon(self, view: Any, works: Any) -> None:
        raise AssertionError("not used")

    async def fetch(self, count: int = 100) -> list[Any]:
        deliveries = await self.broker.read(self.ledger.view, "c1", count, 100)
        self.ledger.hold(deliveries, 0.0)
        return deliveries


async def _stages(broker: RedisBroker, service: Service, bodies: Sequence[Any], **wiring: Any) -> Stages:
    handler = service.handlers[0]
    (view,) = await broker.subscribe(handler.spec, service.name, handler.start)
    from framework._messages import build_envelope

    await broker.publish([build_envelope(QUEUE, "command", b, key=None)[0] for b in bodies])
    return Stages(broker, service, Ledger(view), **wiring)


# -- the ledger --------------------------------------------------------------------------------------------


async def test_the_ledger_accounts_held_in_flight_capacity_and_acks(broker: RedisBroker) -> None:
    svc = Service("ledger")
    svc.command(QUEUE)(lambda m: None)
    s = await _stages(broker, svc, [{"n": i} for i in range(5)])
    ledger = s.ledger
    ds = await s.fetch()
    assert len(ledger.held) == 5 and ledger.in_flight == 5
    with anyio.fail_after(1):
        await ledger.wait_for_capacity(5)  # at the limit: room enough
    ledger.queue_acks(ds[:2])  # processed: released at once, held until the ack is sent
    assert ledger.in_flight == 3 and len(ledger.held) == 5 and ledger.capacity.is_set()
    batch = ledger.take_acks()
    assert batch == ds[:2] and ledger.ack_buffer == []
    ledger.requeue_acks(batch)  # a flush failed: sent by the next one
    assert ledger.ack_buffer == ds[:2]
    ledger.acked(ledger.take_acks())
    assert len(ledger.held) == 3 and ledger.in_flight == 3
    ledger.forget(ds[2:3])  # stays pending
    ledger.forget(ds[2:3])  # twice: counted once
    assert len(ledger.held) == 2 and ledger.in_flight == 2
    slot = Slot()
    slot.delivery = ds[3]
    ledger.slots.add(slot)
    assert ledger.running() == [ds[3].entry_id]

    waited = anyio.Event()

    async def fetcher() -> None:
        await ledger.wait_for_capacity(1)
        waited.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(fetcher)
        await anyio.sleep(0.01)
        assert not waited.is_set()  # 2 in flight, limit 1: the fetcher waits
        ledger.release(1)
        with anyio.fail_after(1):
            await waited.wait()


# -- admission ---------------------------------------------------------------------------------------------


@attrs.frozen
class Job:
    n: int
    key: str | None = None


async def test_admission_sorts_poison_duplicates_keyed_and_keyless(broker: RedisBroker) -> None:
    svc = Service("admit")
    svc.command(QUEUE, key=lambda j: j.key)(lambda j: None)
    bodies: list[Any] = [{"n": 1, "key": "a"}, {"n": 2, "key": "a"}, {"n": 3}, {"n": 4, "key": "b"}, {"bad": 1}]
    s = await _stages(broker, svc, bodies)
    svc.handlers[0].decode = lambda raw: Job(**__import__("orjson").loads(raw))  # type: ignore[method-assign]
    ds = await s.broker.read(s.ledger.view, "c1", 100, 100)
    # the first one was processed before (made final in the inbox): a duplicate
    await broker.inbox_claim(s.ledger.view, ds[:1], 60_000)
    await broker.ack(s.ledger.view, ds[:1], inbox=True)
    calls: list[Any] = []
    s.wiring.lanes.submit = lambda *args: calls.append(args)  # type: ignore[method-assign]
    await s.admission.admit(s.ledger, ds)
    (_worker, _ledger, by_key, keyless, isolated, _scope) = calls[0]
    assert {key: [w[1].n for w in works] for key, works in by_key.items()} == {"a": [2], "b": [4]}
    assert [w[1].n for w in keyless] == [3]
    assert list(isolated) == []
    stats = s.wiring.stats
    assert stats.fetched == 5 and stats.duplicates == 1 and stats.dead_lettered == 1  # {"bad": 1} is poison
    assert s.ledger.in_flight == 3 and len(s.ledger.ack_buffer) == 1  # the duplicate waits for its ack


# -- attempt and settle --------------------------------------------------------------------------------------


class Boom(Exception):
    pass


class Fatal(Exception):
    pass


async def _attempt(broker: RedisBroker, policy: RetryPolicy, behaviour: Any, **wiring: Any) -> tuple[Stages, Any]:
    svc = Service("attempt", retry=policy)

    @svc.command(QUEUE)
    async def handle(job: dict, ctx: Any) -> None:
        await behaviour(job, ctx)

    s = await _stages(broker, svc, [{"n": 1}], **wiring)
    (d,) = await s.fetch()
    result = await s.attempts.run(s.ledger, d, {"n": 1}, d.attempt, Slot())
    return s, result


async def test_success_returns_the_context_and_settles_in_a_batch(broker: RedisBroker) -> None:
    async def ok(job: dict, ctx: Any) -> None:
        ctx.send("stage.out", {"echo": job["n"]})

    s, ctx = await _attempt(broker, RetryPolicy(), ok)
    assert ctx.attempt == 1 and len(ctx.outgoing) == 1
    done = Finished()
    done.add(s.ledger.held[next(iter(s.ledger.held))][0], ctx, 0.0)
    await s.settle.finished(s.ledger, done)
    assert len(s.published) == 1 and s.wiring.stats.processed == 1 and s.ledger.in_flight == 0
    await s.settle.flush(s.ledger)
    assert s.ledger.held == {} and (await group_state(broker, s.ledger.view)).pending == 0


async def test_an_immediate_retry_runs_again_in_place(broker: RedisBroker) -> None:
    runs: list[int] = []

    async def flaky(job: dict, ctx: Any) -> None:
        runs.append(ctx.attempt)
        if len(runs) == 1:
            raise Boom("once")

    s, ctx = await _attempt(broker, RetryPolicy(immediate=1), flaky)
    assert runs == [1, 2] and ctx.attempt == 2
    assert s.wiring.stats.failed == 1 and s.wiring.stats.retried == 1


async def test_a_delayed_retry_goes_through_the_retry_path(broker: RedisBroker) -> None:
    async def failing(job: dict, ctx: Any) -> None:
        raise Boom("later")

    s, result = await _attempt(broker, RetryPolicy(immediate=0, backoff=30, jitter=False), failing)
    assert result is None and s.wiring.stats.retried == 1 and s.ledger.in_flight == 0
    g = await group_state(broker, s.ledger.view)
    assert g.delayed == 1 and g.pending == 0 and g.dead_letters == 0


async def test_a_fatal_error_is_dead_lettered_at_once(broker: RedisBroker) -> None:
    async def fatal(job: dict, ctx: Any) -> None:
        raise Fatal("no")

    s, result = await _attempt(broker, RetryPolicy(fatal=Fatal), fatal)
    assert result is None and s.wiring.stats.failed == 1 and s.wiring.stats.dead_lettered == 1
    g = await group_state(broker, s.ledger.view)
    assert g.dead_letters == 1 and g.delayed == 0 and g.pending == 0


async def test_max_attempts_dead_letters(broker: RedisBroker) -> None:
    runs: list[int] = []

    async def failing(job: dict, ctx: Any) -> None:
        runs.append(ctx.attempt)
        raise Boom("always")

    s, result = await _attempt(broker, RetryPolicy(max_attempts=3, immediate=3), failing)
    assert result is None and runs == [1, 2, 3] and s.wiring.stats.dead_lettered == 1
    assert (await group_state(broker, s.ledger.view)).dead_letters == 1


async def test_routing_decisions_as_outcomes(broker: RedisBroker) -> None:
    svc = Service("decide", retry=RetryPolicy(max_attempts=3, immediate=1, backoff=2, jitter=False, fatal=Fatal))
    svc.command(QUEUE)(lambda j: None)
    s = await _stages(broker, svc, [])
    failed = s.attempts.failed
    boom = Boom()
    assert failed(1, boom) == Outcome("retry", 1, boom, in_place=True)  # immediate: again at once, in place
    later = failed(2, Boom())
    assert later.status == "retry" and later.delay == 2 and not later.in_place
    assert failed(3, Boom()).status == "dead_letter" and "3 of 3" in failed(3, Boom()).reason
    assert failed(1, Fatal()).status == "dead_letter"
    timeout = failed(1, HandlerTimeout("slow"), timed_out=True)
    assert timeout.status == "retry" and not timeout.in_place  # never in place: the lane moves on
    assert failed(3, HandlerTimeout("slow"), timed_out=True).status == "dead_letter"


async def test_a_timed_out_run_is_retried_through_the_retry_path(broker: RedisBroker) -> None:
    svc = Service("slow", timeout=0.2, retry=RetryPolicy(immediate=1, backoff=30, jitter=False))

    @svc.command(QUEUE)
    async def slow(job: dict) -> None:
        await anyio.sleep(10)

    s = await _stages(broker, svc, [{"n": 1}])
    (d,) = await s.fetch()
    slot = Slot()
    s.ledger.slots.add(slot)
    with anyio.CancelScope() as scope:  # the lane's scope, which the watchdog cancels
        slot.scope = scope
        async with anyio.create_task_group() as tg:
            tg.start_soon(s.attempts.run, s.ledger, d, {"n": 1}, 1, slot)
            await anyio.sleep(0.05)
            scope.cancel()
    assert slot.delivery is d
    await s.attempts.timed_out(s.ledger, d, slot)
    assert s.wiring.stats.failed == 1 and s.wiring.stats.retried == 1
    assert (await group_state(broker, s.ledger.view)).delayed == 1


async def test_redis_effects_settle_with_their_own_ack(broker: RedisBroker) -> None:
    async def with_effects(job: dict, ctx: Any) -> None:
        ctx.redis_transaction().hincrby(broker.namespace + ":" + ctx.hash_tag + ":count", "n", 1)

    s, result = await _attempt(broker, RetryPolicy(), with_effects)
    assert result is SETTLED and s.wiring.stats.processed == 1 and s.ledger.held == {}
    assert (await group_state(broker, s.ledger.view)).pending == 0


async def test_after_commit_runs_once_the_effects_applied_not_for_a_failed_guard(broker: RedisBroker) -> None:
    calls: list[int] = []
    keys: list[str] = []

    async def guarded(job: dict, ctx: Any) -> None:
        tx = ctx.redis_transaction()
        key = broker.namespace + ":" + ctx.hash_tag + ":guarded"
        keys.append(key)
        tx.expect(key, "v", "1" if ctx.attempt == 1 else None)  # the first run expects a value not there
        tx.hincrby(key, "n", 1)
        tx.after_commit(lambda: calls.append(ctx.attempt))

    s, result = await _attempt(broker, RetryPolicy(immediate=1), guarded)
    assert result is SETTLED and s.wiring.stats.processed == 1
    assert calls == [2]  # not for the run whose guard failed (nothing applied), once for the one applied
    assert await broker.redis.hget(keys[-1], "n") == b"1"
