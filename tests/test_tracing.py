"""Tracing on real servers, spans read back from the OpenTelemetry SDK's in-memory exporter.

One business flow is one trace: code that writes an order and its event in one database
transaction (the outbox), the relay's publish, and three services handing the work on, with a
retry, a handler's own child span (sync handler, worker thread) and the parent/child links and
attributes of the contract. Dead letters carry their reason (a handler's last attempt, a timeout,
a payload that does not decode, an entry that is not a message at all), inbox duplicates get a
short span, a sampled-out parent stays sampled out downstream, and with tracing off nothing is
added to a message and the handler keeps the no-middleware fast path.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import attrs
import orjson
import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, StatusCode, TraceFlags

from broker.headers import TRACEPARENT
from framework import Context, Queue, RetryPolicy, Runtime, Service, Topic, enable_tracing, outbox
from framework.observability import disable_tracing, tracing_enabled
from framework.testing import TEST_SETTINGS, ServiceHarness

pytestmark = pytest.mark.anyio


def memory_exporter() -> InMemorySpanExporter:
    """The process's global SDK tracer provider with an in-memory exporter (set up once: the
    global provider can be set only once, and handlers' own spans go to the global one)."""
    provider = trace.get_tracer_provider()
    exporter = getattr(provider, "test_exporter", None)
    if exporter is None:
        provider = TracerProvider()  # the default sampler: parent-based, always on
        exporter = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        provider.test_exporter = exporter  # type: ignore[attr-defined]
        trace.set_tracer_provider(provider)
    assert trace.get_tracer_provider() is provider, "another global tracer provider was installed first"
    return exporter  # type: ignore[no-any-return]


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = memory_exporter()
    exporter.clear()
    enable_tracing(trace.get_tracer_provider())
    yield exporter
    disable_tracing()
    exporter.clear()


def _hex(span_id: int) -> str:
    return format(span_id, "016x")


def _by_name(found: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return sorted((s for s in found if s.name == name), key=lambda s: s.start_time or 0)


def _parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


async def _until(event: anyio.Event, runtime: Runtime, timeout: float = 20) -> None:
    with anyio.fail_after(timeout):
        await event.wait()
    await runtime.wait_idle(timeout=timeout)


@attrs.frozen
class Charge:
    amount: int


# -- one business flow is one trace ---------------------------------------------------------------------


async def test_an_order_written_through_the_outbox_is_one_trace_across_three_services(
    redis_url: str, namespace: str, tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    db = f"sqlite:///{tmp_path / 'shop.db'}"
    engine = outbox.create_engine(db)
    await outbox.create_tables(engine)
    tracer = trace.get_tracer("shop")
    emailed = anyio.Event()

    billing = Service("billing")
    shipping = Service("shipping")
    notifications = Service("notifications", retry=RetryPolicy(max_attempts=3, immediate=0, backoff=0.05))

    @billing.event(Topic("orders.placed"))
    async def charge(order: dict, ctx: Context) -> None:
        ctx.publish("payments.captured", {"order_id": order["order_id"]})

    @shipping.event(Topic("payments.captured"))
    async def ship(payment: dict, ctx: Context) -> None:
        ctx.send("notifications.email", {"order_id": payment["order_id"]}, key=payment["order_id"])

    @notifications.command(Queue("notifications.email"))
    def send_email(email: dict, ctx: Context) -> None:  # sync: runs in a worker thread
        with tracer.start_as_current_span("render email"):  # the plain OTel API, no framework code
            pass
        if ctx.attempt == 1:
            raise ConnectionError("smtp down")  # retried through the retry path
        emailed.set()

    async with ServiceHarness([], url=redis_url, namespace=namespace) as h:
        runtime = Runtime(
            [billing, shipping, notifications], broker=h.broker, settings=TEST_SETTINGS, outbox_database_url=db
        )
        async with anyio.create_task_group() as tg:
            await tg.start(runtime.run)
            with tracer.start_as_current_span("place order") as root:  # an HTTP endpoint, say
                async with engine.begin() as conn:
                    order_id = await outbox.add_event(conn, "orders.placed", {"order_id": "o-1"}, key="o-1")
            await _until(emailed, runtime)
            runtime.stop()
    await engine.dispose()

    trace_id = root.get_span_context().trace_id
    found = spans.get_finished_spans()
    assert {s.context.trace_id for s in found} == {trace_id}, "every span of the flow is on the order's trace"
    [place] = _by_name(found, "place order")
    [relayed] = _by_name(found, "send orders.placed")
    [charged] = _by_name(found, "process orders.placed")
    [captured] = _by_name(found, "send payments.captured")
    [shipped] = _by_name(found, "process payments.captured")
    [queued] = _by_name(found, "send notifications.email")
    first, second = _by_name(found, "process notifications.email")
    renders = _by_name(found, "render email")
    assert len(found) == 10

    # the tree: place order -> relay's publish -> billing -> its publish -> shipping -> its send -> 2 attempts
    assert _parent_of(place) is None
    assert _parent_of(relayed) == place.context.span_id  # the row carried the writer's context
    assert _parent_of(charged) == relayed.context.span_id
    assert _parent_of(captured) == charged.context.span_id  # staged inside the handler's span
    assert _parent_of(shipped) == captured.context.span_id
    assert _parent_of(queued) == shipped.context.span_id
    assert _parent_of(first) == _parent_of(second) == queued.context.span_id  # each attempt, same parent
    assert sorted(_parent_of(r) or 0 for r in renders) == sorted([first.context.span_id, second.context.span_id])
    kinds = {s.name: s.kind for s in found}
    assert kinds["send orders.placed"] == kinds["send payments.captured"] == SpanKind.PRODUCER
    assert kinds["process orders.placed"] == kinds["process notifications.email"] == SpanKind.CONSUMER

    # the messaging attributes
    a = dict(charged.attributes or {})
    assert a["messaging.system"] == "redis"
    assert a["messaging.destination.name"] == "orders.placed"
    assert a["messaging.operation.type"] == a["messaging.operation.name"] == "process"
    assert a["messaging.message.id"] == order_id
    assert a["messaging.consumer.group.name"] == a["framework.service"] == "billing"
    assert a["framework.handler"] == "charge"
    assert a["messaging.destination.partition.id"] == "0"
    assert a["messaging.message.body.size"] == len(b'{"order_id":"o-1"}')
    assert a["framework.attempt"] == 1 and a["framework.delivery_count"] == 1
    assert a["framework.outcome"] == "success"
    assert dict(shipped.attributes or {})["messaging.message.conversation_id"] == order_id  # the first message's id
    assert dict(relayed.attributes or {})["messaging.message.id"] == order_id

    # the retry: attempt 1 failed with its exception and the delay; attempt 2 succeeded
    one, two = dict(first.attributes or {}), dict(second.attributes or {})
    assert (one["framework.attempt"], one["framework.outcome"]) == (1, "retry")
    assert (two["framework.attempt"], two["framework.outcome"]) == (2, "success")
    [retry] = [e for e in first.events if e.name == "retry"]
    assert 0 <= float((retry.attributes or {})["framework.retry.delay_s"]) <= 0.05
    [exc] = [e for e in first.events if e.name == "exception"]
    assert (exc.attributes or {})["exception.type"] == "ConnectionError"
    assert first.status.status_code == StatusCode.ERROR and second.status.status_code == StatusCode.UNSET


async def test_dead_letters_timeouts_and_poison_are_on_their_traces_with_the_reason(
    redis_url: str, namespace: str, spans: InMemorySpanExporter
) -> None:
    svc = Service("payments", retry=RetryPolicy(max_attempts=2, immediate=0, backoff=0.02))
    slow = Service("slowpoke", retry=RetryPolicy(max_attempts=1))

    @svc.command(Queue("payments.charge"))
    async def charge(cmd: Charge) -> None:
        raise ValueError(f"card declined for {cmd.amount}")

    @slow.command(Queue("slow.work"), timeout=0.2)
    async def work(job: dict) -> None:
        await anyio.sleep(30)

    tracer = trace.get_tracer("test")
    async with ServiceHarness([svc, slow], url=redis_url, namespace=namespace) as h:
        with tracer.start_as_current_span("declined") as declined:
            await h.client.send("payments.charge", {"amount": 5})
        with tracer.start_as_current_span("invalid") as invalid:
            await h.client.send("payments.charge", {"amount": "five"})  # not an int: dead at admission
        with tracer.start_as_current_span("stuck") as stuck:
            await h.client.send("slow.work", {})
        stream = h.broker.keyspace.partition("payments.charge", 0).stream
        await h.broker.redis.xadd(stream, {"not": "a message"})  # undecodable: no envelope, no parent
        await h.run_until_idle()
        assert h.stats()["payments.charge"]["dead_lettered"] == 3

    found = spans.get_finished_spans()

    def processed(root: Any) -> list[ReadableSpan]:
        ids = root.get_span_context().trace_id
        return _by_name([s for s in found if s.context.trace_id == ids], "process payments.charge") or _by_name(
            [s for s in found if s.context.trace_id == ids], "process slow.work"
        )

    first, last = processed(declined)
    assert dict(first.attributes or {})["framework.outcome"] == "retry"
    assert [e.name for e in first.events] == ["retry", "exception"]
    assert dict(last.attributes or {})["framework.outcome"] == "dead_letter"
    [dead] = [e for e in last.events if e.name == "dead_letter"]
    reason = str((dead.attributes or {})["framework.dead_letter.reason"])
    assert reason == "failed 2 of 2 attempts: ValueError: card declined for 5"
    assert last.status.status_code == StatusCode.ERROR and last.status.description == reason

    [poisoned] = processed(invalid)
    assert dict(poisoned.attributes or {})["framework.outcome"] == "dead_letter"
    [dead] = [e for e in poisoned.events if e.name == "dead_letter"]
    assert str((dead.attributes or {})["framework.dead_letter.reason"]).startswith("invalid payload: ")

    [timed_out] = processed(stuck)
    assert dict(timed_out.attributes or {})["framework.outcome"] == "dead_letter"
    [exc] = [e for e in timed_out.events if e.name == "exception"]
    assert (exc.attributes or {})["exception.type"] == "framework.retries.HandlerTimeout"

    known = {declined.get_span_context().trace_id, invalid.get_span_context().trace_id}
    [garbage] = [s for s in _by_name(found, "process payments.charge") if s.context.trace_id not in known]
    assert garbage.parent is None  # nothing to continue: a trace of its own
    [dead] = [e for e in garbage.events if e.name == "dead_letter"]
    assert str((dead.attributes or {})["framework.dead_letter.reason"]).startswith("undecodable message")


async def test_an_inbox_duplicate_gets_a_short_span_on_its_publishers_trace(
    redis_url: str, namespace: str, spans: InMemorySpanExporter
) -> None:
    svc = Service("dedup")
    runs: list[int] = []

    @svc.command(Queue("dedup.work"))
    async def work(job: dict) -> None:
        runs.append(job["n"])

    tracer = trace.get_tracer("test")
    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as h:
        await h.client.send("dedup.work", {"n": 1}, message_id="0190aaaa-0000-7000-8000-000000000001")
        await h.run_until_idle()
        with tracer.start_as_current_span("again") as again:  # the same id again: the inbox drops it
            await h.client.send("dedup.work", {"n": 2}, message_id="0190aaaa-0000-7000-8000-000000000001")
        await h.run_until_idle()
        assert h.stats()["dedup.work"]["duplicates"] == 1
    assert runs == [1]
    found = spans.get_finished_spans()
    [sent] = [s for s in _by_name(found, "send dedup.work") if s.context.trace_id == again.get_span_context().trace_id]
    [dropped] = [s for s in _by_name(found, "process dedup.work") if s.context.trace_id == sent.context.trace_id]
    assert _parent_of(dropped) == sent.context.span_id
    assert dict(dropped.attributes or {})["framework.outcome"] == "duplicate"


async def test_a_batch_publish_is_one_span_per_message_all_children_of_the_caller(
    redis_url: str, namespace: str, spans: InMemorySpanExporter
) -> None:
    tracer = trace.get_tracer("test")
    async with ServiceHarness([], url=redis_url, namespace=namespace) as h:
        with tracer.start_as_current_span("import") as root:
            ids = await h.client.send_many("batch.work", [{"n": n} for n in range(3)])
        stored = await h.messages("batch.work")
    sends = _by_name(spans.get_finished_spans(), "send batch.work")
    assert len(sends) == 3
    assert {_parent_of(s) for s in sends} == {root.get_span_context().span_id}  # siblings, not nested
    assert sorted(dict(s.attributes or {})["messaging.message.id"] for s in sends) == sorted(ids)
    by_id = {dict(s.attributes or {})["messaging.message.id"]: s for s in sends}
    for env in stored:  # each message carries its own span's context
        span = by_id[env.id]
        version, trace_id, span_id, flags = env.headers[TRACEPARENT].split("-")
        assert (version, trace_id, span_id) == ("00", f"{span.context.trace_id:032x}", _hex(span.context.span_id))
        assert int(flags, 16) & 1, "sampled"


# -- sampling and off -------------------------------------------------------------------------------------


async def test_a_sampled_out_parent_records_nothing_downstream_but_its_context_travels(
    redis_url: str, namespace: str, spans: InMemorySpanExporter
) -> None:
    svc = Service("sampled")

    seen: list[dict[str, str]] = []

    @svc.command(Queue("sampled.in"))
    async def forward(job: dict, ctx: Context) -> None:
        seen.append(dict(ctx.headers))
        ctx.send("sampled.out", job)

    trace_id = 0x4BF92F3577B34DA6A3CE929D0E0E4736
    parent = NonRecordingSpan(SpanContext(trace_id, 0x00F067AA0BA902B7, is_remote=True, trace_flags=TraceFlags(0)))
    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as h:
        token = otel_context.attach(trace.set_span_in_context(parent))
        try:
            await h.client.send("sampled.in", {"n": 1})
        finally:
            otel_context.detach(token)
        await h.run_until_idle()
        [outgoing] = await h.messages("sampled.out")
    assert spans.get_finished_spans() == ()  # not the producer, not the consumer, not the staged send
    [incoming] = seen
    for headers in (incoming, outgoing.headers):
        match = re.fullmatch(f"00-{trace_id:032x}-[0-9a-f]{{16}}-([0-9a-f]{{2}})", headers[TRACEPARENT])
        assert match is not None, headers
        assert not int(match[1], 16) & 1, "the sampled flag stays 0"


async def test_a_ratio_is_applied_once_before_the_sdk_and_unsampled_traces_stay_unsampled(
    redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a provider built by the framework from OTEL_TRACES_SAMPLER (parent-based ratio), roots
    are drawn before the SDK: about the ratio of messages is traced, each one a whole trace, and
    every other message travels with its own unsampled context (flags 00, fresh ids)."""
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    from framework.observability import hooks, tracing

    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    built = tracing.build_provider("ratio", endpoint="http://127.0.0.1:9")
    sampler = built.sampler
    built.shutdown()
    assert isinstance(sampler, tracing.PreSampled)
    assert isinstance(sampler.delegate, ParentBased)
    assert isinstance(sampler.delegate._root, TraceIdRatioBased) and sampler.delegate._root.rate == 0.25
    provider = TracerProvider(sampler=sampler)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    svc = Service("ratio")

    @svc.command(Queue("ratio.in"))
    async def forward(job: dict, ctx: Context) -> None:
        ctx.send("ratio.out", job)

    n = 200
    enable_tracing(provider)
    try:
        async with ServiceHarness([svc], url=redis_url, namespace=namespace) as h:
            hooks.set_flags(tracing=False)  # the first half carries no trace context: consumer roots
            try:
                await h.client.send_many("ratio.in", [{"n": i} for i in range(n)])
            finally:
                hooks.set_flags(tracing=True)
            await h.client.send_many("ratio.in", [{"n": i} for i in range(n, 2 * n)])  # producer roots
            await h.run_until_idle()
            outgoing = await h.messages("ratio.out")
    finally:
        disable_tracing()
    found = exporter.get_finished_spans()
    consumers = [s for s in found if s.name == "process ratio.in"]
    traced = {s.context.trace_id for s in consumers}
    assert len(outgoing) == 2 * n
    for half in (range(n), range(n, 2 * n)):
        sampled = [env for env in outgoing if orjson.loads(env.body)["n"] in half and _sampled(env)]
        assert 0.10 * n <= len(sampled) <= 0.45 * n, len(sampled)  # 25% of 200: 50 +- 6 sd
    unsampled_ids = []
    for env in outgoing:
        _, trace_id, _, flags = env.headers[TRACEPARENT].split("-")
        if int(flags, 16) & 1:
            assert int(trace_id, 16) in traced, "a sampled message belongs to a recorded trace"
        else:
            assert int(trace_id, 16) not in traced
            unsampled_ids.append(trace_id)
    assert len(set(unsampled_ids)) == len(unsampled_ids), "every unsampled root has ids of its own"
    # each recorded consumer span is a whole trace: its staged send is its child
    sends = {s.parent.span_id for s in found if s.name == "send ratio.out" and s.parent is not None}
    assert all(s.context.span_id in sends for s in consumers)
    roots = [s for s in consumers if s.parent is None]
    assert roots and len(roots) < len(consumers), "consumer roots (first half) and producer parents (second)"


def _sampled(env: Any) -> bool:
    return bool(int(env.headers[TRACEPARENT].rsplit("-", 1)[1], 16) & 1)


async def test_user_middleware_runs_inside_the_consumer_span_and_sees_its_outcome(
    redis_url: str, namespace: str, spans: InMemorySpanExporter
) -> None:
    svc = Service("guarded", retry=RetryPolicy(max_attempts=2, immediate=1))
    inside: list[tuple[int, str]] = []

    @svc.middleware
    async def audit(message: Any, ctx: Context, call_next: Any) -> Any:
        outcome = await call_next()
        inside.append((trace.get_current_span().get_span_context().span_id, outcome.status))
        return outcome

    @svc.command(Queue("guarded.in"))
    async def work(job: dict, ctx: Context) -> None:
        if ctx.attempt == 1:
            raise RuntimeError("first attempt fails")

    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as h:
        await h.client.send("guarded.in", {"n": 1})
        await h.run_until_idle()
        [consumer] = h.runtime.consumers if h.runtime is not None else []
        assert consumer.attempts.run == consumer.attempts._run_chain
    attempts = _by_name(list(spans.get_finished_spans()), "process guarded.in")
    assert [(s.context.span_id, (s.attributes or {})["framework.outcome"]) for s in attempts] == inside
    assert [status for _, status in inside] == ["retry", "success"]


async def test_tracing_off_adds_no_headers_and_keeps_the_fast_path(redis_url: str, namespace: str) -> None:
    exporter = memory_exporter()
    exporter.clear()
    disable_tracing()
    assert not tracing_enabled()
    svc = Service("quiet")
    seen: list[dict[str, str]] = []

    @svc.command(Queue("quiet.in"))
    async def forward(job: dict, ctx: Context) -> None:
        seen.append(dict(ctx.headers))
        ctx.publish("quiet.out", job)

    tracer = trace.get_tracer("test")
    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as h:
        with tracer.start_as_current_span("caller"):  # even inside an application's span
            await h.client.send("quiet.in", {"n": 1})
        await h.run_until_idle()
        [consumer] = h.runtime.consumers if h.runtime is not None else []
        assert consumer.wiring.observer is None and consumer.wiring.middleware == ()
        assert consumer.attempts.run == consumer.attempts._run_direct  # no chain at all
        stored = await h.messages("quiet.out")
    assert len(seen) == len(stored) == 1
    for headers in (seen[0], stored[0].headers):
        assert not {"traceparent", "tracestate", "baggage"} & set(headers), headers
    assert [s.name for s in exporter.get_finished_spans()] == ["caller"]  # the application's own span only


def test_the_environment_keeps_an_applications_provider_and_otel_sdk_disabled_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from framework.observability import configure_from_env
    from framework.observability import tracing as framework_tracing

    memory_exporter()  # the application installed its own SDK provider
    for name in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    try:
        monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
        configure_from_env("shop")
        assert not tracing_enabled()
        monkeypatch.delenv("OTEL_SDK_DISABLED")
        configure_from_env("shop")  # no OTEL_* variable: the application's provider is still used
        assert tracing_enabled()
        assert framework_tracing._provider is trace.get_tracer_provider()
    finally:
        disable_tracing()
