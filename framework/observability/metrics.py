"""Metrics with OpenTelemetry: per-handler counters, durations, lag, dead letters, outbox backlog.

Imported only once metrics are turned on. What each instrument costs per message:

* the message counters (consumed, processed, failed, retried, dead-lettered, duplicates) are
  *observable*: they read the counters every consumer keeps anyway
  (:class:`framework.runtime.ledger.ConsumerStats`) when a reader collects, nothing per message;
* in flight reads the consumers' ledgers when collected;
* ``messaging.process.duration`` and ``framework.message.latency`` are histograms recorded by
  the consumer's observer (:mod:`framework.observability.consumer`) per attempt into the
  framework's own buckets (:mod:`framework.observability.histograms`: a bisect and a few
  additions), handed to the readers when they collect;
* ``messaging.client.sent.messages`` is one ``Counter.add`` per publish call and destination;
* consumer lag and pending (per group and partition) and dead letters are read from Redis by
  :func:`watch_runtime` every :data:`REFRESH_INTERVAL` seconds (not per scrape, not per message),
  the outbox backlog and the age of its oldest row by :func:`watch_relay` likewise.

The names, units and attributes are those of the observability contract (OTel messaging
conventions where they exist); the Prometheus exporter turns ``messaging.client.consumed.messages``
into ``messaging_client_consumed_messages_total``, a unit ``s`` into a ``_seconds`` suffix.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import anyio
from opentelemetry import metrics as otel_metrics
from opentelemetry.metrics import CallbackOptions, Observation

from broker import Envelope
from framework.logs import get_logger
from framework.observability.histograms import BOUNDS, Family, attach

__all__ = [
    "REFRESH_INTERVAL",
    "Instruments",
    "build_provider",
    "consumer_attributes",
    "count_sent",
    "global_sdk_provider",
    "install",
    "instruments",
    "refresh_relay",
    "refresh_runtime",
    "track_runtime",
    "uninstall",
    "watch_relay",
    "watch_runtime",
]

log = get_logger("framework.observability")

REFRESH_INTERVAL = 5.0
"""Seconds between reads of lag, pending, dead letters and the outbox backlog."""

_SCOPE = "framework"
_MESSAGE = "{message}"
_COUNTERS = (  # ConsumerStats field -> instrument, description
    ("fetched", "messaging.client.consumed.messages", "messages delivered to the handler's consumer"),
    ("processed", "framework.messages.processed", "messages processed successfully"),
    ("failed", "framework.messages.failed", "failed handler attempts"),
    ("retried", "framework.messages.retried", "attempts retried (in place or through the retry path)"),
    ("dead_lettered", "framework.messages.dead_lettered", "messages moved to the dead-letter queue"),
    ("duplicates", "framework.messages.duplicates", "duplicate deliveries dropped (inbox)"),
    ("unwanted", "framework.messages.unwanted", "events no handler's filter took (acknowledged, not run)"),
)
_COUNTER_FIELDS = tuple(field for field, _, _ in _COUNTERS)

Key = tuple[str, str, str, str]  # destination, group, service, handler


def consumer_attributes(destination: str, group: str, service: str, handler: str) -> dict[str, str]:
    """The attributes every consumer metric carries."""
    return {
        "messaging.destination.name": destination,
        "messaging.consumer.group.name": group,
        "framework.service": service,
        "framework.handler": handler,
    }


class Instruments:
    """The synchronous instruments (the observable ones read :data:`_registry`)."""

    def __init__(self, meter: Any, provider: Any) -> None:
        self.sent = meter.create_counter(
            "messaging.client.sent.messages", unit=_MESSAGE, description="messages published"
        )
        self.duration = Family("messaging.process.duration", "handler attempts, by outcome")
        self.latency = Family("framework.message.latency", "from publish to the start of the handler's first attempt")
        if not attach(provider, (self.duration, self.latency)):  # not the SDK's provider: its histograms
            for family in (self.duration, self.latency):
                family.sdk = meter.create_histogram(
                    family.name,
                    unit=family.unit,
                    description=family.description,
                    explicit_bucket_boundaries_advisory=BOUNDS,
                )
        for field, name, description in _COUNTERS:
            meter.create_observable_counter(name, [_stat_reader(field)], unit=_MESSAGE, description=description)
        meter.create_observable_up_down_counter(
            "framework.messages.in_flight", [_in_flight], unit=_MESSAGE, description="messages fetched, not settled"
        )
        meter.create_observable_gauge(
            "framework.consumer.lag", [_group_reader(0)], unit=_MESSAGE, description="entries not yet delivered"
        )
        meter.create_observable_gauge(
            "framework.consumer.pending",
            [_group_reader(1)],
            unit=_MESSAGE,
            description="entries delivered and not acknowledged",
        )
        meter.create_observable_gauge(
            "framework.dlq.size", [_dlq_size], unit=_MESSAGE, description="messages in the dead-letter queue"
        )
        meter.create_observable_gauge(
            "framework.outbox.backlog", [_backlog], unit=_MESSAGE, description="outbox rows waiting to be published"
        )
        meter.create_observable_gauge(
            "framework.outbox.oldest_age",
            [_oldest_age],
            unit="s",
            description="age of the oldest outbox row waiting to be published",
        )
        self._sent_attributes: dict[str, dict[str, str]] = {}

    def sent_attributes(self, destination: str) -> dict[str, str]:
        """The attribute set of messages sent to ``destination`` (built once per destination)."""
        found = self._sent_attributes.get(destination)
        if found is None:
            if len(self._sent_attributes) > 10_000:
                self._sent_attributes.clear()
            found = self._sent_attributes[destination] = {
                "messaging.system": "redis",
                "messaging.destination.name": destination,
            }
        return found


_instruments: Instruments | None = None
_provider: Any = None
_owned: Any = None  # a provider this module built (shut down by uninstall's caller)


def instruments() -> Instruments:
    """The instruments in use (metrics must be on)."""
    assert _instruments is not None, "metrics are off"
    return _instruments


def install(provider: Any, *, owned: bool = False) -> None:
    """Create the instruments on ``provider`` (and make it the global one if none is set yet)."""
    global _instruments, _provider, _owned
    if _global_unset():
        otel_metrics.set_meter_provider(provider)
    _provider = provider
    _owned = provider if owned else None
    _instruments = Instruments(provider.get_meter(_SCOPE), provider)


def uninstall() -> Any:
    """Stop recording; return the provider this module built, if any (the caller shuts it down)."""
    global _instruments, _provider, _owned
    owned, _instruments, _provider, _owned = _owned, None, None, None
    return owned


def _global_unset() -> bool:
    try:
        from opentelemetry.metrics import _internal
    except ImportError:  # pragma: no cover
        return False
    return getattr(_internal, "_METER_PROVIDER", object()) is None


def global_sdk_provider() -> Any:
    """The application's global SDK ``MeterProvider``, or None when it installed none."""
    from opentelemetry.sdk.metrics import MeterProvider

    provider = otel_metrics.get_meter_provider()
    return provider if isinstance(provider, MeterProvider) else None


def build_provider(
    service_name: str | None,
    *,
    otlp: bool,
    endpoint: str | None = None,
    prometheus_port: int | None = None,
    prometheus_host: str = "127.0.0.1",
    exporter: str | None = None,
) -> Any:
    """An SDK ``MeterProvider`` with a Prometheus reader (``prometheus_port``: its HTTP server is
    started here, OSError if the port is taken) and/or an OTLP/HTTP periodic reader (``otlp``;
    the interval comes from ``OTEL_METRIC_EXPORT_INTERVAL``, the URL from ``endpoint`` or the
    ``OTEL_EXPORTER_OTLP_(METRICS_)ENDPOINT`` variables)."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader

    from framework.observability.tracing import resource

    readers: list[Any] = []
    if prometheus_port is not None:
        readers.append(_prometheus_reader(prometheus_port, prometheus_host))
    if otlp:
        if exporter == "console":
            readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter()))
        else:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

            url = None
            if endpoint:
                base = endpoint.rstrip("/")
                url = base if base.endswith("/v1/metrics") else base + "/v1/metrics"
            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=url)))
    # shut down by framework.observability.shutdown(), bounded; not again at exit (unbounded)
    return MeterProvider(resource=resource(service_name), metric_readers=readers, shutdown_on_exit=False)


_servers: dict[tuple[str, int], Any] = {}


def _prometheus_reader(port: int, host: str) -> Any:
    """A Prometheus reader whose exposition is served at ``http://host:port/metrics``, other paths 404
    (OSError if the port is taken)."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader

    from framework.observability.exposition import serve_metrics

    if (host, port) not in _servers:
        server = serve_metrics(port, host)  # first: a taken port fails before anything registers
        _servers[(host, port)] = server
    return PrometheusMetricReader()


# -- the registry the observable instruments read --------------------------------------------------------


class _Tracked:
    """One running consumer: its attributes, counters and partitions."""

    __slots__ = ("attributes", "consumer", "key", "partitions", "stats", "views")

    def __init__(self, consumer: Any) -> None:
        handler = consumer.handler
        self.key: Key = (handler.destination.name, handler.service, handler.service, handler.name)
        self.attributes = consumer_attributes(*self.key)
        self.consumer = consumer
        self.stats = consumer.stats
        # every partition of the group, owned here or not: lag and pending describe the group
        views = getattr(consumer, "views", None)
        self.views = list(views) if views is not None else [ledger.view for ledger in consumer.states.values()]
        self.partitions = {
            view.partition: {**self.attributes, "messaging.destination.partition.id": str(view.partition)}
            for view in self.views
        }


_tracked: dict[int, list[_Tracked]] = {}  # id(runtime) -> its consumers
_retired: dict[Key, list[int]] = {}  # counters of consumers that stopped: counters never go down
_attributes: dict[Key, dict[str, str]] = {}
_groups: dict[tuple[Key, int], tuple[int, int]] = {}  # (key, partition) -> (lag, pending)
_group_attributes: dict[tuple[Key, int], dict[str, str]] = {}
_dead: dict[Key, int] = {}
_relays: dict[int, tuple[int, float | None]] = {}  # id(relay) -> (backlog, oldest created_at in Unix seconds)


def track_runtime(runtime: Any) -> None:
    """Count ``runtime``'s consumers in the observable instruments (until :func:`watch_runtime` ends)."""
    tracked = [_Tracked(c) for c in runtime.consumers]
    _tracked[id(runtime)] = tracked
    for t in tracked:
        _attributes[t.key] = t.attributes


def _retire(runtime: Any) -> None:
    for t in _tracked.pop(id(runtime), []):
        totals = _retired.setdefault(t.key, [0] * len(_COUNTER_FIELDS))
        for i, field in enumerate(_COUNTER_FIELDS):
            totals[i] += getattr(t.stats, field)
        _dead.pop(t.key, None)
        for partition in t.partitions:
            _groups.pop((t.key, partition), None)


def _live() -> Iterable[_Tracked]:
    for tracked in list(_tracked.values()):
        yield from tracked


def _stat_reader(field: str) -> Any:
    index = _COUNTER_FIELDS.index(field)

    def observe(options: CallbackOptions) -> list[Observation]:
        totals = {key: values[index] for key, values in list(_retired.items())}  # a scrape runs in another thread
        for t in _live():
            totals[t.key] = totals.get(t.key, 0) + getattr(t.stats, field)
        return [Observation(value, _attributes[key]) for key, value in totals.items()]

    return observe


def _in_flight(options: CallbackOptions) -> list[Observation]:
    totals: dict[Key, int] = {}
    for t in _live():
        totals[t.key] = totals.get(t.key, 0) + t.consumer.in_flight
    return [Observation(value, _attributes[key]) for key, value in totals.items()]


def _group_reader(index: int) -> Any:
    def observe(options: CallbackOptions) -> list[Observation]:
        return [Observation(values[index], _group_attributes[where]) for where, values in list(_groups.items())]

    return observe


def _dlq_size(options: CallbackOptions) -> list[Observation]:
    return [Observation(value, _attributes[key]) for key, value in list(_dead.items())]


def _backlog(options: CallbackOptions) -> list[Observation]:
    relays = list(_relays.values())
    if not relays:
        return []
    return [Observation(sum(backlog for backlog, _ in relays))]


def _oldest_age(options: CallbackOptions) -> list[Observation]:
    relays = list(_relays.values())
    if not relays:
        return []
    oldest = [at for _, at in relays if at is not None]
    return [Observation(max(0.0, time.time() - min(oldest)) if oldest else 0.0)]


# -- what the runtime and the relay call --------------------------------------------------------------


def count_sent(envelopes: Sequence[Envelope]) -> None:
    """Count published messages, one ``add`` per destination of the batch."""
    if _instruments is None:
        return
    add = _instruments.sent.add
    attributes = _instruments.sent_attributes
    if len(envelopes) == 1:
        add(1, attributes(envelopes[0].destination))
        return
    counts: dict[str, int] = {}
    for env in envelopes:
        counts[env.destination] = counts.get(env.destination, 0) + 1
    for destination, count in counts.items():
        add(count, attributes(destination))


async def refresh_runtime(runtime: Any) -> None:
    """Read lag, pending and dead letters of every group and partition ``runtime`` consumes (one
    pass, a few round trips per partition)."""
    from broker.capabilities import as_introspection

    inspect = as_introspection(runtime.broker)  # (the runtime checked it: run_until_idle and these need it)
    for t in _tracked.get(id(runtime), []):
        dead = 0
        for view in t.views:
            state = await inspect.group_state(view)
            where = (t.key, view.partition)
            _group_attributes[where] = t.partitions[view.partition]
            _groups[where] = (state.lag, state.pending)
            dead += state.dead_letters
        _dead[t.key] = dead


async def watch_runtime(runtime: Any) -> None:
    """Refresh ``runtime``'s lag, pending and dead letters every :data:`REFRESH_INTERVAL` seconds
    until cancelled; then keep its counters (they never go down) and drop its gauges."""
    try:
        # the broker unreachable: the connectivity log says so
        await _refresh_forever(refresh_runtime, runtime, "could not read consumer lag for metrics")
    finally:
        _retire(runtime)


async def _refresh_forever(refresh: Any, target: Any, failed: str) -> None:
    """``await refresh(target)`` every :data:`REFRESH_INTERVAL` seconds until cancelled; a failure
    is a debug line (``failed``) and the next round tries again."""
    while True:
        try:
            await refresh(target)
        except Exception as exc:
            log.debug(failed, error=f"{type(exc).__name__}: {exc}")
        await anyio.sleep(REFRESH_INTERVAL)


async def refresh_relay(relay: Any) -> None:
    """Read the outbox backlog (rows waiting, not set aside) and the creation time of the oldest one."""
    from datetime import UTC

    from sqlalchemy import func, select

    from framework.outbox.schema import outbox_table as o

    async with relay.engine.connect() as conn:
        count, oldest = (
            await conn.execute(select(func.count(), func.min(o.c.created_at)).where(o.c.error.is_(None)))
        ).one()
    if oldest is not None and oldest.tzinfo is None:  # SQLite keeps UTC without the zone
        oldest = oldest.replace(tzinfo=UTC)
    _relays[id(relay)] = (int(count), oldest.timestamp() if oldest is not None else None)


async def watch_relay(relay: Any) -> None:
    """Refresh the relay's backlog every :data:`REFRESH_INTERVAL` seconds until cancelled."""
    try:
        # the database unreachable: the relay logs that itself
        await _refresh_forever(refresh_relay, relay, "could not read the outbox backlog for metrics")
    finally:
        _relays.pop(id(relay), None)
