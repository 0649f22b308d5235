"""Over the wire: a worker configured only by OTEL_* variables exports spans and metrics over OTLP/HTTP.

Each test runs a real ``framework run`` worker subprocess (tests/apps/obsapp.py: ``obs.work`` ->
``obs.done`` across two handlers, one handler that retries once, one that dead-letters) whose only
observability setting is its environment, and a real OTLP/HTTP receiver in the test process
(tests/otlp_receiver.py) that decodes what arrives with ``opentelemetry-proto``. The test publishes
with a ``traceparent`` of its own making, so the received spans must continue that very trace.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from broker.headers import TRACEPARENT
from broker.redis import RedisBroker
from broker.redis.inspect import stored_messages
from framework import Client
from tests.otlp_receiver import CONSUMER, ERROR, PRODUCER, OTLPReceiver, Span
from tests.workers import Workers

DESTINATIONS = ("obs.work", "obs.flaky", "obs.rejected", "obs.done")


@pytest.fixture
def receiver() -> Iterator[OTLPReceiver]:
    with OTLPReceiver() as r:
        yield r


def _env(worker_env: dict[str, str], receiver: OTLPReceiver, **extra: str) -> dict[str, str]:
    """The worker's environment: the OTLP endpoint and short export intervals, nothing else of OTel."""
    env = {k: v for k, v in worker_env.items() if not k.startswith(("OTEL_", "FRAMEWORK_METRICS_"))}
    env.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
        OTEL_SERVICE_NAME="obs-wire",
        OTEL_METRIC_EXPORT_INTERVAL="300",  # ms
        OTEL_BSP_SCHEDULE_DELAY="100",  # ms
        **extra,
    )
    return env


async def _started(broker: RedisBroker) -> None:
    """Wait until the worker declared its destinations (publishing needs them to exist)."""
    with anyio.fail_after(30):
        while any([await broker.get_destination(d) is None for d in DESTINATIONS]):
            await anyio.sleep(0.05)


async def _done_messages(broker: RedisBroker, count: int) -> list:
    """The messages the worker published to ``obs.done``, once there are ``count``."""
    with anyio.fail_after(30):
        while True:
            spec = await broker.get_destination("obs.done")
            stored = await stored_messages(broker, spec) if spec is not None else []
            if len(stored) >= count:
                return stored
            await anyio.sleep(0.05)


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _in_trace(receiver: OTLPReceiver, trace_id: str) -> list[Span]:
    return [s for s in receiver.spans() if s.trace_id == trace_id]


@pytest.mark.anyio
@pytest.mark.slow
async def test_spans_and_metrics_reach_an_otlp_receiver_from_the_environment_alone(
    worker_env: dict[str, str], tmp_path: Path, receiver: OTLPReceiver, broker: RedisBroker, namespace: str
) -> None:
    workers = Workers(_env(worker_env, receiver, OTEL_EXPORTER_OTLP_COMPRESSION="gzip"), tmp_path)
    try:
        workers.start("obsapp", "wire-1")  # both services: observed and notifier
        await _started(broker)
        work_tp, work_trace, caller_span = _traceparent()
        flaky_tp, flaky_trace, _ = _traceparent()
        rejected_tp, rejected_trace, _ = _traceparent()
        async with Client(broker=broker) as client:
            work_id = await client.send("obs.work", {"n": 1}, headers={TRACEPARENT: work_tp})
            await client.send("obs.flaky", {"n": 2}, headers={TRACEPARENT: flaky_tp})
            await client.send("obs.rejected", {"n": 3}, headers={TRACEPARENT: rejected_tp})

        def complete(r: OTLPReceiver) -> bool:
            processed = {
                p.attributes["framework.handler"]
                for p in r.points()
                if p.name == "framework.messages.processed" and p.value >= 1
            }
            return (
                len(_in_trace(r, work_trace)) >= 3
                and len(_in_trace(r, flaky_trace)) >= 2
                and len(_in_trace(r, rejected_trace)) >= 1
                and {"work", "flaky", "notify"} <= processed  # an export after the messages were processed
                and any(p.name == "messaging.process.duration" for p in r.points())
            )

        await anyio.to_thread.run_sync(receiver.wait_for, complete, 30, "the worker's spans and metrics")
        [done] = await _done_messages(broker, 1)
    finally:
        workers.stop_all()
    log = workers.log("wire-1")
    assert receiver.rejected == [], log[-2000:]
    assert set(receiver.encodings) == {"gzip"}  # OTEL_EXPORTER_OTLP_COMPRESSION was honoured

    # one trace: the caller's span -> process obs.work -> send obs.done -> process obs.done
    spans = _in_trace(receiver, work_trace)
    assert {s.resource["service.name"] for s in spans} == {"obs-wire"}
    [consume] = [s for s in spans if s.name == "process obs.work"]
    [produce] = [s for s in spans if s.name == "send obs.done"]
    [downstream] = [s for s in spans if s.name == "process obs.done"]
    assert consume.kind == CONSUMER and downstream.kind == CONSUMER and produce.kind == PRODUCER
    assert consume.parent_span_id == caller_span
    assert produce.parent_span_id == consume.span_id
    assert downstream.parent_span_id == produce.span_id
    assert consume.attributes["messaging.system"] == "redis"
    assert consume.attributes["messaging.destination.name"] == "obs.work"
    assert consume.attributes["messaging.operation.type"] == "process"
    assert consume.attributes["messaging.message.id"] == work_id
    assert consume.attributes["messaging.consumer.group.name"] == "observed"
    assert consume.attributes["messaging.destination.partition.id"] in ("0", "1")
    assert consume.attributes["messaging.message.body.size"] > 0
    assert consume.attributes["framework.handler"] == "work"
    assert consume.attributes["framework.attempt"] == 1
    assert consume.attributes["framework.outcome"] == "success"
    assert downstream.attributes["messaging.consumer.group.name"] == "notifier"
    # the message on the stream carries the PRODUCER span's context
    assert done.headers[TRACEPARENT].split("-")[1:3] == [work_trace, produce.span_id]

    # a retry: two attempts on the same trace, the first with the retry event
    attempts = sorted(_in_trace(receiver, flaky_trace), key=lambda s: s.attributes["framework.attempt"])
    assert [s.attributes["framework.outcome"] for s in attempts] == ["retry", "success"]
    assert [name for name, _ in attempts[0].events if name == "retry"] == ["retry"]
    assert any(name == "exception" and "TimeoutError" in str(a) for name, a in attempts[0].events)

    # a dead letter: the event with its reason, the span failed
    [dead] = _in_trace(receiver, rejected_trace)
    assert dead.attributes["framework.outcome"] == "dead_letter" and dead.status == ERROR
    [(_, reason)] = [(n, a) for n, a in dead.events if n == "dead_letter"]
    assert "Rejected" in reason["framework.dead_letter.reason"]

    # metrics: the same resource, per-handler attributes, real values
    points = receiver.points()
    assert {p.resource["service.name"] for p in points} == {"obs-wire"}
    processed = [p for p in points if p.name == "framework.messages.processed"]
    assert max(p.value for p in processed if p.attributes["framework.handler"] == "work") >= 1
    assert {p.attributes["messaging.destination.name"] for p in processed} >= {"obs.work", "obs.flaky", "obs.done"}
    durations = [p for p in points if p.name == "messaging.process.duration"]
    assert durations and {p.kind for p in durations} == {"histogram"} and {p.unit for p in durations} == {"s"}
    assert {p.attributes["framework.outcome"] for p in durations} >= {"success", "retry", "dead_letter"}


@pytest.mark.anyio
@pytest.mark.slow
async def test_metrics_exporter_none_keeps_spans_and_sends_no_metrics(
    worker_env: dict[str, str], tmp_path: Path, receiver: OTLPReceiver, broker: RedisBroker
) -> None:
    """What compose.yaml relies on: traces over OTLP, metrics only on the Prometheus endpoint."""
    workers = Workers(_env(worker_env, receiver, OTEL_METRICS_EXPORTER="none"), tmp_path)
    try:
        workers.start("obsapp", "wire-2")  # both services: observed and notifier
        await _started(broker)
        traceparent, trace_id, _ = _traceparent()
        async with Client(broker=broker) as client:
            await client.send("obs.work", {"n": 1}, headers={TRACEPARENT: traceparent})
        await anyio.to_thread.run_sync(
            receiver.wait_for, lambda r: len(_in_trace(r, trace_id)) >= 3, 30, "the worker's spans"
        )
        await anyio.sleep(1.0)  # three metric export intervals
    finally:
        workers.stop_all()
    assert receiver.points() == []


@pytest.mark.anyio
@pytest.mark.slow
async def test_sdk_disabled_sends_nothing_and_adds_no_headers(
    worker_env: dict[str, str], tmp_path: Path, receiver: OTLPReceiver, broker: RedisBroker
) -> None:
    workers = Workers(_env(worker_env, receiver, OTEL_SDK_DISABLED="true"), tmp_path)
    try:
        workers.start("obsapp", "wire-3")  # both services: observed and notifier
        await _started(broker)
        async with Client(broker=broker) as client:
            await client.send("obs.work", {"n": 1})
            await client.send("obs.rejected", {"n": 2})
        [done] = await _done_messages(broker, 1)  # processed: the handler published
        await anyio.sleep(1.5)  # many span schedule delays and metric export intervals
    finally:
        workers.stop_all()
    assert receiver.requests == [] and receiver.rejected == []
    assert not {TRACEPARENT, "tracestate", "baggage"} & set(done.headers)


def test_the_receiver_rejects_what_is_not_otlp() -> None:
    """The receiver is strict, so a test cannot pass on requests it misread."""
    import gzip
    import urllib.error
    import urllib.request

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    def post(url: str, body: bytes, **headers: str) -> int:
        request = urllib.request.Request(url, data=body, method="POST", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code

    with OTLPReceiver() as r:
        empty = ExportTraceServiceRequest().SerializeToString()
        assert post(r.endpoint + "/v1/traces", gzip.compress(empty), **{"Content-Encoding": "gzip"}) == 200
        assert post(r.endpoint + "/v1/nothing", empty) == 404
        assert post(r.endpoint + "/v1/traces", b"\xff\xff\xff", **{"Content-Type": "application/x-protobuf"}) == 400
        assert post(r.endpoint + "/v1/traces", b"not gzip", **{"Content-Encoding": "gzip"}) == 400
    assert len(r.requests) == 1 and r.encodings == ["gzip"]
    assert r.rejected == [("/v1/nothing", 404), ("/v1/traces", 400), ("/v1/traces", 400)]
