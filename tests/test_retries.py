"""Retries, backoff, dead letters and redrive, in-process against the real server."""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter, defaultdict
from datetime import timedelta

import anyio
import attrs
import pytest

from framework import Context, HandlerError, RetryAfter, RetryPolicy, Runtime, Service, Topic
from framework.dead_letters import DeadLetters
from framework.testing import TEST_SETTINGS, ServiceHarness

pytestmark = pytest.mark.anyio


@attrs.frozen
class Charge:
    order_id: str
    cents: int


class PaymentDeclined(Exception):
    pass


# -- the policy itself ------------------------------------------------------------------------------


def test_backoff_is_exponential_capped_and_fully_jittered() -> None:
    policy = RetryPolicy(max_attempts=10, immediate=1, backoff=0.5, multiplier=2, max_delay=3)
    for attempt, cap in ((2, 0.5), (3, 1.0), (4, 2.0), (5, 3.0), (9, 3.0)):
        samples = [policy.delay(attempt) for _ in range(400)]
        assert all(0 <= s <= cap for s in samples)
        assert max(samples) > cap * 0.8 and min(samples) < cap * 0.2  # full jitter spans [0, cap]
    exact = RetryPolicy(backoff=0.5, multiplier=3, immediate=0, jitter=False, max_delay=100)
    assert [exact.delay(n) for n in (1, 2, 3)] == [0.5, 1.5, 4.5]


def test_decisions_follow_the_policy() -> None:
    policy = RetryPolicy(max_attempts=4, immediate=1, fatal=PaymentDeclined)
    assert policy.decide(1, RuntimeError()).action == "retry"
    assert policy.decide(2, RuntimeError()).action == "delay"
    assert policy.decide(4, RuntimeError()).action == "dead"
    assert policy.decide(1, PaymentDeclined()).action == "dead"
    assert policy.decide(2, RetryAfter(30)).seconds == 30
    only = RetryPolicy(retry_on=(TimeoutError,))
    assert only.decide(1, ValueError()).action == "dead"
    assert only.decide(1, TimeoutError()).action == "retry"


# -- end to end -------------------------------------------------------------------------------------------


async def test_always_failing_handler_is_dead_lettered_after_exactly_max_attempts(
    redis_url: str, namespace: str
) -> None:
    calls: list[int] = []
    svc = Service("billing", retry=RetryPolicy(max_attempts=4, immediate=1, backoff=0.05, max_delay=0.1))

    @svc.command("billing.charge")
    async def charge(cmd: Charge, ctx: Context) -> None:
        calls.append(ctx.attempt)
        raise ConnectionError(f"gateway down for {cmd.order_id}")

    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as h:
        message_id = await h.client.send("billing.charge", Charge("o-1", 100))
        await h.run_until_idle()
        [dead] = await DeadLetters(h.broker).list()
        stats = h.stats()["billing.charge"]
    assert calls == [1, 2, 3, 4]
    assert dead.message_id == message_id and dead.attempts == 4
    assert dead.error_type == "builtins.ConnectionError" and "gateway down for o-1" in dead.error_message
    assert "failed 4 of 4 attempts" in dead.reason
    assert "raise ConnectionError" in dead.traceback
    assert dead.handler == "billing.charge" and dead.group == "billing" and dead.destination == "billing.charge"
    assert dead.first_failed_at is not None and dead.dead_at is not None
    assert dead.first_failed_at <= dead.dead_at
    assert stats["dead_lettered"] == 1 and stats["failed"] == 4


async def test_fatal_exception_goes_to_the_dlq_at_the_first_attempt(redis_url: str, namespace: str) -> None:
    calls = 0
    svc = Service("billing", retry=RetryPolicy(max_attempts=5, fatal=(PaymentDeclined,)))

    @svc.command("billing.charge")
    async def charge(cmd: Charge) -> None:
        nonlocal calls
        calls += 1
        raise PaymentDeclined("card expired")

    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as h:
        await h.client.send("billing.charge", Charge("o-1", 100))
        await h.run_until_idle()
        [dead] = await DeadLetters(h.broker).list()
    assert calls == 1 and dead.attempts == 1
    assert dead.reason.startswith("fatal error (not retried): PaymentDeclined: card expired")


async def test_undecodable_and_invalid_messages_are_dead_lettered_with_the_reason(
    redis_url: str, namespace: str
) -> None:
    ran = 0
    svc = Service("billing")

    @svc.command("billing.charge")
    async def charge(cmd: Charge) -> None:
        nonlocal ran
        ran += 1

    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as h:
        await h.client.send("billing.charge", b"\xff\xfe not json")
        await h.client.send("billing.charge", {"order_id": "o-2", "cents": "lots"})
        await h.client.send("billing.charge", {"order_id": "o-3"})
        stream = h.broker.keyspace.partition("billing.charge", 0).stream
        await h.broker.redis.xadd(stream, {"no": "envelope"})
        # a key that is not UTF-8 (it escaped the decoder as a UnicodeDecodeError before, and the read failed)
        bad_key = {
            "id": "m-bad-key",
            "type": "Charge",
            "body": b'{"order_id":"o-4","cents":1}',
            "ts": 1,
            "key": b"\xff",
        }
        await h.broker.redis.xadd(stream, bad_key)  # type: ignore[arg-type]
        await h.client.send("billing.charge", Charge("o-ok", 1))
        await h.run_until_idle()
        dead = await DeadLetters(h.broker).list()
    assert ran == 1
    reasons = sorted(d.reason for d in dead)
    assert len(reasons) == 5
    assert any("undecodable message: malformed envelope field" in r for r in reasons), reasons
    assert any("body is not JSON" in r for r in reasons)
    assert any("expected int @ payload.cents" in r for r in reasons)
    assert any("required field missing @ payload.cents" in r for r in reasons)
    assert any("undecodable message: entry has no 'id' field" in r for r in reasons)
    assert all(d.attempts == 1 for d in dead)


async def test_delayed_retries_wait_their_backoff(redis_url: str, namespace: str) -> None:
    times: list[float] = []
    svc = Service("s", retry=RetryPolicy(max_attempts=3, immediate=0, backoff=0.3, multiplier=2, jitter=False))

    @svc.command("q")
    async def h(cmd: dict) -> None:
        times.append(time.monotonic())
        if len(times) < 3:
            raise RuntimeError("not yet")

    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as harness:
        await harness.client.send("q", {})
        await harness.run_until_idle()
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(times) == 3
    assert 0.3 <= gaps[0] < 0.3 + 0.5
    assert 0.6 <= gaps[1] < 0.6 + 0.5


async def test_handler_can_ask_for_a_retry_after_a_delay(redis_url: str, namespace: str) -> None:
    times: list[float] = []
    svc = Service("s")

    @svc.command("q")
    async def h(cmd: dict, ctx: Context) -> None:
        times.append(time.monotonic())
        if ctx.attempt == 1:
            raise RetryAfter(0.4, "rate limited")

    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as harness:
        await harness.client.send("q", {})
        await harness.run_until_idle()
    assert len(times) == 2 and times[1] - times[0] >= 0.4


async def test_a_poison_message_does_not_block_its_partition(redis_url: str, namespace: str) -> None:
    done: list[int] = []
    svc = Service("s", retry=RetryPolicy(max_attempts=2, immediate=0, backoff=2.0, jitter=False))

    @svc.event("t")
    async def h(e: dict) -> None:
        if e["n"] == 0:
            raise RuntimeError("poison")
        done.append(e["n"])

    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as harness:
        await harness.client.publish_many("t", [{"n": i} for i in range(20)], key=lambda e: "one-key")
        started = time.monotonic()
        with anyio.fail_after(5):
            while len(done) < 19:
                await anyio.sleep(0.01)
        assert time.monotonic() - started < 1.4  # the others did not wait for the poison's 2 s retry
        await harness.run_until_idle()
        assert len(await DeadLetters(harness.broker).list()) == 1


async def test_in_place_retries_keep_per_key_order(redis_url: str, namespace: str) -> None:
    order: list[int] = []
    failed_once: set[int] = set()
    svc = Service("s", retry=RetryPolicy(max_attempts=3, immediate=0, backoff=0.05, jitter=False, in_place=True))

    @svc.event("t")
    async def h(e: dict) -> None:
        if e["n"] % 5 == 0 and e["n"] not in failed_once:
            failed_once.add(e["n"])
            raise RuntimeError("transient")
        order.append(e["n"])

    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as harness:
        await harness.client.publish_many("t", [{"n": i} for i in range(30)], key=lambda e: "k")
        await harness.run_until_idle()
    assert order == list(range(30))


async def test_redrive_of_a_topic_dead_letter_reaches_only_the_failing_group(redis_url: str, namespace: str) -> None:
    seen: dict[str, Counter[str]] = defaultdict(Counter)
    fixed = False
    billing = Service("billing", retry=RetryPolicy(max_attempts=1))
    shipping = Service("shipping")

    @billing.event(Topic("orders.placed", partitions=2))
    async def charge(e: Charge) -> None:
        seen["billing"][e.order_id] += 1
        if not fixed:
            raise RuntimeError("bug in billing")

    @shipping.event(Topic("orders.placed", partitions=2))
    async def ship(e: Charge) -> None:
        seen["shipping"][e.order_id] += 1

    async with ServiceHarness([billing, shipping], url=redis_url, namespace=namespace) as h:
        await h.client.publish_many(
            Topic("orders.placed", partitions=2), [Charge(f"o{i}", i) for i in range(6)], key=lambda c: c.order_id
        )
        await h.run_until_idle()
        dlq = DeadLetters(h.broker)
        assert len(await dlq.list(group="billing")) == 6
        assert await dlq.list(group="shipping") == []
        fixed = True
        assert await dlq.redrive(group="billing") == 6
        await h.run_until_idle()
        assert await dlq.list() == []
    assert all(seen["billing"][f"o{i}"] == 2 for i in range(6))  # failed once, then redriven once
    assert all(seen["shipping"][f"o{i}"] == 1 for i in range(6))  # never saw a copy


async def test_dead_letters_can_be_shown_and_purged(redis_url: str, namespace: str) -> None:
    svc = Service("s", retry=RetryPolicy(max_attempts=1))

    @svc.command("q")
    async def h(cmd: dict) -> None:
        raise ValueError(f"bad {cmd['n']}")

    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as harness:
        ids = await harness.client.send_many("q", [{"n": i} for i in range(3)])
        await harness.run_until_idle()
        dlq = DeadLetters(harness.broker)
        shown = await dlq.get(ids[1])
        assert shown.body == b'{"n":1}' and shown.error_message == "bad 1"
        assert (await dlq.get(shown.ref)).message_id == ids[1]
        assert await dlq.purge([ids[0]]) == 1
        with pytest.raises(ValueError):
            await dlq.purge()
        assert await dlq.purge(everything=True) == 2
        with pytest.raises(KeyError):
            await dlq.get(ids[1])


async def test_two_runtimes_running_the_retry_scheduler_deliver_each_retry_once(redis_url: str, namespace: str) -> None:
    calls: Counter[int] = Counter()
    svc = Service("s", retry=RetryPolicy(max_attempts=5, immediate=0, backoff=0.05, jitter=False))

    @svc.command("q")
    async def h(cmd: dict, ctx: Context) -> None:
        calls[cmd["n"]] += 1
        if ctx.attempt == 1:
            raise RuntimeError("first attempt fails")

    async with ServiceHarness([], url=redis_url, namespace=namespace) as harness:
        runtimes = [
            Runtime([svc], broker=harness.broker, settings=attrs.evolve(TEST_SETTINGS, consumer=c, retry_interval=0.01))
            for c in ("a", "b")
        ]
        async with anyio.create_task_group() as tg:
            for r in runtimes:
                await tg.start(r.run)
            await harness.client.send_many("q", [{"n": i} for i in range(100)])
            for r in runtimes:
                await r.wait_idle()
            for r in runtimes:
                r.stop()
    assert set(calls.values()) == {2} and len(calls) == 100


async def test_a_removed_handler_with_a_live_subscription_is_a_start_up_error(redis_url: str, namespace: str) -> None:
    old = Service("billing")

    @old.event("orders.cancelled")
    async def refund(e: dict) -> None: ...

    @old.event("orders.placed")
    async def charge(e: dict) -> None: ...

    new = Service("billing")

    @new.event("orders.placed")
    async def charge2(e: dict) -> None: ...

    async with ServiceHarness([old], url=redis_url, namespace=namespace) as h:
        await h.stop()
        with pytest.raises(Exception, match=r"framework unsubscribe orders\.cancelled --group billing"):
            await Runtime([new], broker=h.broker, settings=TEST_SETTINGS).run()
        spec = await h.broker.get_destination("orders.cancelled")
        assert spec is not None
        await h.broker.unsubscribe(spec, "billing")
        h.services = [new]
        await h.start()


async def test_a_hung_handler_is_cancelled_at_its_timeout_and_does_not_block_its_lane(
    redis_url: str, namespace: str
) -> None:
    done: list[int] = []
    runs: list[int] = []
    svc = Service("s", retry=RetryPolicy(max_attempts=2, immediate=0, backoff=0.05, jitter=False), timeout=0.5)

    @svc.event("t")
    async def h(e: dict, ctx: Context) -> None:
        if e["n"] == 0:
            runs.append(ctx.attempt)
            await anyio.sleep(3600)  # hangs: only the timeout gets the lane back
        done.append(e["n"])

    settings = attrs.evolve(TEST_SETTINGS, concurrency=1)  # one lane: everything queues behind the hung run
    async with ServiceHarness([svc], url=redis_url, namespace=namespace, settings=settings) as harness:
        await harness.client.publish_many("t", [{"n": i} for i in range(30)])
        with anyio.fail_after(10):
            while len(done) < 29:
                await anyio.sleep(0.02)
        await harness.run_until_idle(timeout=15)
        [dead] = await DeadLetters(harness.broker).list()
    assert runs == [1, 2]  # cancelled twice, then dead-lettered: max_attempts holds for hangs too
    assert dead.error_type == "framework.retries.HandlerTimeout"
    assert "ran longer than its 0.5 s timeout" in dead.reason and dead.attempts == 2


async def test_sync_handlers_time_out_too(redis_url: str, namespace: str) -> None:
    svc = Service("s", retry=RetryPolicy(max_attempts=1), timeout=0.3)

    @svc.command("q")
    def h(cmd: dict) -> None:
        time.sleep(3)

    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as harness:
        await harness.client.send("q", {})
        started = time.monotonic()
        with anyio.fail_after(10):
            while not await DeadLetters(harness.broker).list():
                await anyio.sleep(0.05)
        assert time.monotonic() - started < 2.5  # settled long before the thread finished
        [dead] = await DeadLetters(harness.broker).list()
    assert "thread cannot be stopped" in dead.reason


def test_timeouts_are_declared_per_service_and_handler() -> None:
    svc = Service("s", timeout=timedelta(seconds=20))

    @svc.command("a")
    async def a(cmd: dict) -> None: ...

    @svc.command("b", timeout=math.inf)
    async def b(cmd: dict) -> None: ...

    assert [h.timeout for h in svc.handlers] == [20.0, None]
    assert Service("d").timeout == 300.0
    with pytest.raises(HandlerError, match="timeout must be positive"):
        Service("e", timeout=0)


async def test_in_place_retries_report_when_the_first_attempt_failed(redis_url: str, namespace: str) -> None:
    svc = Service("s", retry=RetryPolicy(max_attempts=3, immediate=0, backoff=0.4, jitter=False, in_place=True))

    @svc.command("q")
    async def h(cmd: dict) -> None:
        raise RuntimeError("still broken")

    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as harness:
        await harness.client.send("q", {})
        await harness.run_until_idle()
        [dead] = await DeadLetters(harness.broker).list()
    assert dead.attempts == 3
    assert dead.first_failed_at is not None and dead.dead_at is not None
    assert (dead.dead_at - dead.first_failed_at).total_seconds() >= 0.8  # two in-place waits of 0.4 s
