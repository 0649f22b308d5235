"""The runtime in-process: delivery to groups, competing consumers, order per key, staged sends, shutdown."""

from __future__ import annotations

import threading
from collections import Counter, defaultdict

import anyio
import attrs
import orjson
import pytest

from framework import Context, Queue, RetryPolicy, Runtime, RuntimeSettings, Service, Topic
from framework.testing import TEST_SETTINGS, ServiceHarness

pytestmark = pytest.mark.anyio


@attrs.frozen
class OrderPlaced:
    order_id: str
    total_cents: int


@attrs.frozen
class SendEmail:
    to: str
    subject: str


async def test_events_reach_every_subscribing_service(redis_url: str, namespace: str) -> None:
    seen: dict[str, list[str]] = defaultdict(list)
    billing, shipping = Service("billing"), Service("shipping")

    @billing.event("orders.placed")
    async def charge(e: OrderPlaced) -> None:
        seen["billing"].append(e.order_id)

    @shipping.event("orders.placed")
    async def ship(e: OrderPlaced, ctx: Context) -> None:
        seen["shipping"].append(e.order_id)

    async with ServiceHarness([billing, shipping], url=redis_url, namespace=namespace) as h:
        await h.client.publish_many("orders.placed", [OrderPlaced(f"o{i}", i) for i in range(200)])
        await h.run_until_idle()
    expected = [f"o{i}" for i in range(200)]
    assert sorted(seen["billing"]) == sorted(expected)
    assert sorted(seen["shipping"]) == sorted(expected)


async def test_commands_reach_exactly_one_of_two_competing_runtimes(redis_url: str, namespace: str) -> None:
    handled: Counter[str] = Counter()
    by_runtime: dict[str, int] = defaultdict(int)
    worker = Service("worker")

    @worker.command(Queue("jobs", partitions=2))
    async def job(cmd: dict, ctx: Context) -> None:
        handled[cmd["n"]] += 1
        by_runtime[ctx.handler] += 1
        await anyio.sleep(0.001)

    settings = attrs.evolve(TEST_SETTINGS, prefetch=20)
    async with ServiceHarness([], url=redis_url, namespace=namespace) as h:
        a = Runtime([worker], broker=h.broker, settings=attrs.evolve(settings, consumer="a"))
        b = Runtime([worker], broker=h.broker, settings=attrs.evolve(settings, consumer="b"))
        async with anyio.create_task_group() as tg:
            await tg.start(a.run)
            await tg.start(b.run)
            with anyio.fail_after(15):  # partitions are owned (partitions > 1): wait until b has its share
                while not (a.consumers[0].states and b.consumers[0].states):
                    await anyio.sleep(0.05)
            await h.client.send_many("jobs", [{"n": str(i)} for i in range(500)], key=lambda c: c["n"])
            await a.wait_idle()
            await b.wait_idle()
            a.stop()
            b.stop()
        assert a.stats()["worker.job"]["processed"] > 0 and b.stats()["worker.job"]["processed"] > 0
    assert len(handled) == 500 and set(handled.values()) == {1}


async def test_messages_with_one_key_run_in_order_others_in_parallel(redis_url: str, namespace: str) -> None:
    order: dict[str, list[int]] = defaultdict(list)
    running: dict[str, int] = defaultdict(int)
    overlap_same_key = 0
    max_parallel = 0
    now_running = 0
    svc = Service("ledger")

    @svc.event(Topic("entries", partitions=2))
    async def post(e: dict) -> None:
        nonlocal overlap_same_key, max_parallel, now_running
        running[e["account"]] += 1
        now_running += 1
        max_parallel = max(max_parallel, now_running)
        if running[e["account"]] > 1:
            overlap_same_key += 1
        await anyio.sleep(0.002 if e["seq"] % 3 else 0.0)
        order[e["account"]].append(e["seq"])
        running[e["account"]] -= 1
        now_running -= 1

    events = [{"account": f"acct-{i % 10}", "seq": i // 10} for i in range(600)]
    async with ServiceHarness(
        [svc], url=redis_url, namespace=namespace, settings=attrs.evolve(TEST_SETTINGS, concurrency=16)
    ) as h:
        await h.client.publish_many("entries", events, key=lambda e: e["account"])
        await h.run_until_idle()
    assert overlap_same_key == 0
    assert max_parallel > 1
    for account in (f"acct-{i}" for i in range(10)):
        assert order[account] == list(range(60))


async def test_key_function_orders_by_a_payload_field(redis_url: str, namespace: str) -> None:
    order: list[int] = []
    svc = Service("s")

    @svc.event("t", key=lambda e: e["customer"])
    async def h(e: dict) -> None:
        await anyio.sleep(0.001 * (5 - e["seq"] % 5))
        order.append(e["seq"])

    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as harness:
        await harness.client.publish_many("t", [{"customer": "c", "seq": i} for i in range(40)])
        await harness.run_until_idle()
    assert order == list(range(40))


async def test_a_long_run_does_not_hold_back_the_settling_of_runs_its_lane_finished(
    redis_url: str, namespace: str
) -> None:
    """A finished message of a key is published and acknowledged while the next message of its key
    (same lane) still runs, not when that run ends: a crash meanwhile must not re-run it."""
    worker = Service("slowlane", timeout=None)  # no handler timeout: the watchdog still settles stragglers
    release = anyio.Event()

    @worker.command("slowlane.jobs")
    async def job(cmd: dict, ctx: Context) -> None:
        ctx.publish("slowlane.done", {"n": cmd["n"]})
        if cmd["n"] == 1:
            await release.wait()

    async with ServiceHarness([worker], url=redis_url, namespace=namespace) as h:
        await h.client.send_many("slowlane.jobs", [{"n": 0}, {"n": 1}], key=lambda c: "k")
        with anyio.fail_after(5):
            while not await h.messages("slowlane.done") or h.stats()["slowlane.job"]["processed"] < 1:
                await anyio.sleep(0.05)
        done = [orjson.loads(e.body)["n"] for e in await h.messages("slowlane.done")]
        assert done == [0], done
        release.set()
        await h.run_until_idle()
        assert h.stats()["slowlane.job"]["processed"] == 2


async def test_staged_messages_leave_only_when_the_handler_succeeds(redis_url: str, namespace: str) -> None:
    svc = Service("billing", retry=RetryPolicy(max_attempts=1))

    @svc.event("orders.placed")
    async def charge(e: OrderPlaced, ctx: Context) -> None:
        await ctx.send("notifications.email", SendEmail(e.order_id, "receipt"))
        ctx.publish("payments.captured", {"order_id": e.order_id})
        if e.total_cents < 0:
            raise ValueError("negative total")

    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as h:
        await h.client.publish("orders.placed", OrderPlaced("good", 10))
        bad_id = await h.client.publish("orders.placed", OrderPlaced("bad", -1))
        await h.run_until_idle()
        emails = await h.messages("notifications.email")
        captured = await h.messages("payments.captured")
    assert [e.body for e in emails] == [b'{"to":"good","subject":"receipt"}']
    assert [e.type for e in emails] == ["SendEmail"]
    assert len(captured) == 1
    assert captured[0].headers["causation-id"] != bad_id
    assert emails[0].headers["correlation-id"] == captured[0].headers["correlation-id"]


async def test_retried_handler_resends_the_same_ids(redis_url: str, namespace: str) -> None:
    attempts = 0
    svc = Service("s", retry=RetryPolicy(max_attempts=3, immediate=2))

    @svc.command("q")
    async def h(cmd: dict, ctx: Context) -> None:
        nonlocal attempts
        attempts += 1
        ctx.publish("out", {"attempt": ctx.attempt})
        ctx.publish("out", {"second": True})
        if attempts == 1:
            raise RuntimeError("first attempt fails after staging")

    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as harness:
        incoming = await harness.client.send("q", {})
        await harness.run_until_idle()
        out = await harness.messages("out")
    assert attempts == 2
    assert len(out) == 2  # the failed attempt's staged messages never left
    from broker import derive_id

    assert [e.id for e in out] == [derive_id(incoming, "s/0"), derive_id(incoming, "s/1")]


async def test_sync_handlers_run_in_worker_threads(redis_url: str, namespace: str) -> None:
    threads: set[int] = set()
    svc = Service("s")

    @svc.command("q")
    def h(cmd: dict, ctx: Context) -> None:
        threads.add(threading.get_ident())
        ctx.send("q2", {"from": cmd["n"]})

    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as harness:
        await harness.client.send_many("q", [{"n": i} for i in range(20)])
        await harness.run_until_idle()
        assert len(await harness.messages("q2")) == 20
    assert threading.get_ident() not in threads


async def test_shutdown_acks_everything_it_processed(redis_url: str, namespace: str) -> None:
    processed: list[int] = []
    svc = Service("s")

    @svc.command("q")
    async def h(cmd: dict) -> None:
        await anyio.sleep(0.05)
        processed.append(cmd["n"])

    settings = attrs.evolve(TEST_SETTINGS, ack_interval=5.0, concurrency=8, prefetch=8)  # acks only at shutdown
    async with ServiceHarness([svc], url=redis_url, namespace=namespace, settings=settings) as harness:
        await harness.client.send_many("q", [{"n": i} for i in range(40)])
        with anyio.move_on_after(10):
            while len(processed) < 10:
                await anyio.sleep(0.01)
        runtime = harness.runtime
        await harness.stop()
        assert runtime is not None and runtime.in_flight == 0
        view = runtime.consumers[0].states[0].view
        pending = await harness.broker.redis.execute_command("XPENDING", view.stream, "s", "-", "+", 100)
        pending_ids = {p[0] for p in pending}
        assert all(p[2] > TEST_SETTINGS.visibility_timeout * 1000 for p in pending)  # handed over: claimable now
        left = {
            orjson.loads(dict(zip(f[::2], f[1::2], strict=True))[b"body"])["n"]: eid
            for eid, f in await harness.broker.redis.execute_command("XRANGE", view.stream, "-", "+")
        }
        assert not set(left) & set(processed)  # everything processed was acked (and deleted)
        assert len(left) == 40 - len(processed)  # and nothing unprocessed was acked
        assert pending_ids <= set(left.values())  # at most fetched-not-run entries stay pending, for redelivery


async def test_a_restarted_runtime_rereads_its_own_pending_entries(redis_url: str, namespace: str) -> None:
    seen: list[int] = []
    svc = Service("s")

    @svc.command("q")
    async def h(cmd: dict) -> None:
        seen.append(cmd["n"])

    async with ServiceHarness([], url=redis_url, namespace=namespace) as harness:
        await harness.client.send_many("q", [{"n": i} for i in range(5)])
        spec = await harness.broker.get_destination("q")
        assert spec is not None
        [view] = await harness.broker.subscribe(spec, "s")
        await harness.broker.read(view, "me", 10, 10)  # a previous life of "me" fetched them, then died
        settings = attrs.evolve(TEST_SETTINGS, consumer="me", visibility_timeout=600)
        runtime = Runtime([svc], broker=harness.broker, settings=settings)
        async with anyio.create_task_group() as tg:
            await tg.start(runtime.run)
            await runtime.wait_idle(timeout=5)  # long before any visibility timeout
            runtime.stop()
    assert sorted(seen) == [0, 1, 2, 3, 4]


async def test_runtime_settings_reject_nonsense() -> None:
    with pytest.raises(ValueError):
        RuntimeSettings(concurrency=0)


async def test_a_lone_message_is_acked_without_waiting_for_the_ack_interval(redis_url: str, namespace: str) -> None:
    done = anyio.Event()
    svc = Service("s")

    @svc.command("q")
    async def h(cmd: dict) -> None:
        done.set()

    settings = attrs.evolve(TEST_SETTINGS, ack_interval=30.0)  # a batching wait no test would sit out
    async with ServiceHarness([svc], url=redis_url, namespace=namespace, settings=settings) as harness:
        await harness.client.send("q", {"n": 1})
        with anyio.fail_after(10):
            await done.wait()
            view = harness.runtime.consumers[0].states[0].view if harness.runtime else None
            assert view is not None
            while await harness.broker.redis.execute_command("XPENDING", view.stream, "s", "-", "+", 10):
                await anyio.sleep(0.01)  # nothing else in flight: the ack went at once, not after 30 s
