"""Spark bridge throughput: events from the broker into Parquet, against the ceiling for a Python source.

Both runs use the export job's query (``spark_bridge.export.start_export`` shape: an availableNow
stream written as Parquet partitioned by topic and date) on one warm local session:

* **broker**: the ``eventlog`` source reading ``events`` entries from ``partitions`` streams;
* **ceiling**: a Python data source that yields *the same rows* as ready-made Arrow record
  batches from memory (``/dev/shm``, memory-mapped): no I/O and no per-row Python work, so it
  measures what Spark itself costs to take rows from any Python source and write them.

Each is run once to warm up, then ``repeats`` times; medians are reported. Usage::

    python benchmarks/spark_bench.py [--events 1000000] [--partitions 4] [--repeats 3] [--redis-url URL]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import redis
from pyspark import cloudpickle
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow

from broker.codec import encode_fields
from broker.envelope import Envelope
from broker.redis.keys import KeySpace
from broker.topology import DestinationSpec
from spark_bridge.export import ExportJob, start_export, with_date
from spark_bridge.offsets import open_client
from spark_bridge.rows import EVENT_SCHEMA, BatchBuilder

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers may not import this file by name

TOPIC = "bench.orders"


def publish(url: str, namespace: str, events: int, partitions: int) -> float:
    """Publish ``events`` events like a service would (key, traceparent, correlation id); return seconds taken."""
    client = redis.Redis.from_url(url)
    keyspace = KeySpace(namespace)
    spec = DestinationSpec(TOPIC, "event", partitions=partitions, retention_ms=None)
    client.hset(keyspace.destinations, TOPIC, orjson.dumps(spec.to_json()))
    started = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for i in range(events):
        trace = uuid.uuid4().hex
        env = Envelope(
            destination=TOPIC,
            kind="event",
            type="OrderPlaced",
            key=f"order-{i}",
            body=orjson.dumps(
                {
                    "order_id": f"order-{i}",
                    "customer": f"customer-{i % 5000}",
                    "total_cents": (i * 7919) % 100_000,
                    "currency": "EUR",
                }
            ),
            headers={"traceparent": f"00-{trace}-{trace[:16]}-01", "correlation-id": str(uuid.uuid4())},
        )
        stream = keyspace.partition(TOPIC, spec.partition_for(env.key, env.id)).stream
        pipe.execute_command("XADD", stream, "*", *encode_fields(env))
        if len(pipe) >= 5000:
            pipe.execute()
    pipe.execute()
    client.close()
    return time.perf_counter() - started


def capture(url: str, namespace: str, partitions: int, into: Path) -> int:
    """Read every partition with the source's own decoder into Arrow IPC files (the ceiling's rows)."""
    client = open_client(url)
    keyspace = KeySpace(namespace)
    total = 0
    for p in range(partitions):
        stream = keyspace.partition(TOPIC, p).stream
        builder = BatchBuilder(EVENT_SCHEMA, TOPIC, p)
        with pa.OSFile(str(into / f"part-{p}.arrow"), "wb") as sink:
            writer = pa.ipc.new_file(sink, builder.arrow_schema)
            cursor = "0-0"
            while entries := client.execute_command("XRANGE", stream, f"({cursor}", "+", "COUNT", 5000):
                writer.write_batch(builder.build(entries))
                total += len(entries)
                cursor = entries[-1][0].decode()
            writer.close()
    client.close()
    return total


class _File(InputPartition):
    def __init__(self, path: str) -> None:
        self.path = path


class MemoryArrowSource(DataSource):
    """In-memory Python source: yields prepared Arrow batches from memory-mapped files (option ``dir``)."""

    @classmethod
    def name(cls) -> str:
        return "bench_memory_arrow"

    def schema(self) -> Any:
        return EVENT_SCHEMA

    def streamReader(self, schema: Any) -> DataSourceStreamReader:
        return _MemoryReader(self.options["dir"])


class _MemoryReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, directory: str) -> None:
        self.files = sorted(str(p) for p in Path(directory).glob("part-*.arrow"))

    def initialOffset(self) -> dict:
        return {"done": False}

    def latestOffset(self, start: dict, limit: Any) -> dict:
        return {"done": True}

    def prepareForTriggerAvailableNow(self) -> None:
        pass

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        return [] if start == end else [_File(f) for f in self.files]

    def read(self, partition: InputPartition) -> Any:
        source = pa.memory_map(partition.path)  # type: ignore[attr-defined]
        reader = pa.ipc.open_file(source)
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)


def _timed_run(spark: Any, reader: Any, out: Path) -> tuple[float, int]:
    """Run one availableNow query into fresh Parquet output; return (seconds, rows)."""
    if out.exists():
        shutil.rmtree(out)
    started = time.perf_counter()
    query = reader(out)
    query.awaitTermination()
    took = time.perf_counter() - started
    rows = sum(int(p["numInputRows"]) for p in query.recentProgress)
    return took, rows


def run(redis_url: str, *, events: int = 1_000_000, partitions: int = 4, repeats: int = 3) -> dict:
    """Measure broker -> Parquet and in-memory Arrow -> Parquet rows/s; return medians and every run."""
    from pyspark.sql import SparkSession

    from spark_bridge.session import spark_session

    own_session = SparkSession.getActiveSession() is None  # stop it afterwards only if we start it
    spark = None
    namespace = f"bench-spark-{uuid.uuid4().hex[:8]}"
    work = Path(tempfile.mkdtemp(prefix="spark-bench-"))
    memory = Path(tempfile.mkdtemp(prefix="spark-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        publish_s = publish(redis_url, namespace, events, partitions)
        captured = capture(redis_url, namespace, partitions, memory)
        spark = spark_session("spark_bench", url=redis_url, namespace=namespace)
        spark.dataSource.register(MemoryArrowSource)

        def broker_query(out: Path) -> Any:
            return start_export(
                spark,
                ExportJob(
                    topics=(TOPIC,), to=str(out), checkpoint=str(out) + "-ckpt", url=redis_url, namespace=namespace
                ),
            )

        def memory_query(out: Path) -> Any:
            events_df = spark.readStream.format("bench_memory_arrow").option("dir", str(memory)).load()
            return (
                with_date(events_df)
                .writeStream.format("parquet")
                .option("path", str(out))
                .option("checkpointLocation", str(out) + "-ckpt")
                .partitionBy("topic", "date")
                .trigger(availableNow=True)
                .start()
            )

        results: dict[str, list[float]] = {"broker": [], "ceiling": []}
        for attempt in range(repeats + 1):  # attempt 0 warms the JVM and the page cache up
            for label, query in (("broker", broker_query), ("ceiling", memory_query)):
                out = work / f"{label}-{attempt}"
                took, rows = _timed_run(spark, query, out)
                if rows != events:
                    raise RuntimeError(f"{label} run read {rows} rows, expected {events}")
                if attempt == 0 and label == "broker":
                    written = spark.read.parquet(str(out))
                    assert written.count() == events == written.select("event_id").distinct().count()
                if attempt > 0:
                    results[label].append(rows / took)
                shutil.rmtree(out, ignore_errors=True)
                shutil.rmtree(str(out) + "-ckpt", ignore_errors=True)
        broker = statistics.median(results["broker"])
        ceiling = statistics.median(results["ceiling"])
        return {
            "events": events,
            "partitions": partitions,
            "repeats": repeats,
            "captured": captured,
            "publish_rows_per_s": events / publish_s,
            "broker_rows_per_s": broker,
            "ceiling_rows_per_s": ceiling,
            "ratio": broker / ceiling,
            "runs": results,
            "cores": os.cpu_count(),
        }
    finally:
        if spark is not None and own_session:
            spark.stop()
        client = redis.Redis.from_url(redis_url)
        keys = list(client.scan_iter(match=f"{namespace}:*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)


def main() -> None:
    """Print a table of the medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL"))
    args = parser.parse_args()
    url = args.redis_url
    if not url:
        from broker.connect import resolve_url

        url = resolve_url()
    r = run(url, events=args.events, partitions=args.partitions, repeats=args.repeats)
    print(
        f"\nSpark bridge benchmark: {r['events']:,} events, {r['partitions']} partitions, "
        f"{r['cores']} cores, median of {r['repeats']} runs (after one warm-up)"
    )
    print(f"{'path':<44}{'rows/s':>12}")
    print(f"{'broker -> Parquet (eventlog source)':<44}{r['broker_rows_per_s']:>12,.0f}")
    print(f"{'in-memory Arrow -> Parquet (ceiling)':<44}{r['ceiling_rows_per_s']:>12,.0f}")
    print(f"{'broker / ceiling':<44}{r['ratio']:>12.0%}")
    print(f"{'(publishing the events, one client)':<44}{r['publish_rows_per_s']:>12,.0f}")
    print("runs (rows/s):", {k: [round(v) for v in vs] for k, vs in r["runs"].items()})


if __name__ == "__main__":
    main()
