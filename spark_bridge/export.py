"""The export job: topics streamed into Parquet partitioned by topic and date, exactly once across restarts.

A structured streaming query reads the topics with the ``eventlog`` source and writes Parquet
with Spark's file sink. Both keep their state in the checkpoint: the offsets of each micro-batch
are logged before it runs and the files it wrote are listed in ``_spark_metadata`` only when it
commits. A job killed at any point and started again on the same checkpoint replays the logged
batch and nothing is lost or doubled, as long as the output is read through Spark
(``spark.read.parquet(PATH)``), which reads only committed files.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Literal

import attrs

from spark_bridge.source import FORMAT

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.streaming import StreamingQuery

__all__ = ["ExportJob", "concise_error", "default_checkpoint", "run_export", "start_export", "with_date"]

Trigger = Literal["available-now", "continuous"]


def default_checkpoint(to: str) -> str:
    """``<to>/_checkpoint``: beside the data, ignored by Parquet readers (names starting with ``_`` are hidden)."""
    return to.rstrip("/") + "/_checkpoint"


@attrs.frozen
class ExportJob:
    """What to export, where to, and how often."""

    topics: tuple[str, ...]
    to: str
    checkpoint: str | None = None  # default: default_checkpoint(to)
    trigger: Trigger = "available-now"
    interval_s: float = 10.0  # between micro-batches, with trigger "continuous"
    url: str | None = None
    namespace: str | None = None
    starting_offsets: str = "earliest"  # for a new checkpoint only; a restarted job resumes where it was
    max_events_per_trigger: int | None = None
    fail_on_data_loss: bool = True

    @property
    def checkpoint_path(self) -> str:
        """The checkpoint location actually used."""
        return self.checkpoint or default_checkpoint(self.to)


def with_date(events: DataFrame) -> DataFrame:
    """``events`` plus the column ``date``: the UTC day of ``published_at`` (the export's partition column)."""
    from pyspark.sql import functions as F

    # Arithmetic on epoch microseconds: the UTC day whatever the session's time zone is.
    return events.withColumn(
        "date", F.expr("date_from_unix_date(cast(floor(unix_micros(published_at) / 86400000000) as int))")
    )


def start_export(spark: SparkSession, job: ExportJob) -> StreamingQuery:
    """Start the export query on ``spark`` (which must have the source registered) and return it."""
    reader = (
        spark.readStream.format(FORMAT)
        .option("topics", ",".join(job.topics))
        .option("startingOffsets", job.starting_offsets)
        .option("failOnDataLoss", str(job.fail_on_data_loss).lower())
    )
    if job.namespace:
        reader = reader.option("namespace", job.namespace)
    if job.url:
        reader = reader.option("url", job.url)
    if job.max_events_per_trigger:
        reader = reader.option("maxEventsPerTrigger", str(job.max_events_per_trigger))
    events = with_date(reader.load())
    writer = (
        events.writeStream.format("parquet")
        .queryName("spark_bridge_export")
        .option("path", job.to)
        .option("checkpointLocation", job.checkpoint_path)
        .partitionBy("topic", "date")
        .outputMode("append")
    )
    if job.trigger == "available-now":
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=f"{job.interval_s} seconds")
    return writer.start()


_OUR_ERRORS = ("DataLossError", "ConfigurationError", "BrokerUnavailable", "JavaNotFound")


def concise_error(text: str) -> str:
    """The line of a Spark failure that names one of our errors (else its first line): Spark wraps them deep."""
    lines = text.splitlines()
    for line in lines:
        for name in _OUR_ERRORS:
            if f"{name}: " in line:
                return line[line.index(name) :].strip()
    return lines[0] if lines else text


def _report(query: StreamingQuery, counts: dict[int, int]) -> None:
    """Print one line per micro-batch that read events and was not reported yet."""
    for progress in query.recentProgress:
        batch, rows = int(progress["batchId"]), int(progress.get("numInputRows") or 0)
        if rows and batch not in counts:
            counts[batch] = rows
            print(f"batch {batch}: {rows} events", file=sys.stderr, flush=True)


# Loggers that print a failed query's stack traces (hundreds of lines) on top of the one-line cause
# run_export reports itself.
_FAILURE_LOGGERS = (
    "org.apache.spark.executor.Executor",
    "org.apache.spark.scheduler.TaskSetManager",
    "org.apache.spark.sql.execution.datasources.FileFormatWriter",
    "org.apache.spark.sql.execution.streaming",
)


def _silence_failure_logs(spark: SparkSession) -> None:
    try:
        jvm = spark.sparkContext._jvm
        off = jvm.org.apache.logging.log4j.Level.OFF
        for name in _FAILURE_LOGGERS:
            jvm.org.apache.logging.log4j.core.config.Configurator.setLevel(name, off)
    except Exception:  # Spark Connect, or another logging backend: leave Spark's logging as it is
        pass


def run_export(
    job: ExportJob, *, master: str | None = None, spark: SparkSession | None = None, verbose: bool = False
) -> int:
    """Run ``job`` until done (available-now) or until SIGTERM/SIGINT (continuous); return an exit status.

    A signal stops the query between micro-batches' commits as Spark allows; whatever it was doing
    is replayed on the next start, so stopping never loses or doubles events. A failure is reported
    in one line (its cause); ``verbose`` keeps Spark's own logs, stack traces included.
    """
    from spark_bridge.session import spark_session

    session = spark or spark_session(
        "spark_bridge export", master=master, url=job.url, namespace=job.namespace, quiet=not verbose
    )
    if not verbose:
        _silence_failure_logs(session)
    started = time.monotonic()
    query = start_export(session, job)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    counts: dict[int, int] = {}
    try:
        while query.isActive and not stop.is_set():
            query.awaitTermination(0.5)
            _report(query, counts)
        if stop.is_set():
            query.stop()
        error = query.exception()
    except Exception as exc:  # awaitTermination re-raises the query's failure
        error = exc
    try:
        if error is not None:
            print(f"export failed: {concise_error(str(error))}", file=sys.stderr)
            if not verbose:
                print("(run with --verbose to see Spark's logs and stack traces)", file=sys.stderr)
            return 1
        _report(query, counts)  # batches that finished after the last poll
        took = time.monotonic() - started
        print(
            f"exported {sum(counts.values())} events in {len(counts)} batch(es) to {job.to} in {took:.1f}s",
            file=sys.stderr,
        )
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
