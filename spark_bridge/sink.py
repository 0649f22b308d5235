"""The ``eventlog`` sink: rows a Spark query computes, published as events, once per row.

Each row becomes one event on its topic. Its id is derived (:func:`broker.ids.derive_id`) and it
is published with that id as its idempotency key, through the broker's own publish path
(:meth:`broker.redis.RedisBroker.publish` with the sink's ``dedupWindowMs``; topics the sink has not
seen are routed with :meth:`~broker.redis.RedisBroker.route`, declared with option ``partitions`` when
new):

* with option ``idColumn`` (required for batch writes), from that column's value, namespaced by
  option ``sinkId`` (default ``eventlog:<topic>``): writing the same values again publishes
  nothing new, and new values are always published, whichever run writes them;
* otherwise (streaming only), from the query id (kept in the checkpoint), the micro-batch id and
  the row's task partition and index: a micro-batch that Spark replays after a crash re-publishes
  the same ids, and the server drops them. A new checkpoint is a new query id, hence new ids.

Nothing is dropped silently: each writer's ``commit()`` (on the driver) logs, on logger
``spark_bridge``, how many rows were published and how many were dropped as duplicates; a batch
write that hit duplicates logs a warning.

Columns read from each row (all optional except as noted)::

    payload   the body: JSON text, or a struct/map/array (serialised to JSON); without this
              column every other non-reserved column goes into a JSON object body
    type      event type (else option ``type``; one of them is required)
    key       partition/ordering key
    headers   map<string,string> of extra headers
    topic     destination (else option ``topic``; one of them is required)
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
import os
from collections.abc import Iterator, Mapping
from decimal import Decimal
from typing import Any

import orjson
from opentelemetry import propagate, trace
from pyspark import TaskContext
from pyspark.sql import Row
from pyspark.sql.datasource import DataSourceStreamWriter, DataSourceWriter, WriterCommitMessage
from pyspark.sql.types import StructType

from broker.connect import connect, default_namespace
from broker.envelope import EVENT, Envelope
from broker.errors import ConfigurationError
from broker.headers import IDEMPOTENCY_KEY
from broker.ids import derive_id
from broker.protocol import Broker
from broker.topology import validate_name

__all__ = ["EventBatchWriter", "EventStreamWriter", "SinkCommit", "SinkSettings", "parse_sink_options"]

_RESERVED = ("payload", "type", "key", "headers", "topic")
_SINK_OPTIONS = (
    "topic",
    "type",
    "idcolumn",
    "sinkid",
    "partitions",
    "dedupwindowms",
    "namespace",
    "url",
    "checkpointlocation",
    "path",
    "queryname",
)
_FLUSH = 500  # rows per publish call (one pipeline round trip)

log = logging.getLogger("spark_bridge")


@dataclasses.dataclass(frozen=True)
class SinkSettings:
    """Checked sink options (picklable: shipped to every task)."""

    url: str = dataclasses.field(repr=False)  # may carry a password: never printed
    namespace: str
    topic: str | None
    type: str | None
    id_column: str | None
    sink_id: str | None
    partitions: int
    dedup_window_ms: int
    columns: tuple[str, ...]
    streaming: bool


@dataclasses.dataclass
class SinkCommit(WriterCommitMessage):
    """What one task published: new events, and rows the server dropped as duplicates (ids seen in the window)."""

    published: int
    duplicates: int


def parse_sink_options(
    options: Mapping[str, str], defaults: Mapping[str, str], schema: StructType, *, streaming: bool
) -> SinkSettings:
    """Check the sink's options against the DataFrame's columns; raise saying what to fix."""
    merged = {k.lower(): v for k, v in defaults.items()}
    merged.update({k.lower(): v for k, v in options.items()})
    unknown = sorted(k for k in merged if k not in _SINK_OPTIONS)
    if unknown:
        raise ConfigurationError(
            f"unknown option(s) {', '.join(unknown)} for the eventlog sink; known: topic, type, idColumn, sinkId, "
            "partitions, dedupWindowMs, namespace, url"
        )
    columns = tuple(schema.fieldNames())
    topic = merged.get("topic")
    if topic:
        validate_name("topic", topic)
    elif "topic" not in columns:
        raise ConfigurationError(
            'the eventlog sink needs option topic, e.g. .option("topic", "orders.enriched"), or a topic column'
        )
    if not merged.get("type") and "type" not in columns:
        raise ConfigurationError(
            'the eventlog sink needs option type (e.g. .option("type", "OrderEnriched")) or a type column'
        )
    id_column = merged.get("idcolumn")
    if id_column and id_column not in columns:
        raise ConfigurationError(f"option idColumn={id_column!r}: no such column; columns: {', '.join(columns)}")
    if not streaming and not id_column:
        raise ConfigurationError(
            "a batch write to the eventlog sink needs option idColumn, a column identifying each row (a business "
            "id, or a hash of the row's content such as sha2(to_json(struct(*)), 256)): event ids derive from it, "
            "so that writing the same rows again publishes nothing new and new rows are never dropped"
        )
    if merged.get("sinkid") and not id_column:
        raise ConfigurationError(
            "option sinkId only namespaces the ids derived from idColumn; without idColumn a streaming query's "
            "ids derive from its query id (kept in the checkpoint): set idColumn or remove sinkId"
        )
    url = merged.get("url") or os.environ.get("REDIS_URL")
    if not url:
        raise ConfigurationError(
            "no broker URL for the eventlog sink: call spark_bridge.register(spark) or set option url"
        )
    partitions = int(merged.get("partitions", "1"))
    return SinkSettings(
        url=url,
        namespace=merged.get("namespace") or default_namespace(),
        topic=topic,
        type=merged.get("type"),
        id_column=id_column,
        sink_id=merged.get("sinkid"),
        partitions=partitions,
        dedup_window_ms=int(merged.get("dedupwindowms", str(24 * 3600 * 1000))),
        columns=columns,
        streaming=streaming,
    )


def _jsonable(value: Any) -> Any:
    if isinstance(value, Row):
        return {k: _jsonable(v) for k, v in value.asDict(recursive=False).items()}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dt.datetime) and value.tzinfo is None:
        return value.astimezone(dt.UTC)  # Spark hands timestamps over as naive local time
    if isinstance(value, Decimal):
        return str(value)
    return value


class _Publisher:
    """Publishes the rows of one task through the broker's publish path, on an event loop of its own."""

    def __init__(self, settings: SinkSettings) -> None:
        self.s = settings
        self.routed: set[str] = set()
        self.published = self.duplicates = 0

    def envelope(self, row: Row, parent: str, salt: str) -> Envelope:
        values = row.asDict(recursive=False)
        topic = self.s.topic or values.get("topic")
        if not topic:
            raise ValueError(f"a row has no topic (column topic is null and option topic is not set): {row!r}")
        event_type = values.get("type") or self.s.type
        if not event_type:
            raise ValueError(f"a row has no type (column type is null and option type is not set): {row!r}")
        if "payload" in values:
            raw = values["payload"]
            body = (
                raw.encode()
                if isinstance(raw, str)
                else bytes(raw)
                if isinstance(raw, bytes | bytearray)
                else orjson.dumps(_jsonable(raw))
            )
        else:
            body = orjson.dumps({k: _jsonable(v) for k, v in values.items() if k not in _RESERVED})
        if self.s.id_column is not None:
            row_id = values[self.s.id_column]
            if row_id is None:  # str(None) would give every such row the same id, and drop all but one
                raise ValueError(f"a row's idColumn {self.s.id_column!r} is null; every row needs an id: {row!r}")
            parent, salt = self.s.sink_id or f"eventlog:{topic}", str(row_id)
        event_id = derive_id(parent, salt)
        headers = {str(k): str(v) for k, v in (values.get("headers") or {}).items()}
        headers[IDEMPOTENCY_KEY] = event_id
        key = values.get("key")
        return Envelope(
            destination=topic,
            kind=EVENT,
            type=str(event_type),
            body=body,
            key=None if key is None else str(key),
            headers=headers,
            id=event_id,
        )

    async def flush(self, broker: Broker, envelopes: list[Envelope]) -> None:
        if not envelopes:
            return
        for topic in dict.fromkeys(env.destination for env in envelopes):
            if topic not in self.routed:  # declared with the sink's partitions when new; a queue is refused
                await broker.route(validate_name("topic", topic), EVENT, partitions=self.s.partitions)
                self.routed.add(topic)
        spans = _producer_spans(envelopes)
        try:
            entries = await broker.publish(envelopes, dedup_window_ms=self.s.dedup_window_ms)
        finally:
            for span in spans:
                span.end()
        for entry in entries:
            if entry is None:
                self.duplicates += 1
            else:
                self.published += 1
        envelopes.clear()

    def run(self, rows: Iterator[Row], parent: str, partition_id: int) -> SinkCommit:
        """Publish every row (Spark calls tasks on plain threads: no event loop is running here)."""
        return asyncio.run(self._run(rows, parent, partition_id))

    async def _run(self, rows: Iterator[Row], parent: str, partition_id: int) -> SinkCommit:
        broker = await connect(self.s.url, namespace=self.s.namespace)
        pending: list[Envelope] = []
        try:
            for index, row in enumerate(rows):
                pending.append(self.envelope(row, parent, f"{partition_id}/{index}"))
                if len(pending) >= _FLUSH:
                    await self.flush(broker, pending)
            await self.flush(broker, pending)
        finally:
            await broker.close()
        return SinkCommit(published=self.published, duplicates=self.duplicates)


def _producer_spans(envelopes: list[Envelope]) -> list[Any]:
    """A PRODUCER span ``send <topic>`` per event, its W3C context written into the headers, when
    the Spark worker process has an OpenTelemetry SDK tracer provider (an application sets it up,
    say in its ``sitecustomize``); nothing at all otherwise (one check per flush, no headers)."""
    if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return []
    tracer = trace.get_tracer("spark_bridge")
    spans = []
    for env in envelopes:
        span = tracer.start_span(
            f"send {env.destination}",
            kind=trace.SpanKind.PRODUCER,
            attributes={
                "messaging.system": "redis",
                "messaging.destination.name": env.destination,
                "messaging.operation.type": "send",
                "messaging.operation.name": "send",
                "messaging.message.id": env.id,
            },
        )
        propagate.inject(env.headers, trace.set_span_in_context(span))
        spans.append(span)
    return spans


def _totals(messages: list[WriterCommitMessage | None]) -> tuple[int, int]:
    commits = [m for m in messages if isinstance(m, SinkCommit)]
    return sum(m.published for m in commits), sum(m.duplicates for m in commits)


class EventStreamWriter(DataSourceStreamWriter):
    """Streaming sink: ids derive from ``idColumn`` (and ``sinkId``), else from (query id, batch id, partition, row)."""

    def __init__(self, settings: SinkSettings) -> None:
        self.settings = settings

    def write(self, iterator: Iterator[Row]) -> SinkCommit:
        """Publish this task's rows; rows of a replayed batch get the same ids and are dropped as duplicates."""
        ctx = TaskContext.get()
        assert ctx is not None
        query, batch = ctx.getLocalProperty("sql.streaming.queryId"), ctx.getLocalProperty("streaming.sql.batchId")
        if self.settings.id_column is None and not (query and batch):
            raise RuntimeError(f"the eventlog sink found no streaming query id ({query!r}) or batch id ({batch!r})")
        return _Publisher(self.settings).run(iterator, f"{query}/{batch}", ctx.partitionId())

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Log what the batch published: its events are already on their topics."""
        published, duplicates = _totals(messages)
        if duplicates:
            log.info(
                "eventlog sink, micro-batch %d: published %d event(s); %d row(s) dropped as duplicates (their ids "
                "were published before within dedupWindowMs: a replayed micro-batch%s)",
                batchId,
                published,
                duplicates,
                ", or idColumn values written again" if self.settings.id_column else "",
            )
        else:
            log.info("eventlog sink, micro-batch %d: published %d event(s)", batchId, published)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Published events stay; Spark replays the batch and the replay's copies are dropped."""


class EventBatchWriter(DataSourceWriter):
    """Batch sink: ids derive from ``idColumn`` (required), namespaced by ``sinkId``."""

    def __init__(self, settings: SinkSettings) -> None:
        self.settings = settings

    def write(self, iterator: Iterator[Row]) -> SinkCommit:
        """Publish this task's rows; a retried task re-publishes the same ids, which are dropped."""
        ctx = TaskContext.get()
        assert ctx is not None
        return _Publisher(self.settings).run(iterator, "", ctx.partitionId())  # ids come from idColumn only

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        """Log what the write published; warn when rows were dropped as duplicates."""
        published, duplicates = _totals(messages)
        if duplicates:
            log.warning(
                "eventlog sink: published %d event(s); %d row(s) NOT published: their ids were published before "
                "within dedupWindowMs (the same idColumn %r values written again, by an earlier write, a retried "
                "task, or twice in this one)",
                published,
                duplicates,
                self.settings.id_column,
            )
        else:
            log.info("eventlog sink: published %d event(s)", published)
