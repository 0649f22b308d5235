"""Pattern subscriptions (``@svc.event("orders.*")``) and filters (``filter=``), end to end.

On the embedded Valkey (and ``memory://`` where it applies): patterns pick up existing topics and
topics created while the service runs; ``*`` is one word, ``#`` zero or more; filters route each
message to one handler before its body is decoded; what no handler wants is acked and counted,
never dead-lettered; malformed patterns and overlapping handlers fail at declaration.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest

from framework import Context, Filter, HandlerError, MessageInfo, Service, SyncClient, Topic
from framework.subscriptions import Pattern, names_overlap
from framework.testing import TEST_SETTINGS, ServiceHarness
from tests.workers import Workers, wait_for

pytestmark = pytest.mark.anyio

SETTINGS = attrs.evolve(TEST_SETTINGS, pattern_refresh=0.2)


@attrs.frozen
class OrderPlaced:
    order_id: str


@attrs.frozen
class OrderCancelled:
    order_id: str


async def _until(condition: object, timeout: float = 10.0) -> None:
    with anyio.fail_after(timeout):
        while not condition():  # type: ignore[operator]
            await anyio.sleep(0.02)


# -- declaration ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        ("orders.**", "mixes a wildcard into a word"),
        ("orders..*", "an empty word"),
        ("#..x", "an empty word"),
        ("*.orders.", "an empty word"),
        ("ord*ers", "mixes a wildcard into a word"),
        ("orders.#x", "mixes a wildcard into a word"),
        ("orders.*.p$", "only letters, digits"),
    ],
)
def test_a_malformed_pattern_fails_at_declaration_naming_it(pattern: str, why: str) -> None:
    svc = Service("audit")
    with pytest.raises(HandlerError, match=why) as err:

        @svc.event(pattern)
        async def record(event: dict) -> None: ...

    assert repr(pattern) in str(err.value) and "audit" in str(err.value)
    assert svc.handlers == []


def test_a_pattern_is_given_as_a_string_not_a_topic_layout() -> None:
    svc = Service("audit")
    with pytest.raises(HandlerError, match=r"Topic\('orders\.\*'\) is a pattern: pass it as a string"):
        svc.event(Topic("orders.*", partitions=4))


@pytest.mark.parametrize(
    ("pattern", "matching", "not_matching"),
    [
        ("orders.*", ["orders.placed", "orders.x"], ["orders", "orders.eu.placed", "ordersx.placed", "shop.orders.x"]),
        ("orders.#", ["orders", "orders.placed", "orders.eu.placed"], ["order", "shop.orders"]),
        ("#.placed", ["placed", "orders.placed", "a.b.placed"], ["orders.placed.x", "orders"]),
        ("*.eu.#", ["orders.eu", "orders.eu.placed.x"], ["eu", "orders.us.placed", "a.b.eu"]),
        ("#", ["a", "a.b.c"], []),
        ("*", ["a"], ["a.b"]),
    ],
)
def test_star_is_one_word_and_hash_zero_or_more(pattern: str, matching: list[str], not_matching: list[str]) -> None:
    p = Pattern.parse(pattern)
    assert [n for n in matching if not p.matches(n)] == []
    assert [n for n in not_matching if p.matches(n)] == []


def test_two_default_handlers_of_one_topic_fail_naming_both() -> None:
    svc = Service("billing")

    @svc.event("orders.placed")
    async def charge(event: OrderPlaced) -> None: ...

    with pytest.raises(HandlerError, match=r"billing\.audit .*billing\.charge .*both default handlers"):

        @svc.event("orders.*")  # matches orders.placed: two handlers for one message
        async def audit(event: dict) -> None: ...


def test_overlapping_filters_fail_at_declaration_naming_both() -> None:
    svc = Service("billing")

    @svc.event("orders", filter=Filter(type=OrderPlaced))
    async def charge(event: OrderPlaced) -> None: ...

    with pytest.raises(HandlerError, match=r"billing\.again .*billing\.charge .*can both match"):

        @svc.event("orders", filter=Filter(type="OrderPlaced", headers={"region": "eu"}))
        async def again(event: OrderPlaced) -> None: ...

    with pytest.raises(HandlerError, match=r"billing\.vague .*billing\.charge .*can both match"):

        @svc.event("orders", filter=lambda m: m.key == "x")  # predicates cannot be told apart
        async def vague(event: dict) -> None: ...

    with pytest.raises(HandlerError, match=r"billing\.crossing .*billing\.charge .*can both match"):

        @svc.event("*.#", filter=Filter(type=[OrderPlaced, OrderCancelled]))
        async def crossing(event: dict) -> None: ...

    # disjoint types, disjoint header values, and one default: all accepted
    @svc.event("orders", filter=Filter(type=OrderCancelled, headers={"region": "eu"}))
    async def cancel_eu(event: OrderCancelled) -> None: ...

    @svc.event("orders", filter=Filter(type=OrderCancelled, headers={"region": ["us", "ca"]}))
    async def cancel_us(event: OrderCancelled) -> None: ...

    @svc.event("orders")
    async def rest(event: dict) -> None: ...

    assert [h.name for h in svc.handlers] == ["charge", "cancel_eu", "cancel_us", "rest"]


def test_handlers_sharing_a_topic_must_share_the_inbox_mode() -> None:
    svc = Service("billing")

    @svc.event("orders", filter=Filter(type=OrderPlaced))
    async def charge(event: OrderPlaced) -> None: ...

    with pytest.raises(HandlerError, match="not the inbox mode"):

        @svc.event("orders", filter=Filter(type=OrderCancelled), inbox=False)
        async def cancel(event: OrderCancelled) -> None: ...


def test_bad_filters_fail_at_declaration() -> None:
    svc = Service("billing")
    with pytest.raises(ValueError, match="no condition"):  # raised where the Filter is written
        svc.event("orders", filter=Filter())
    with pytest.raises(HandlerError, match="filter= takes"):
        svc.event("orders", filter="OrderPlaced")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="header values are strings"):
        svc.event("orders", filter=Filter(headers={"region": 1}))


def test_patterns_overlap_when_some_name_matches_both() -> None:
    assert names_overlap("orders.*", "*.placed")
    assert names_overlap("orders.#", "#.eu.#")
    assert not names_overlap("orders.*", "orders.*.*")
    assert not names_overlap("orders.*", "payments.#")


# -- end to end --------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["redis", "memory"])
async def test_a_pattern_reads_matching_topics_existing_and_created_later(
    transport: str, redis_url: str, namespace: str
) -> None:
    url = "memory://" if transport == "memory" else redis_url
    seen: dict[str, list[str]] = defaultdict(list)
    audit = Service("audit")

    @audit.event("orders.*")
    async def orders(event: dict, ctx: Context) -> None:
        seen["orders.*"].append(ctx.destination)

    @audit.event("billing.#")
    async def billing(event: dict, ctx: Context) -> None:
        seen["billing.#"].append(ctx.destination)

    async with ServiceHarness([], url=url, namespace=namespace, settings=SETTINGS) as h:
        for topic in ("orders.placed", "orders.eu.placed", "billing", "billing.eu.paid", "shipping.sent"):
            await h.client.publish(topic, {"n": 1})  # the topics exist before the service starts
        h.services = [audit]
        await h.start()
        await _until(lambda: len(seen["orders.*"]) == 1 and len(seen["billing.#"]) == 2)
        # created while the service runs: picked up within the refresh interval, from its start
        await h.client.publish("orders.refunded", {"n": 2})
        await h.client.publish("billing.us.refunded", {"n": 3})
        await h.client.publish("shipping.lost", {"n": 4})
        await _until(lambda: len(seen["orders.*"]) == 2 and len(seen["billing.#"]) == 3, timeout=5)
        await h.run_until_idle()
        subscribed = {d for d, g in await h.broker.list_subscriptions() if g == "audit"}
    assert sorted(seen["orders.*"]) == ["orders.placed", "orders.refunded"]
    assert sorted(seen["billing.#"]) == ["billing", "billing.eu.paid", "billing.us.refunded"]
    # what matches no pattern is not consumed: the group is not even subscribed there
    assert subscribed == {"orders.placed", "orders.refunded", "billing", "billing.eu.paid", "billing.us.refunded"}


async def test_on_rabbitmq_a_pattern_subscribes_new_topics_and_gets_what_follows(
    rabbitmq_url: str, namespace: str
) -> None:
    # RabbitMQ keeps no history: a topic's events reach a group once its queue is bound, so a new
    # topic's events count from the refresh that subscribed the group (docs/transports.md).
    seen: list[str] = []
    audit = Service("audit")

    @audit.event("orders.*")
    async def orders(event: dict, ctx: Context) -> None:
        seen.append(f"{ctx.destination}:{event['n']}")

    async with ServiceHarness([audit], url=rabbitmq_url, namespace=namespace, settings=SETTINGS) as h:
        await h.client.publish("orders.placed", {"n": 1})  # creates the topic; nobody bound yet
        await h.client.publish("shipping.sent", {"n": 1})

        async def subscribed() -> set[str]:
            return {d for d, g in await h.broker.list_subscriptions() if g == "audit"}

        with anyio.fail_after(10):
            while "orders.placed" not in await subscribed():
                await anyio.sleep(0.05)
        await h.client.publish("orders.placed", {"n": 2})
        await _until(lambda: seen == ["orders.placed:2"])
        assert await subscribed() == {"orders.placed"}


async def test_a_pattern_subscription_restarts_without_an_orphan_error(redis_url: str, namespace: str) -> None:
    audit = Service("audit")
    got: list[str] = []

    @audit.event("orders.*")
    async def orders(event: dict) -> None:
        got.append(event["n"])

    async with ServiceHarness([audit], url=redis_url, namespace=namespace, settings=SETTINGS) as h:
        await h.client.publish("orders.placed", {"n": "a"})
        await _until(lambda: got == ["a"])
        await h.stop()
        await h.client.publish("orders.placed", {"n": "b"})
        await h.start()  # its group on orders.placed is the pattern's, not an orphan
        await _until(lambda: got == ["a", "b"])


def _router(log: dict[str, list[str]]) -> Service:
    svc = Service("billing")

    @svc.event("orders", filter=Filter(type=OrderPlaced))
    async def charge(event: OrderPlaced) -> None:
        log["charge"].append(event.order_id)

    @svc.event("orders", filter=Filter(type=OrderCancelled, headers={"region": "eu"}))
    async def refund_eu(event: OrderCancelled) -> None:
        log["refund_eu"].append(event.order_id)

    vip_only = Filter(type=OrderCancelled, headers={"region": "us"}, where=lambda m: m.headers.get("vip") == "yes")

    @svc.event("orders", filter=vip_only)
    async def vip(event: OrderCancelled) -> None:  # with a predicate over the metadata (MessageInfo)
        log["vip"].append(event.order_id)

    @svc.event("orders")
    async def other(event: dict) -> None:
        log["other"].append(event["order_id"])

    return svc


@pytest.mark.parametrize("transport", ["redis", "memory", "rabbitmq"])
async def test_filters_route_each_message_to_one_handler_by_type_and_header(
    transport: str, request: pytest.FixtureRequest, namespace: str
) -> None:
    log: dict[str, list[str]] = defaultdict(list)
    url = "memory://" if transport == "memory" else request.getfixturevalue(f"{transport}_url")
    async with ServiceHarness([_router(log)], url=url, namespace=namespace) as h:
        await h.client.publish("orders", OrderPlaced("p1"))
        await h.client.publish("orders", OrderCancelled("c-eu"), headers={"region": "eu"})
        await h.client.publish("orders", OrderCancelled("c-us"), headers={"region": "us"})
        await h.client.publish("orders", OrderCancelled("c-vip"), headers={"region": "us", "vip": "yes"})
        await h.client.publish("orders", {"order_id": "x1"}, type="OrderShipped")
        await h.client.publish("orders", OrderPlaced("p2"))
        await h.run_until_idle()
        stats = h.stats()
        groups = [g for d, g in await h.broker.list_subscriptions() if d == "orders"]
    assert dict(log) == {"charge": ["p1", "p2"], "refund_eu": ["c-eu"], "vip": ["c-vip"], "other": ["c-us", "x1"]}
    assert groups == ["billing"]  # the four handlers share the one group of the topic
    assert stats["billing.charge"]["fetched"] == 6  # read once, by the group's one reader
    assert sum(s["processed"] for s in stats.values()) == 6
    assert all(s["unwanted"] == 0 for s in stats.values())


@pytest.mark.parametrize("transport", ["redis", "memory"])
async def test_an_event_no_handler_wants_is_acked_and_counted_never_dead_lettered(
    transport: str, redis_url: str, namespace: str
) -> None:
    charged: list[str] = []
    svc = Service("billing")

    @svc.event("orders", filter=Filter(type=OrderPlaced))
    async def charge(event: OrderPlaced) -> None:
        charged.append(event.order_id)

    url = redis_url if transport == "redis" else "memory://"
    async with ServiceHarness([svc], url=url, namespace=namespace) as h:
        await h.client.publish("orders", OrderCancelled("c1"))
        # would not decode into OrderPlaced (nor JSON at all): never decoded, so not poison
        await h.client.publish("orders", b"\xff\xfe not json", type="Junk")
        await h.client.publish("orders", OrderPlaced("p1"))
        await h.run_until_idle()  # idle: every entry acknowledged
        stats = h.stats()["billing.charge"]
        dead = await h.dead_letters()
    assert charged == ["p1"]
    assert (stats["unwanted"], stats["processed"], stats["dead_lettered"]) == (2, 1, 0)
    assert dead == []


async def test_unwanted_events_are_a_metric(redis_url: str, namespace: str) -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from framework import enable_metrics
    from framework.observability import disable_metrics

    svc = Service("billing")

    @svc.event("orders", filter=Filter(type=OrderPlaced))
    async def charge(event: OrderPlaced) -> None: ...

    reader = InMemoryMetricReader()
    enable_metrics(MeterProvider(metric_readers=[reader]))
    try:
        async with ServiceHarness([svc], url=redis_url, namespace=namespace) as h:
            for n in range(3):
                await h.client.publish("orders", OrderCancelled(f"c{n}"))
            await h.run_until_idle()
            data = reader.get_metrics_data()
    finally:
        disable_metrics()
    assert data is not None
    values = [
        point.value
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for metric in sm.metrics
        if metric.name == "framework.messages.unwanted"
        for point in metric.data.data_points
        if dict(point.attributes or {}).get("framework.handler") == "charge"
    ]
    assert values == [3]


async def test_a_wanted_message_is_decoded_and_dead_lettered_when_it_does_not_decode(
    redis_url: str, namespace: str
) -> None:
    svc = Service("billing")

    @svc.event("orders", filter=Filter(type="OrderPlaced"))
    async def charge(event: OrderPlaced) -> None: ...

    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as h:
        await h.client.publish("orders", b"\xff not json", type="OrderPlaced")  # taken, then poison
        await h.client.publish("orders", b"\xff not json", type="Junk")  # not taken: acked
        await h.run_until_idle()
        dead = await h.dead_letters()
        stats = h.stats()["billing.charge"]
    assert [d.reason.split(":")[0] for d in dead] == ["invalid payload"]
    assert stats["unwanted"] == 1


async def test_a_filter_predicate_that_raises_dead_letters_the_message_naming_it(
    redis_url: str, namespace: str
) -> None:
    svc = Service("billing")

    def broken(m: MessageInfo) -> bool:
        raise KeyError("region")

    @svc.event("orders", filter=broken)
    async def charge(event: dict) -> None: ...

    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as h:
        await h.client.publish("orders", {"n": 1})
        await h.run_until_idle()
        [dead] = await h.dead_letters()
    assert "filter predicate raised KeyError" in dead.reason


async def test_a_pattern_handler_and_a_filtered_named_handler_share_the_topic(redis_url: str, namespace: str) -> None:
    log: dict[str, list[str]] = defaultdict(list)
    svc = Service("billing")

    @svc.event("orders.placed", filter=Filter(headers={"region": "eu"}))
    async def eu(event: dict) -> None:
        log["eu"].append(event["n"])

    @svc.event("orders.*")  # the default of every orders.* topic, orders.placed included
    async def anything(event: dict, ctx: Context) -> None:
        log["any"].append(f"{ctx.destination}:{event['n']}")

    async with ServiceHarness([svc], url=redis_url, namespace=namespace, settings=SETTINGS) as h:
        await h.client.publish("orders.placed", {"n": "1"}, headers={"region": "eu"})
        await h.client.publish("orders.placed", {"n": "2"}, headers={"region": "us"})
        await h.client.publish("orders.cancelled", {"n": "3"}, headers={"region": "eu"})
        await _until(lambda: len(log["eu"]) + len(log["any"]) == 3)
        await h.run_until_idle()
    assert log["eu"] == ["1"]
    assert sorted(log["any"]) == ["orders.cancelled:3", "orders.placed:2"]


@pytest.mark.parametrize("transport", ["redis", "memory"])
async def test_one_key_keeps_its_order_across_the_handlers_of_a_shared_topic(
    transport: str, redis_url: str, namespace: str
) -> None:
    ran: list[str] = []
    svc = Service("billing")

    @svc.event("orders", filter=Filter(type=OrderPlaced))
    async def placed(event: OrderPlaced) -> None:
        await anyio.sleep(0.002)  # slower than the other: without one order per key it would be overtaken
        ran.append(event.order_id)

    @svc.event("orders", filter=Filter(type=OrderCancelled))
    async def cancelled(event: OrderCancelled) -> None:
        ran.append(event.order_id)

    url = redis_url if transport == "redis" else "memory://"
    sent = [f"{k}-{i}" for i in range(20) for k in ("a", "b")]
    async with ServiceHarness([], url=url, namespace=namespace) as h:
        for n, order_id in enumerate(sent):  # stored before the service starts: fetched in one read
            event = OrderPlaced(order_id) if n % 3 else OrderCancelled(order_id)
            await h.client.publish("orders", event, key=order_id[0])
        h.services = [svc]
        await h.start()
        await h.run_until_idle()
        stats = h.stats()
    for key in ("a", "b"):
        assert [o for o in ran if o[0] == key] == [o for o in sent if o[0] == key]
    assert stats["billing.placed"]["processed"] + stats["billing.cancelled"]["processed"] == 40
    assert stats["billing.cancelled"]["processed"] == len([n for n in range(40) if n % 3 == 0])


async def test_each_handler_of_a_shared_topic_keeps_its_own_retry_policy(redis_url: str, namespace: str) -> None:
    from framework import RetryPolicy

    tries: dict[str, int] = defaultdict(int)
    svc = Service("billing", retry=RetryPolicy(max_attempts=3, backoff=0.01))

    @svc.event("orders", filter=Filter(type=OrderPlaced))
    async def placed(event: OrderPlaced) -> None:
        tries["placed"] += 1
        raise RuntimeError("placed fails")

    @svc.event("orders", filter=Filter(type=OrderCancelled), retry=RetryPolicy(max_attempts=1))
    async def cancelled(event: OrderCancelled) -> None:
        tries["cancelled"] += 1
        raise RuntimeError("cancelled fails")

    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as h:
        await h.client.publish("orders", OrderPlaced("p"))
        await h.client.publish("orders", OrderCancelled("c"))
        await h.run_until_idle()
        dead = {d.handler: d.attempts for d in await h.dead_letters()}
        stats = h.stats()
    assert dict(tries) == {"placed": 3, "cancelled": 1}
    assert dead == {"billing.placed": 3, "billing.cancelled": 1}
    assert (stats["billing.placed"]["dead_lettered"], stats["billing.cancelled"]["dead_lettered"]) == (1, 1)


def test_the_example_of_the_guide_runs_and_prints_what_it_says(tmp_path: Path) -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "patterns-and-filters.md").read_text()
    [block] = [b for b in re.findall(r"```python\n(.*?)```", doc, flags=re.S) if "anyio.run(main)" in b]
    (tmp_path / "example.py").write_text(block)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    run = subprocess.run(
        [sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr[-3000:]
    printed = [line for line in run.stdout.splitlines() if line.startswith(("[", "{"))]  # not the log lines
    assert printed == [
        "['cancelled o-2 on orders.shop', 'placed o-1 on orders.web']",
        "{'audit.placed': 1, 'audit.cancelled_eu': 0}",
    ]


@pytest.mark.slow
@pytest.mark.fault
def test_a_crash_loop_in_a_shared_topic_dead_letters_by_the_policy_of_the_handler_that_runs_it(
    workers: Workers, redis_url: str, namespace: str
) -> None:
    import redis

    r = redis.Redis.from_url(redis_url)
    with SyncClient(redis_url, namespace=namespace) as client:
        crash_id = client.publish("filtered.events", {"n": "crash"}, type="Crash", key="hot")
        for n in range(10):
            client.publish("filtered.events", {"n": str(n)}, type="Normal", key="hot" if n < 3 else None)
    dlq = f"{namespace}:{{filtered.events:0}}:g:filtered:dlq"
    exits = []
    for _ in range(6):  # crashy's max_attempts is 3 (the service's, and normal's, is 6)
        w = workers.start("filterapp:worker", "w", "--concurrency", "4", "--visibility-timeout", "30")
        wait_for(lambda w=w: w.poll() is not None or r.xlen(dlq) > 0, 60, "crash or DLQ")
        if w.poll() is None:
            wait_for(lambda: r.llen(f"{namespace}:test:normal") >= 10, 60, "the normal events")
            w.send_signal(signal.SIGTERM)
            assert w.wait(timeout=30) == 0
            break
        exits.append(w.returncode)
    assert exits == [17, 17, 17]
    [(_, dead)] = r.xrange(dlq)
    assert dead[b"id"].decode() == crash_id
    assert dead[b"dlq-handler"] == b"filtered.crashy"
    assert b"(max_attempts 3)" in dead[b"dlq-reason"]
    normal = [v.decode() for v in r.lrange(f"{namespace}:test:normal", 0, -1)]
    assert sorted(set(normal), key=int) == [str(n) for n in range(10)]


@pytest.mark.parametrize("transport", ["redis", "memory"])
async def test_each_handler_of_a_shared_topic_keeps_its_own_timeout(
    transport: str, redis_url: str, namespace: str
) -> None:
    from framework import RetryPolicy

    fast_done: list[str] = []
    svc = Service("billing", timeout=None)  # the lead (declared first) has no limit

    @svc.event("orders", filter=Filter(type=OrderPlaced))
    async def fast(event: OrderPlaced) -> None:
        await anyio.sleep(0.5)
        fast_done.append(event.order_id)

    @svc.event("orders", filter=Filter(type=OrderCancelled), timeout=0.2, retry=RetryPolicy(max_attempts=1))
    async def slow(event: OrderCancelled) -> None:
        await anyio.sleep(30)

    url = redis_url if transport == "redis" else "memory://"
    async with ServiceHarness([svc], url=url, namespace=namespace) as h:
        await h.client.publish("orders", OrderPlaced("p"))
        await h.client.publish("orders", OrderCancelled("c"))
        with anyio.fail_after(10):
            await h.run_until_idle()
        [dead] = await h.dead_letters()
    assert fast_done == ["p"]  # longer than slow's timeout, not cut short
    assert dead.handler == "billing.slow" and "0.2 s timeout" in dead.reason


def test_the_asyncapi_export_describes_patterns_and_filters() -> None:
    from framework.asyncapi import build_document
    from tests.test_asyncapi import assert_valid

    svc = Service("audit")

    @svc.event("orders.#")
    async def record(event: OrderPlaced) -> None: ...

    @svc.event("payments", filter=Filter(type=OrderCancelled, headers={"region": "eu"}))
    async def refunds(event: OrderCancelled) -> None: ...

    document = build_document([svc])
    assert_valid(document)
    [channel] = [c for c in document["channels"].values() if c["address"] == "orders.#"]
    assert channel["x-framework-pattern"] is True
    assert document["operations"]["audit.refunds"]["x-framework-filter"] == (
        "Filter(type=['OrderCancelled'], headers={'region': ['eu']})"
    )


def test_a_batch_handler_reads_its_topic_alone() -> None:
    from framework import BatchPolicy

    svc = Service("ledger")
    with pytest.raises(HandlerError, match="a batch handler takes no filter="):
        svc.event("entries", filter=Filter(type="Posted"), batch=BatchPolicy(max_size=10))

    @svc.event("entries", batch=BatchPolicy(max_size=10))
    async def post(events: list[dict]) -> None: ...

    with pytest.raises(HandlerError, match=r"ledger\.audit .*ledger\.post .*one takes batches"):

        @svc.event("entries", filter=Filter(type="Posted"))
        async def audit(event: dict) -> None: ...


@pytest.mark.parametrize("transport", ["redis", "memory"])
async def test_a_pattern_handler_can_take_batches_per_matching_topic(
    transport: str, redis_url: str, namespace: str
) -> None:
    from framework import BatchPolicy

    batches: list[tuple[str, int]] = []
    svc = Service("ledger")

    @svc.event("ledger.*", batch=BatchPolicy(max_size=50, max_wait=0.05))
    async def post(events: list[dict], ctx: Any) -> None:
        batches.append((ctx.destination, len(events)))

    url = redis_url if transport == "redis" else "memory://"
    async with ServiceHarness([], url=url, namespace=namespace, settings=SETTINGS) as h:
        for n in range(5):
            await h.client.publish("ledger.eu", {"n": n})
        for n in range(3):
            await h.client.publish("ledger.us", {"n": n})
        h.services = [svc]
        await h.start()
        await h.run_until_idle()
    totals: dict[str, int] = defaultdict(int)
    for topic, size in batches:
        totals[topic] += size
    assert dict(totals) == {"ledger.eu": 5, "ledger.us": 3}
    assert max(size for _, size in batches) > 1  # taken as batches, not one by one


def test_the_refresh_interval_is_a_setting_with_an_environment_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from framework import RuntimeSettings

    assert RuntimeSettings().pattern_refresh == 5.0
    monkeypatch.setenv("FRAMEWORK_PATTERN_REFRESH", "0.5")
    assert RuntimeSettings().pattern_refresh == 0.5
    monkeypatch.setenv("FRAMEWORK_PATTERN_REFRESH", "soon")
    with pytest.raises(ValueError, match="FRAMEWORK_PATTERN_REFRESH='soon' is not a number"):
        RuntimeSettings()
    with pytest.raises(ValueError, match="pattern_refresh must be a positive number"):
        RuntimeSettings(pattern_refresh=0)
