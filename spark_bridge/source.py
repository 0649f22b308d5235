"""The ``eventlog`` Spark data source: topics as a streaming or batch table, and the sink back into them.

Each topic partition is one Spark input partition. A streaming query's position lives only in
its checkpoint (``{topic: {partition: {"id": last entry id read, "n": its count}}}``, see
:mod:`spark_bridge.offsets`): the source holds no consumer group and never acknowledges or trims.
``maxEventsPerTrigger`` caps a micro-batch; the reader supports ``Trigger.AvailableNow``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import orjson
import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
    InputPartition,
)
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow
from pyspark.sql.types import StructType

from broker.errors import BrokerUnavailable, ConfigurationError
from broker.redis.keys import KeySpace
from spark_bridge.fetch import EventRange, read_range
from spark_bridge.offsets import (
    Offsets,
    SyncClient,
    cap,
    id_key,
    is_cluster_client,
    limit_by_count,
    load_topics,
    open_client,
    resolve,
)
from spark_bridge.options import ReadOptions, parse_read_options
from spark_bridge.rows import event_schema

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["FORMAT", "EventLogSource", "read_events", "source_with_defaults"]

FORMAT = "eventlog"
"""The name the source is registered under: ``spark.readStream.format("eventlog")``."""


def _url(opts: ReadOptions, defaults: Mapping[str, str]) -> str:
    url = opts.url or defaults.get("url") or os.environ.get("REDIS_URL")
    if not url:
        raise BrokerUnavailable(
            "no broker URL for the eventlog source: call spark_bridge.register(spark) first (it finds or starts "
            "the embedded Valkey), set REDIS_URL, or pass .option('url', 'redis://host:6379/0')"
        )
    return url


class EventLogSource(DataSource):
    """Reads topics (batch and streaming) and writes rows back as events; see the README's "Spark bridge" section."""

    defaults: ClassVar[dict[str, str]] = {}  # url and namespace given to spark_bridge.register()

    @classmethod
    def name(cls) -> str:
        """The format name, ``eventlog``."""
        return FORMAT

    def _read_options(self) -> ReadOptions:
        return parse_read_options(self.options, self.defaults)

    def schema(self) -> StructType:
        """The event columns (plus typed payload columns); checks the topics exist, so a typo fails at load()."""
        opts = self._read_options()
        url = _url(opts, self.defaults)
        client = open_client(url)
        try:
            load_topics(client, opts.namespace, opts.topics, url)
        finally:
            client.close()
        payload = StructType.fromJson(orjson.loads(opts.payload_schema_json)) if opts.payload_schema_json else None
        return event_schema(payload)

    def reader(self, schema: StructType) -> DataSourceReader:
        """Batch reader over retained history (``startingOffsets`` earliest .. ``endingOffsets`` latest)."""
        return EventLogBatchReader(self._read_options(), schema, self.defaults)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        """Streaming reader (``startingOffsets`` default latest, like Spark's Kafka source)."""
        opts = self._read_options()
        if opts.ending is not None:
            raise ConfigurationError(
                "endingOffsets applies to batch reads (spark.read) only; a streaming query runs until stopped, "
                "or use .trigger(availableNow=True) to stop at what is there when it starts"
            )
        return EventLogStreamReader(opts, schema, self.defaults)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        """Batch sink publishing rows as events (``df.write.format("eventlog")``)."""
        from spark_bridge.sink import EventBatchWriter, parse_sink_options

        return EventBatchWriter(parse_sink_options(self.options, self.defaults, schema, streaming=False))

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        """Streaming sink publishing rows as events, idempotent across replayed micro-batches."""
        from spark_bridge.sink import EventStreamWriter, parse_sink_options

        return EventStreamWriter(parse_sink_options(self.options, self.defaults, schema, streaming=True))


def _later(at: dict[str, Any], other: dict[str, Any] | None) -> dict[str, Any]:
    """The later of two positions: a batch never ends before it starts, even if a stream was recreated."""
    return other if other is not None and id_key(other["id"]) > id_key(at["id"]) else at


def source_with_defaults(url: str, namespace: str) -> type[EventLogSource]:
    """A subclass of :class:`EventLogSource` whose options default to ``url`` and ``namespace``."""
    return type("EventLogSource", (EventLogSource,), {"defaults": {"url": url, "namespace": namespace}})


def read_events(
    spark: SparkSession,
    topics: str | Sequence[str],
    *,
    payload: type | None = None,
    stream: bool = True,
    **options: str | int | bool,
) -> DataFrame:
    """Read ``topics`` as a streaming (or, with ``stream=False``, batch) DataFrame.

    With ``payload`` (an attrs class or dataclass) its fields are parsed into typed columns after the
    event columns. Other keyword arguments are source options, e.g. ``startingOffsets="earliest"``.
    """
    from spark_bridge.schema import payload_schema

    reader = spark.readStream if stream else spark.read
    reader = reader.format(FORMAT).option("topics", topics if isinstance(topics, str) else ",".join(topics))
    if payload is not None:
        reader = reader.option("payloadSchema", payload_schema(payload).json())
    for name, value in options.items():
        reader = reader.option(name, str(value).lower() if isinstance(value, bool) else str(value))
    return reader.load()


class _Planner:
    """What both readers share: a driver-side client, the topics' specs, and turning offsets into ranges."""

    def __init__(self, opts: ReadOptions, schema: StructType, defaults: Mapping[str, str]) -> None:
        self.opts = opts
        self.url = _url(opts, defaults)
        self.schema_json = schema.json()
        self._client: SyncClient | None = None
        self.specs = load_topics(self.client, opts.namespace, opts.topics, self.url)

    @property
    def client(self) -> SyncClient:
        if self._client is None:
            self._client = open_client(self.url)
        return self._client

    def __getstate__(self) -> dict[str, Any]:  # Spark pickles the reader to run read(): leave the socket behind
        return {**self.__dict__, "_client": None}

    def resolve(self, position: Any, *, ending: bool) -> Offsets:
        return resolve(self.client, self.specs, self.opts.namespace, position, ending=ending)

    def ranges(self, start: Offsets, end: Offsets) -> list[EventRange]:
        keyspace = KeySpace(self.opts.namespace)
        missing = [t for t in end if t not in start]  # a topic added to the query after it first ran
        if missing:
            earliest = resolve(
                self.client, {t: self.specs[t] for t in missing}, self.opts.namespace, "earliest", ending=False
            )
            start = {**start, **earliest}
        out = []
        for topic, parts in end.items():
            for partition, until in parts.items():
                begin = start.get(topic, {}).get(partition, {"id": "0-0", "n": None})
                if id_key(until["id"]) > id_key(begin["id"]):
                    out.append(
                        EventRange(
                            url=self.url,
                            stream=keyspace.partition(topic, int(partition)).stream,
                            topic=topic,
                            partition=int(partition),
                            after=begin["id"],
                            after_n=begin["n"],
                            until=until["id"],
                            fail_on_data_loss=self.opts.fail_on_data_loss,
                            fetch_size=self.opts.fetch_size,
                            schema_json=self.schema_json,
                            cluster=is_cluster_client(self.client),
                        )
                    )
        return out

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


class EventLogBatchReader(DataSourceReader):
    """Reads the retained events between ``startingOffsets`` and ``endingOffsets`` once."""

    def __init__(self, opts: ReadOptions, schema: StructType, defaults: Mapping[str, str]) -> None:
        self.opts, self.schema, self.defaults = opts, schema, defaults

    def partitions(self) -> Sequence[InputPartition]:
        """One range per topic partition with events in it."""
        planner = _Planner(self.opts, self.schema, self.defaults)
        try:
            start = planner.resolve(self.opts.starting or "earliest", ending=False)
            end = planner.resolve(self.opts.ending or "latest", ending=True)
            return list(planner.ranges(start, end))
        finally:
            planner.close()

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """The events of one range (runs on an executor)."""
        if not isinstance(partition, EventRange):  # Spark's stand-in when partitions() found nothing to read
            return iter(())
        return read_range(partition)


class EventLogStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches of new events; positions are kept by Spark's checkpoint alone."""

    def __init__(self, opts: ReadOptions, schema: StructType, defaults: Mapping[str, str]) -> None:
        self.planner = _Planner(opts, schema, defaults)
        self.opts = opts
        self.target: Offsets | None = None  # set by Trigger.AvailableNow: never read past it

    def initialOffset(self) -> dict:
        """Where a query without a checkpoint starts (``startingOffsets``, default latest)."""
        return self.planner.resolve(self.opts.starting or "latest", ending=False)

    def getDefaultReadLimit(self) -> ReadLimit:
        """``maxEventsPerTrigger`` as a row limit, else everything available."""
        if self.opts.max_events_per_trigger:
            return ReadMaxRows(self.opts.max_events_per_trigger)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        """Remember the newest events now: an availableNow run stops there."""
        self.target = self.planner.resolve("latest", ending=True)

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        """The end of the next micro-batch: the newest ids, capped by availableNow and by the row limit."""
        latest = self.planner.resolve("latest", ending=True)
        if self.target is not None:
            latest = cap(latest, self.target)
        end = {t: {p: _later(at, start.get(t, {}).get(p)) for p, at in parts.items()} for t, parts in latest.items()}
        if isinstance(limit, ReadMaxRows):
            end = limit_by_count(self.planner.client, self.opts.namespace, start, end, limit.max_rows)
        return end

    def reportLatestOffset(self) -> dict | None:
        """The newest ids, so query progress shows how far behind the query is."""
        return self.planner.resolve("latest", ending=True)

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        """One range per topic partition that moved between ``start`` and ``end``."""
        return self.planner.ranges(start, end)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """The events of one range (runs on an executor)."""
        if not isinstance(partition, EventRange):  # Spark's stand-in when partitions() found nothing to read
            return iter(())
        return read_range(partition)

    def commit(self, end: dict) -> None:
        """Nothing to do: the bridge holds no consumer group, and never acknowledges or trims."""

    def stop(self) -> None:
        """Close the driver-side connection."""
        self.planner.close()
