"""analytics: the shop's numbers, computed by Spark straight from the event log, and its Parquet export.

Nothing subscribes: the Spark bridge reads the topics as tables (each partition a Spark input
partition; no consumer group, nothing acknowledged). Events are deduplicated by ``event_id``: the
outbox relay publishes at least once, with stable ids, so a copy is the same event.

* revenue per minute: ``payments.captured`` summed by the minute it was published;
* decline rate by reason: ``payments.failed`` per reason over every payment decided;
* shortages per SKU: ``stock.short`` counted per SKU;
* the export: every shop topic to Parquet (the ``spark_bridge`` export job, exactly once,
  partitioned by topic and date); the three tables beside it as ``tables.json``.

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
    """Compute the three tables in one Spark job, export the topics to Parquet under ``out``; return them.

    The three topics are read once and aggregated together, keyed per topic (the minute for
    captured payments, the reason for failed ones, the SKU for shortages): on a small cluster the
    fixed cost of a Spark job dominates, so one job beats three."""
    from pyspark.sql import functions as F

    import spark_bridge
    from spark_bridge.export import ExportJob, start_export

    captured, failed, short = PAYMENTS_CAPTURED.name, PAYMENTS_FAILED.name, STOCK_SHORT.name
    events = spark_bridge.read_events(spark, (captured, failed, short), stream=False).dropDuplicates(["event_id"])
    key = (
        F.when(F.col("topic") == captured, F.date_format(F.date_trunc("minute", "published_at"), "yyyy-MM-dd HH:mm"))
        .when(F.col("topic") == failed, F.get_json_object("payload", "$.reason"))
        .otherwise(F.get_json_object("payload", "$.sku"))
    )
    amount = F.get_json_object("payload", "$.amount_cents").cast("long")
    rows = (
        events.groupBy("topic", key.alias("key"))
        .agg(F.count("*").alias("n"), F.sum(amount).alias("cents"))
        .collect()  # one job: a handful of rows
    )
    by_topic: dict[str, list[Any]] = {captured: [], failed: [], short: []}
    for row in rows:
        by_topic[row["topic"]].append(row)
    decided = sum(r["n"] for r in by_topic[captured]) + sum(r["n"] for r in by_topic[failed])
    tables = {
        "revenue_per_minute": [
            {"minute": r["key"], "revenue_cents": int(r["cents"] or 0), "payments": r["n"]}
            for r in sorted(by_topic[captured], key=lambda r: r["key"])
        ],
        "decline_rate_by_reason": [
            {"reason": r["key"], "declines": r["n"], "rate": round(r["n"] / max(decided, 1), 4)}
            for r in sorted(by_topic[failed], key=lambda r: -r["n"])
        ],
        "shortages_per_sku": [
            {"sku": r["key"], "shortages": r["n"]} for r in sorted(by_topic[short], key=lambda r: (-r["n"], r["key"]))
        ],
    }
    query = start_export(spark, ExportJob(topics=tuple(t.name for t in EXPORTED), to=str(out / "events")))
    query.awaitTermination()
    (out / "tables.json").write_text(json.dumps(tables, indent=2))
    return {
        "revenue_cents": sum(r["revenue_cents"] for r in tables["revenue_per_minute"]),
        "captured_events": sum(r["payments"] for r in tables["revenue_per_minute"]),
        "tables": tables,
        "parquet": str(out / "events"),
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
