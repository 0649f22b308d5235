"""The inbox: duplicates dropped, leases, exactly-once Redis effects, the dedup window."""

from __future__ import annotations

import anyio
import attrs
import pytest

from broker import derive_id, now_ms
from broker.redis.effects import RedisEffects
from framework import Context, Queue, RetryPolicy, Service, Topic
from framework.testing import TEST_SETTINGS, ServiceHarness

pytestmark = pytest.mark.anyio


async def test_the_same_message_delivered_twice_runs_the_handler_once(redis_url: str, namespace: str) -> None:
    runs: list[str] = []
    svc = Service("billing")

    @svc.command(Queue("billing.charge", partitions=2))
    async def charge(cmd: dict, ctx: Context) -> None:
        runs.append(ctx.message_id)

    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as h:
        first = await h.client.send(Queue("billing.charge", partitions=2), {"order": 1}, message_id="m-1")
        await h.run_until_idle()
        await h.client.send(Queue("billing.charge", partitions=2), {"order": 1}, message_id="m-1")  # a re-publish
        await h.client.send(Queue("billing.charge", partitions=2), {"order": 2}, message_id="m-2")
        await h.run_until_idle()
        stats = h.stats()["billing.charge"]
    assert first == "m-1"
    assert runs == ["m-1", "m-2"]
    assert stats["duplicates"] == 1 and stats["processed"] == 2


async def test_copies_in_one_batch_run_once(redis_url: str, namespace: str) -> None:
    runs = 0
    svc = Service("s")

    @svc.command("q")
    async def h(cmd: dict) -> None:
        nonlocal runs
        runs += 1
        await anyio.sleep(0.05)

    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as harness:
        async with harness.client.batch() as b:
            for _ in range(5):
                b.send("q", {}, message_id="same")
        await harness.run_until_idle()
    assert runs == 1


async def test_inbox_off_runs_every_copy(redis_url: str, namespace: str) -> None:
    runs = 0
    svc = Service("s", inbox=False)

    @svc.command("q")
    async def h(cmd: dict) -> None:
        nonlocal runs
        runs += 1

    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as harness:
        for _ in range(3):
            await harness.client.send("q", {}, message_id="same")
        await harness.run_until_idle()
    assert runs == 3


async def test_a_failed_message_can_be_retried_and_then_counts_as_processed(redis_url: str, namespace: str) -> None:
    runs = 0
    svc = Service("s", retry=RetryPolicy(max_attempts=3, immediate=0, backoff=0.05))

    @svc.command("q")
    async def h(cmd: dict) -> None:
        nonlocal runs
        runs += 1
        if runs == 1:
            raise RuntimeError("transient")

    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as harness:
        await harness.client.send("q", {}, message_id="x")
        await harness.run_until_idle()
        await harness.client.send("q", {}, message_id="x")
        await harness.run_until_idle()
        inbox = harness.broker.group_partition((await harness.broker.get_destination("q")), 0, "s").keys.inbox
        assert await harness.broker.redis.zscore(inbox, "x") is None  # no lease left: final (kept by its hash)
    assert runs == 2  # the failure released the lease; the retry ran; the later copy was dropped


async def test_redis_transaction_applies_effects_once_with_outgoing_messages(redis_url: str, namespace: str) -> None:
    svc = Service("wallet")

    @svc.command("wallet.credit")
    async def credit(cmd: dict, ctx: Context) -> None:
        tx = ctx.redis_transaction()
        tx.hincrby(f"{namespace}:balances", cmd["account"], cmd["amount"])
        ctx.publish("wallet.credited", {"account": cmd["account"]})

    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as h:
        incoming = await h.client.send("wallet.credit", {"account": "a", "amount": 5})
        await h.client.send("wallet.credit", {"account": "a", "amount": 7})
        await h.run_until_idle()
        assert await h.broker.redis.hget(f"{namespace}:balances", "a") == b"12"
        credited = await h.messages("wallet.credited")
        assert len(credited) == 2 and derive_id(incoming, "wallet/0") in {e.id for e in credited}
        # a duplicate that slips past the batch check (its entry claimed by two consumers, say)
        # is caught by the commit itself: no second credit
        await h.stop()
        spec = await h.broker.get_destination("wallet.credit")
        view = h.broker.group_partition(spec, 0, "wallet")
        await h.broker.redis.xadd(
            view.stream, {"id": incoming, "type": "dict", "body": b'{"account":"a","amount":5}', "ts": now_ms()}
        )
        [copy] = await h.broker.read(view, "someone-else", 10, 10)
        applied = await h.broker.commit_effects(copy, RedisEffects.of(("HINCRBY", f"{namespace}:balances", "a", 5)))
        assert applied is False
        assert await h.broker.redis.hget(f"{namespace}:balances", "a") == b"12"
        assert (await h.broker.stream_groups(view.stream))[0]["pending"] == 0


async def test_the_dedup_window_forgets_old_ids(redis_url: str, namespace: str) -> None:
    runs = 0
    svc = Service("s")

    @svc.command("q")
    async def h(cmd: dict) -> None:
        nonlocal runs
        runs += 1

    settings = attrs.evolve(TEST_SETTINGS, inbox_window=0.2, trim_interval=0.05)
    async with ServiceHarness([svc], url=redis_url, namespace=namespace, settings=settings) as harness:
        await harness.client.send("q", {}, message_id="old")
        await harness.run_until_idle()
        await anyio.sleep(0.5)
        await harness.client.send("q", {}, message_id="old")
        await harness.run_until_idle()
    assert runs == 2


async def test_producer_idempotency_key_publishes_once(redis_url: str, namespace: str) -> None:
    runs = 0
    svc = Service("s", inbox=False)

    @svc.command("q")
    async def h(cmd: dict) -> None:
        nonlocal runs
        runs += 1

    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as harness:
        ids = [  # e.g. an HTTP client retrying a POST
            await harness.client.send("q", {"order": 9}, idempotency_key="POST /orders 9") for _ in range(3)
        ]
        assert ids[0] is not None and ids[1:] == [None, None]  # the repeats say they stored nothing
        await harness.run_until_idle()
        assert len(await harness.messages("q")) == 0
    assert runs == 1


async def test_producer_idempotency_key_publishes_once_to_a_partitioned_topic(redis_url: str, namespace: str) -> None:
    runs = 0
    svc = Service("s", inbox=False)

    @svc.event(Topic("orders.placed", partitions=4))
    async def h(evt: dict) -> None:
        nonlocal runs
        runs += 1

    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as harness:
        for _ in range(8):  # no message key: each publish has its own id, the key picks the partition
            await harness.client.publish(Topic("orders.placed", partitions=4), {"order": 9}, idempotency_key="o-9")
        await harness.run_until_idle()
        assert len(await harness.messages("orders.placed")) == 1
    assert runs == 1


async def test_redis_effects_failing_half_way_are_applied_once_and_dead_lettered(
    redis_url: str, namespace: str
) -> None:
    svc = Service("wallet", retry=RetryPolicy(max_attempts=3, immediate=2, backoff=0.05))
    balances, audit = f"{namespace}:balances", f"{namespace}:audit"

    @svc.command("wallet.deposit")
    async def deposit(cmd: dict, ctx: Context) -> None:
        tx = ctx.redis_transaction()
        tx.hincrby(balances, cmd["account"], cmd["amount"])
        tx.hset(audit, cmd["account"], "deposit")  # audit holds a string: WRONGTYPE
        ctx.publish("wallet.deposited", {"account": cmd["account"]})

    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as h:
        await h.broker.redis.set(audit, "not a hash")
        await h.client.send("wallet.deposit", {"account": "a", "amount": 100})
        await h.run_until_idle()
        assert await h.broker.redis.hget(balances, "a") == b"100"  # once: no retry applies it again
        assert await h.messages("wallet.deposited") == []
        view = h.broker.group_partition(await h.broker.get_destination("wallet.deposit"), 0, "wallet")
        [(_, fields)] = await h.broker.dead_letter_entries(view)
        assert fields[b"dlq-reason"].startswith(b"effects partially applied: Redis command 2 of 2 (HSET)")
        assert (await h.broker.stream_groups(view.stream))[0]["pending"] == 0


async def test_a_copy_arriving_while_its_message_runs_is_dropped_when_the_run_settles(
    redis_url: str, namespace: str
) -> None:
    """The read leases what it reads, so a copy read while its message runs in this very worker
    meets the run's lease; it is checked again once the run has settled (a duplicate then), not
    left pending until the visibility timeout (5 s here)."""
    runs = 0
    svc = Service("s")

    @svc.command("q")
    async def h(cmd: dict) -> None:
        nonlocal runs
        runs += 1
        await anyio.sleep(0.3)

    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as harness:
        await harness.client.send("q", {}, message_id="order-9")
        await anyio.sleep(0.1)  # the first run is under way
        await harness.client.send("q", {}, message_id="order-9")
        started = anyio.current_time()
        await harness.run_until_idle()
        waited = anyio.current_time() - started
    assert runs == 1
    assert waited < 2.0, f"the copy waited {waited:.1f} s (the visibility timeout?)"
