"""The eventlog sink: rows published as events, once each, even when Spark replays a batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from pyspark.sql import functions as F

from broker.codec import decode_fields
from broker.errors import ConfigurationError
from broker.headers import IDEMPOTENCY_KEY
from broker.ids import derive_id
from broker.redis.keys import KeySpace
from broker.topology import DestinationSpec
from spark_bridge import read_events
from spark_bridge.sink import parse_sink_options

pytestmark = pytest.mark.spark

ORDERS, SEEN, AUDIT = "orders.placed", "orders.seen", "orders.audit"


def events_on(client: redis.Redis, namespace: str, topic: str) -> list[Any]:
    """Every event on every partition of ``topic``."""
    keyspace = KeySpace(namespace)
    spec = DestinationSpec.from_json(orjson.loads(client.hget(keyspace.destinations, topic)))
    out = []
    for p in range(spec.partitions):
        for _, fields in client.xrange(keyspace.partition(topic, p).stream):
            out.append(decode_fields(fields, topic, "event"))
    return out


def test_a_replayed_micro_batch_publishes_its_events_once(
    spark: Any, publish: Any, namespace: str, sync_redis: redis.Redis, tmp_path: Path
) -> None:
    sources = publish(ORDERS, 40, partitions=2)
    checkpoint = tmp_path / "checkpoint"

    query_ids = []

    def run() -> list[int]:
        seen = read_events(spark, ORDERS, namespace=namespace, startingOffsets="earliest").select(
            "key",
            F.lit("OrderSeen").alias("type"),
            F.to_json(F.struct(F.col("event_id").alias("source_id"), "offset")).alias("payload"),
        )
        query = (
            seen.writeStream.format("eventlog")
            .option("topic", SEEN)
            .option("namespace", namespace)
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()
        query_ids.append(query.id)
        return [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]

    assert run() == [40]
    first = events_on(sync_redis, namespace, SEEN)
    assert len(first) == 40
    assert {orjson.loads(e.body)["source_id"] for e in first} == {e.id for e in sources}
    assert all(e.type == "OrderSeen" and e.headers[IDEMPOTENCY_KEY] == e.id for e in first)
    # ids derive from (query id, batch 0) and each row's (task partition, index)
    assert {e.id for e in first} <= {derive_id(f"{query_ids[0]}/0", f"{p}/{i}") for p in range(2) for i in range(40)}

    # As after a crash between the sink's writes and the batch's commit: Spark runs batch 0 again.
    (checkpoint / "commits" / "0").unlink()
    (checkpoint / "commits" / ".0.crc").unlink(missing_ok=True)
    assert run() == [40]

    assert query_ids[1] == query_ids[0]  # the query id is kept in the checkpoint
    again = events_on(sync_redis, namespace, SEEN)
    assert [e.id for e in again] == [e.id for e in first]  # the replay's copies were dropped
    spec = DestinationSpec.from_json(orjson.loads(sync_redis.hget(KeySpace(namespace).destinations, SEEN)))
    assert spec.is_topic and spec.partitions == 1  # declared so the framework sees the topic


def test_a_batch_write_keyed_by_a_column_publishes_each_row_once(
    spark: Any, publish: Any, namespace: str, sync_redis: redis.Redis
) -> None:
    sources = publish(ORDERS, 25, partitions=2)
    orders = read_events(spark, ORDERS, stream=False, namespace=namespace).select(
        "event_id",
        "key",
        F.get_json_object("payload", "$.n").cast("long").alias("n"),
        "published_at",
    )

    def write(rows: Any) -> None:
        (
            rows.write.format("eventlog")
            .option("topic", AUDIT)
            .option("type", "OrderAudited")
            .option("idColumn", "event_id")
            .option("sinkId", "audit-job")
            .option("namespace", namespace)
            .mode("append")
            .save()
        )

    write(orders.where("n < 10"))
    write(orders.where("n >= 10"))  # the next run, with new rows: all published, none taken for duplicates
    assert len(events_on(sync_redis, namespace, AUDIT)) == 25
    write(orders)  # the same rows again (a job run twice, or a retried task): nothing new

    audited = events_on(sync_redis, namespace, AUDIT)
    assert len(audited) == len({e.id for e in audited}) == 25
    assert {e.id for e in audited} == {derive_id("audit-job", e.id) for e in sources}
    body = orjson.loads(next(e.body for e in audited if e.key == "k3"))
    assert body["n"] == 3 and body["event_id"] and body["published_at"].endswith("+00:00")
    assert set(body) == {"event_id", "n", "published_at"}  # key is the envelope's, not the body's


def test_a_batch_write_without_an_id_column_is_refused(spark: Any, namespace: str) -> None:
    rows = spark.createDataFrame([], "order_id string, n long")
    for sink_id in (None, "audit-job"):  # a stable job name would give a second run the same ids: refused too
        write = rows.write.format("eventlog").option("topic", AUDIT).option("type", "X").option("namespace", namespace)
        if sink_id:
            write = write.option("sinkId", sink_id)
        with pytest.raises(Exception, match=r"needs option idColumn.*sha2\(to_json\(struct\(\*\)\), 256\)"):
            write.mode("append").save()
    # a streaming query's ids derive from its query id: sinkId alone would be silently ignored
    with pytest.raises(ConfigurationError, match="sinkId only namespaces the ids derived from idColumn"):
        parse_sink_options(
            {"topic": AUDIT, "type": "X", "sinkId": "job"}, {"url": "redis://x"}, rows.schema, streaming=True
        )
