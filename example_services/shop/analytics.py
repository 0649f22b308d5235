"""analytics: the shop's numbers, computed by Spark straight from the event log, and its Parquet export.

Nothing subscribes: the Spark bridge reads the topics as tables (each partition a Spark input
partition; no consumer group, nothing acknowledged). Events are deduplicated by ``event_id``: the
outbox relay publishes at least once, with stable ids, so a copy is the same event.

* revenue per minute: ``payments.captured`` summed by the minute it was published;
* decline rate by reason: ``payments.failed`` per reason over every payment decided;
* shortages per SKU: ``stock.short`` counted per SKU;
* the export: every shop topic to Parquet (``spark_bridge`` export job, exactly once, partitioned
  by topic and date), and the three tables beside it.

Run (needs the ``spark`` extra)::

    python -m example_services.shop.analytics --out ./lake   # prints the tables and a JSON summary
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from example_services.shop.messages import (
    ORDERS_CANCELLED,
    ORDERS_PLACED,
    ORDERS_SHIPPED,
    PAYMENTS_CAPTURED,
    PAYMENTS_FAILED,
    STOCK_SHORT,
)

EXPORTED = (ORDERS_PLACED, PAYMENTS_CAPTURED, PAYMENTS_FAILED, STOCK_SHORT, ORDERS_SHIPPED, ORDERS_CANCELLED)


def compute(spark: Any, out: Path) -> dict[str, Any]:
    """Compute the three tables, export the topics and the tables to Parquet under ``out``; return them.

    The three topics are read from the broker once (one batch read, cached); every table is then
    computed in the JVM from that cache."""
    from pyspark.sql import functions as F

    import spark_bridge
    from spark_bridge.export import ExportJob, start_export

    topics = (PAYMENTS_CAPTURED.name, PAYMENTS_FAILED.name, STOCK_SHORT.name)
    events = (
        spark_bridge.read_events(spark, topics, stream=False)
        .dropDuplicates(["event_id"])  # a relay re-publishes with the same id: one event
        .select(
            "topic",
            "published_at",
            F.get_json_object("payload", "$.amount_cents").cast("long").alias("amount_cents"),
            F.get_json_object("payload", "$.reason").alias("reason"),
            F.get_json_object("payload", "$.sku").alias("sku"),
        )
        .cache()
    )
    captured = events.where(F.col("topic") == PAYMENTS_CAPTURED.name)
    revenue = (
        captured.groupBy(F.date_trunc("minute", "published_at").alias("minute"))
        .agg(F.sum("amount_cents").alias("revenue_cents"), F.count("*").alias("payments"))
        .orderBy("minute")
    )
    decided = events.where(F.col("topic") != STOCK_SHORT.name).count()
    declines = (
        events.where(F.col("topic") == PAYMENTS_FAILED.name)
        .groupBy("reason")
        .agg(F.count("*").alias("declines"))
        .withColumn("rate", F.round(F.col("declines") / F.lit(max(decided, 1)), 4))
        .orderBy(F.desc("declines"))
    )
    shortages = (
        events.where(F.col("topic") == STOCK_SHORT.name)
        .groupBy("sku")
        .agg(F.count("*").alias("shortages"))
        .orderBy(F.desc("shortages"), "sku")
    )
    tables = {"revenue_per_minute": revenue, "decline_rate_by_reason": declines, "shortages_per_sku": shortages}
    collected = {}
    for name, frame in tables.items():
        rows = frame.collect()
        collected[name] = [{k: _plain(v) for k, v in row.asDict().items()} for row in rows]
        table = spark.createDataFrame(rows, frame.schema).coalesce(1)
        table.write.mode("overwrite").parquet(str(out / "tables" / name))
    query = start_export(spark, ExportJob(topics=tuple(t.name for t in EXPORTED), to=str(out / "events")))
    query.awaitTermination()
    return {
        "revenue_cents": sum(r["revenue_cents"] or 0 for r in collected["revenue_per_minute"]),
        "captured_events": sum(r["payments"] for r in collected["revenue_per_minute"]),
        "tables": collected,
        "parquet": str(out),
    }


def _plain(value: Any) -> Any:
    return value.isoformat() if hasattr(value, "isoformat") else value


def main(argv: list[str] | None = None) -> int:
    """Run the analytics job once; print a JSON summary on the last line of stdout."""
    parser = argparse.ArgumentParser(prog="python -m example_services.shop.analytics", description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="directory for the Parquet export and tables")
    parser.add_argument("--master", default="local[2]", help="Spark master (default local[2])")
    parser.add_argument(
        "--when-told",
        action="store_true",
        help="start Spark, print 'ready', and compute once a line arrives on stdin (the demo starts the JVM early)",
    )
    args = parser.parse_args(argv)
    import spark_bridge

    spark = spark_bridge.spark_session(
        "shop analytics",
        master=args.master,
        config={"spark.sql.shuffle.partitions": "2", "spark.default.parallelism": "2"},
    )
    try:
        if args.when_told:
            print("ready", flush=True)
            if not sys.stdin.readline():
                return 1  # the demo went away
        result = compute(spark, args.out)
    finally:
        spark.stop()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
