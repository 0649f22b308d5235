"""Metrics on real servers: read back with the OpenTelemetry SDK's in-memory reader, and scraped
from a real ``framework run --metrics-port`` worker in the Prometheus exposition format.

The counters match what the handlers did (processed, failed, retried, dead-lettered, inbox
duplicates, consumed, sent), the histograms recorded every attempt by outcome and every first
attempt's latency, and the lag, pending, in-flight, dead-letter and outbox gauges report what
Redis and the database hold. A bad metrics port or one in use is a one-line error.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client.parser import text_string_to_metric_families

from broker.redis.inspect import group_state
from framework import Client, Context, Queue, RetryPolicy, Runtime, Service, enable_metrics, outbox
from framework.observability import disable_metrics, metrics
from framework.observability.histograms import LocalHistogram
from framework.testing import TEST_SETTINGS, ServiceHarness
from tests.conftest import run_cli

pytestmark = pytest.mark.anyio

HANDLER = {"messaging.consumer.group.name", "messaging.destination.name", "framework.service", "framework.handler"}


@pytest.fixture
def reader(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemoryMetricReader]:
    monkeypatch.setattr(metrics, "REFRESH_INTERVAL", 0.05)  # lag, pending, dead letters, backlog
    memory = InMemoryMetricReader()
    enable_metrics(MeterProvider(metric_readers=[memory]))
    yield memory
    disable_metrics()


def points(reader: InMemoryMetricReader, name: str, **match: Any) -> list[Any]:
    """Data points of metric ``name`` whose attributes include ``match`` (dots as underscores)."""
    wanted = {k.replace("__", "."): v for k, v in match.items()}
    data = reader.get_metrics_data()
    found = []
    for rm in data.resource_metrics if data is not None else []:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name != name:
                    continue
                for point in metric.data.data_points:
                    attributes = dict(point.attributes or {})
                    if all(attributes.get(k) == v for k, v in wanted.items()):
                        found.append(point)
    return found


def value(reader: InMemoryMetricReader, name: str, **match: Any) -> Any:
    """The one data point's value (a sum or gauge), or None when there is none."""
    found = points(reader, name, **match)
    assert len(found) <= 1, found
    return found[0].value if found else None


async def eventually(check: Any, timeout: float = 10.0) -> None:
    """Wait until ``check()`` holds (gauges are refreshed every REFRESH_INTERVAL)."""
    with anyio.fail_after(timeout):
        while not check():
            await anyio.sleep(0.02)


async def test_histograms_are_the_sdks_points_cumulative_or_delta_as_each_reader_asks() -> None:
    """The per-message histograms are kept by the framework and handed to every reader as the
    SDK's explicit-bucket points: right buckets, sum, min and max, per reader temporality."""
    from opentelemetry.sdk.metrics import Histogram
    from opentelemetry.sdk.metrics.export import AggregationTemporality

    delta = InMemoryMetricReader(preferred_temporality={Histogram: AggregationTemporality.DELTA})
    cumulative = InMemoryMetricReader()
    enable_metrics(MeterProvider(metric_readers=[delta, cumulative]))
    try:
        recorder = metrics.instruments().duration.recorder({"framework.handler": "h", "framework.outcome": "success"})
        assert isinstance(recorder, LocalHistogram), "kept by the framework, not recorded through the SDK"
        for seconds in (0.0004, 0.002, 0.002, 7.0):
            recorder.record(seconds)
        [d1] = points(delta, "messaging.process.duration", framework__handler="h")
        [c1] = points(cumulative, "messaging.process.duration", framework__handler="h")
        recorder.record(0.3)
        [d2] = points(delta, "messaging.process.duration", framework__handler="h")
        [c2] = points(cumulative, "messaging.process.duration", framework__handler="h")
    finally:
        disable_metrics()
    for p in (d1, c1):
        assert p.count == 4 and p.sum == pytest.approx(7.0044) and (p.min, p.max) == (0.0004, 7.0)
        assert list(p.explicit_bounds)[:3] == [0.0005, 0.001, 0.0025]
        assert p.bucket_counts[0] == 1 and p.bucket_counts[2] == 2  # (0, 0.5 ms], (1 ms, 2.5 ms]
        assert p.bucket_counts[list(p.explicit_bounds).index(10.0)] == 1  # (5 s, 10 s]
    assert d2.count == 1 and d2.sum == pytest.approx(0.3) and d2.start_time_unix_nano >= d1.time_unix_nano
    assert c2.count == 5 and c2.start_time_unix_nano == c1.start_time_unix_nano


async def test_counters_and_histograms_match_what_the_handlers_did(
    redis_url: str, namespace: str, reader: InMemoryMetricReader
) -> None:
    svc = Service("metered", retry=RetryPolicy(max_attempts=2, immediate=0, backoff=0.02))

    @svc.command(Queue("metered.work"))
    async def work(job: dict, ctx: Context) -> None:
        if job["case"] == "flaky" and ctx.attempt == 1:
            raise ConnectionError("once")
        if job["case"] == "bad":
            raise ValueError("never")

    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as h:
        for n in range(3):
            await h.client.send(
                "metered.work", {"case": "ok", "n": n}, message_id=f"0190bbbb-0000-7000-8000-00000000000{n}"
            )
        await h.client.send("metered.work", {"case": "flaky"})
        await h.client.send("metered.work", {"case": "bad"})
        await h.run_until_idle()
        await h.client.send("metered.work", {"case": "ok"}, message_id="0190bbbb-0000-7000-8000-000000000000")
        await h.run_until_idle()
        stats = h.stats()["metered.work"]
        mine = {"messaging__destination__name": "metered.work", "framework__handler": "work"}
        await eventually(lambda: value(reader, "framework.dlq.size", **mine) == 1)
        # after the runtime stopped, counters keep their totals
    assert (stats["processed"], stats["failed"], stats["retried"]) == (4, 3, 2)
    assert (stats["dead_lettered"], stats["duplicates"], stats["fetched"]) == (1, 1, 8)
    expected = {
        "messaging.client.consumed.messages": 8,  # 5 first deliveries, 2 retries, 1 duplicate
        "framework.messages.processed": 4,
        "framework.messages.failed": 3,
        "framework.messages.retried": 2,
        "framework.messages.dead_lettered": 1,
        "framework.messages.duplicates": 1,
    }
    assert {name: value(reader, name, **mine) for name in expected} == expected
    [point] = points(reader, "framework.messages.processed", **mine)
    assert set(point.attributes) == HANDLER
    assert dict(point.attributes)["messaging.consumer.group.name"] == "metered"
    assert value(reader, "messaging.client.sent.messages", messaging__destination__name="metered.work") == 6

    durations = {
        dict(p.attributes)["framework.outcome"]: p for p in points(reader, "messaging.process.duration", **mine)
    }
    assert {k: p.count for k, p in durations.items()} == {"success": 4, "retry": 2, "dead_letter": 1}
    assert all(p.sum > 0 for p in durations.values())
    [latency] = points(reader, "framework.message.latency", **mine)
    assert latency.count == 5  # first attempts only; the duplicate never ran
    assert 0 <= latency.sum < 30


async def test_lag_pending_and_in_flight_report_what_redis_holds(
    redis_url: str, namespace: str, reader: InMemoryMetricReader
) -> None:
    svc = Service("lagging")
    release = anyio.Event()

    @svc.command(Queue("lagging.work"))
    async def work(job: dict) -> None:
        await release.wait()

    settings = attrs.evolve(TEST_SETTINGS, prefetch=2)
    mine = {"messaging__destination__name": "lagging.work", "messaging__destination__partition__id": "0"}
    async with ServiceHarness([], url=redis_url, namespace=namespace) as h:
        runtime = Runtime([svc], broker=h.broker, settings=settings)
        async with anyio.create_task_group() as tg:
            await tg.start(runtime.run)
            await h.client.send_many("lagging.work", [{"n": n} for n in range(20)])
            [ledger] = runtime.consumers[0].states.values()

            async def truth() -> tuple[int, int]:
                state = await group_state(h.broker, ledger.view)
                return state.lag, state.pending

            await eventually(lambda: runtime.in_flight > 0)
            await anyio.sleep(0.1)  # the fetcher is at its limit: nothing moves while the handlers wait
            lag, pending = await truth()
            assert lag > 0 and pending > 0 and lag + pending == 20
            await eventually(
                lambda: (
                    (
                        value(reader, "framework.consumer.lag", **mine),
                        value(reader, "framework.consumer.pending", **mine),
                    )
                    == (lag, pending)
                )
            )
            in_flight = value(reader, "framework.messages.in_flight", messaging__destination__name="lagging.work")
            assert in_flight == runtime.in_flight == pending
            release.set()
            await runtime.wait_idle()
            assert await truth() == (0, 0)
            await eventually(lambda: value(reader, "framework.consumer.lag", **mine) == 0)
            await eventually(lambda: value(reader, "framework.consumer.pending", **mine) == 0)
            assert value(reader, "framework.messages.in_flight", messaging__destination__name="lagging.work") == 0
            runtime.stop()
    # a stopped runtime's gauges are gone (its counters stay)
    assert value(reader, "framework.consumer.lag", **mine) is None
    assert value(reader, "framework.messages.processed", messaging__destination__name="lagging.work") == 20


async def test_the_outbox_backlog_and_its_oldest_age(
    redis_url: str, namespace: str, tmp_path: Path, reader: InMemoryMetricReader
) -> None:
    engine = outbox.create_engine(f"sqlite:///{tmp_path / 'outbox.db'}")
    await outbox.create_tables(engine)
    async with engine.begin() as conn:
        for n in range(3):
            await outbox.add_event(conn, "backlog.events", {"n": n})
    async with ServiceHarness([], url=redis_url, namespace=namespace) as h:
        relay = outbox.OutboxRelay(engine, h.broker)
        await metrics.refresh_relay(relay)  # what the relay's watcher reads every few seconds
        assert value(reader, "framework.outbox.backlog") == 3
        age = value(reader, "framework.outbox.oldest_age")
        assert 0 <= age < 30
        await anyio.sleep(0.05)
        assert value(reader, "framework.outbox.oldest_age") > age  # measured when collected
        async with anyio.create_task_group() as tg:
            await tg.start(relay.run)  # publishes the rows; its watcher sees the backlog drain
            await eventually(lambda: value(reader, "framework.outbox.backlog") == 0)
            assert value(reader, "framework.outbox.oldest_age") == 0
            relay.stop()
        assert len(await h.messages("backlog.events")) == 3
    assert value(reader, "messaging.client.sent.messages", messaging__destination__name="backlog.events") == 3
    await engine.dispose()


# -- the Prometheus endpoint of `framework run` ----------------------------------------------------------

CONTRACT = {  # Prometheus name -> type, as opentelemetry-exporter-prometheus exposes them
    "messaging_client_consumed_messages": "counter",
    "messaging_client_sent_messages": "counter",
    "messaging_process_duration_seconds": "histogram",
    "framework_messages_processed": "counter",
    "framework_messages_failed": "counter",
    "framework_messages_retried": "counter",
    "framework_messages_dead_lettered": "counter",
    "framework_messages_duplicates": "counter",
    "framework_message_latency_seconds": "histogram",
    "framework_messages_in_flight": "gauge",
    "framework_consumer_lag": "gauge",
    "framework_consumer_pending": "gauge",
    "framework_dlq_size": "gauge",
    "framework_outbox_backlog": "gauge",
    "framework_outbox_oldest_age_seconds": "gauge",
}

APP = """
from framework import Context, Queue, RetryPolicy, Service

shop = Service("promshop", retry=RetryPolicy(max_attempts=1))


@shop.command(Queue("promshop.orders"))
async def take(order: dict, ctx: Context) -> None:
    if order.get("bad"):
        raise ValueError("refused")
    ctx.publish("promshop.taken", order)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        return str(response.read().decode())


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}  # the parser rejects malformed text


@pytest.fixture
def app_env(worker_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    (tmp_path / "promapp.py").write_text(textwrap.dedent(APP))
    env = dict(worker_env)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    for name in [k for k in env if k.startswith("OTEL_") or k.startswith("FRAMEWORK_METRICS")]:
        del env[name]
    return env


def test_framework_run_serves_every_contract_metric_in_the_exposition_format(
    app_env: dict[str, str], redis_url: str, namespace: str, tmp_path: Path
) -> None:
    port = _free_port()
    log = open(tmp_path / "worker.log", "wb")  # noqa: SIM115 - closed below
    command = ["run", "promapp:shop", "--metrics-port", str(port), "--outbox-relay", f"sqlite:///{tmp_path / 'o.db'}"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "framework", *command],
        env=app_env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    try:

        async def publish() -> None:
            async with Client(redis_url, namespace=namespace) as c:
                for n in range(5):
                    await c.send("promshop.orders", {"n": n})
                await c.send("promshop.orders", {"bad": True})

        deadline = time.monotonic() + 30
        families: dict[str, Any] = {}
        sent = False
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "worker.log").read_text()
            try:
                families = _families(_scrape(port))
            except OSError:
                time.sleep(0.1)
                continue
            if not sent and "framework_consumer_lag" in families:  # subscribed: the group exists
                anyio.run(publish)
                sent = True
            processed = families.get("framework_messages_processed")
            dead = families.get("framework_messages_dead_lettered")
            if (
                processed is not None
                and dead is not None
                and sum(s.value for s in processed.samples if s.name.endswith("_total")) == 5
                and sum(s.value for s in dead.samples if s.name.endswith("_total")) == 1
                and "framework_outbox_backlog" in families
                and sum(s.value for s in families["framework_dlq_size"].samples) == 1
            ):
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"metrics never showed the work: {sorted(families)}")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    assert proc.returncode == 0, (tmp_path / "worker.log").read_text()

    missing = {name: kind for name, kind in CONTRACT.items() if getattr(families.get(name), "type", None) != kind}
    assert missing == {}, sorted(families)
    [processed] = [s for s in families["framework_messages_processed"].samples if s.name.endswith("_total")]
    assert processed.name == "framework_messages_processed_total"
    assert processed.labels["messaging_destination_name"] == "promshop.orders"
    assert processed.labels["messaging_consumer_group_name"] == "promshop"
    assert processed.labels["framework_service"] == "promshop" and processed.labels["framework_handler"] == "take"
    buckets = [s for s in families["messaging_process_duration_seconds"].samples if s.name.endswith("_bucket")]
    assert {s.labels["framework_outcome"] for s in buckets} == {"success", "dead_letter"}
    sent_total = [s for s in families["messaging_client_sent_messages"].samples if s.name.endswith("_total")]
    assert {s.labels["messaging_destination_name"]: s.value for s in sent_total} == {"promshop.taken": 5}
    lag = families["framework_consumer_lag"].samples
    assert [s.labels["messaging_destination_partition_id"] for s in lag] == ["0"]


def test_a_bad_or_taken_metrics_port_is_a_one_line_error(app_env: dict[str, str], tmp_path: Path) -> None:
    for args, env, message, status in [
        (["--metrics-port", "0"], {}, "a port number is 1 to 65535, got 0", 2),
        (["--metrics-port", "http"], {}, "expected a port number (1-65535), got 'http'", 2),
        ([], {"FRAMEWORK_METRICS_PORT": "99999"}, "FRAMEWORK_METRICS_PORT: a port number is 1 to 65535", 2),
    ]:
        out = run_cli("run", "promapp:shop", *args, env={**app_env, **env, "PYTHONPATH": app_env["PYTHONPATH"]})
        assert out.returncode == status, out.stderr
        assert message in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "framework", "run", "promapp:shop", "--metrics-port", str(port)],
            env=app_env,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )
    assert out.returncode == 1, out.stderr
    errors = [line for line in out.stderr.strip().splitlines() if "framework run:" in line]
    assert errors == [
        f"framework run: metrics port {port} on 127.0.0.1 is in use (--metrics-port / FRAMEWORK_METRICS_PORT)"
    ]
    assert "Traceback" not in out.stderr
