"""The export job: topics into Parquet exactly once, across reruns, SIGKILL, and retention gaps."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import redis

from broker.redis.keys import KeySpace
from spark_bridge.export import ExportJob, run_export, start_export

pytestmark = pytest.mark.spark

ORDERS, PAYMENTS = "orders.placed", "payments.captured"


def exported(spark: Any, path: Path) -> list[str]:
    """Event ids in an export directory, read as Spark reads it (only committed files, via _spark_metadata)."""
    return [row.event_id for row in spark.read.parquet(str(path)).select("event_id").collect()]


def run_job(spark: Any, job: ExportJob) -> list[int]:
    """Run an available-now export to the end; return the rows of each micro-batch that had any."""
    query = start_export(spark, job)
    query.awaitTermination()
    return [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]


def test_two_topics_into_parquet_exactly_once_and_a_rerun_adds_only_new_rows(
    spark: Any, publish: Any, namespace: str, tmp_path: Path
) -> None:
    sent = publish(ORDERS, 300, partitions=2) + publish(PAYMENTS, 200, partitions=2)
    out = tmp_path / "events"
    job = ExportJob(topics=(ORDERS, PAYMENTS), to=str(out), namespace=namespace, max_events_per_trigger=300)

    batches = run_job(spark, job)

    assert sum(batches) == 500 and len(batches) == 2 and max(batches) <= 300  # maxEventsPerTrigger held
    rows = spark.read.parquet(str(out)).collect()  # one Spark job; the checks below are plain Python
    ids = [r.event_id for r in rows]
    assert len(ids) == len(set(ids)) == 500
    assert set(ids) == {e.id for e in sent}
    assert Counter((r.topic, r.partition) for r in rows).keys() == {
        (ORDERS, 0),
        (ORDERS, 1),
        (PAYMENTS, 0),
        (PAYMENTS, 1),
    }
    assert sum(r.topic == ORDERS for r in rows) == 300
    assert {p.name for p in out.iterdir() if p.name.startswith("topic=")} == {f"topic={ORDERS}", f"topic={PAYMENTS}"}
    days = {datetime.fromtimestamp(e.published_at / 1000, UTC).date().isoformat() for e in sent}
    assert {p.name for p in (out / f"topic={ORDERS}").iterdir()} == {f"date={day}" for day in days}
    row = next(r for r in rows if r.event_id == sent[7].id)
    assert (row.key, row.type, row.payload) == ("k7", "OrderPlaced", '{"order_id":"o-7","n":7}')
    assert row.trace_id == f"{7:032x}" and row.headers["traceparent"].startswith("00-")
    assert row.published_at.timestamp() == pytest.approx(sent[7].published_at / 1000)

    more = publish(ORDERS, 120, start=300)
    assert sum(run_job(spark, job)) == 120  # same checkpoint: only the new events are read
    ids = exported(spark, out)
    assert len(ids) == len(set(ids)) == 620
    assert set(ids) == {e.id for e in sent + more}


def test_a_query_killed_mid_batch_and_restarted_exports_every_event_once(
    spark: Any, publish: Any, namespace: str, redis_url: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    sent = publish(ORDERS, 600, partitions=2) + publish(PAYMENTS, 600, partitions=2)
    out, checkpoint = tmp_path / "events", tmp_path / "checkpoint"
    command = [
        sys.executable,
        "-m",
        "spark_bridge",
        "export",
        "--topics",
        f"{ORDERS},{PAYMENTS}",
        "--to",
        str(out),
        "--checkpoint",
        str(checkpoint),
        "--max-events-per-trigger",
        "400",
        "--master",
        "local[2]",
        "--redis-url",
        redis_url,
        "--namespace",
        namespace,
    ]
    log = tmp_path / "export.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        killed_in = None
        deadline = time.monotonic() + 240
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                offsets = {int(p.name) for p in (checkpoint / "offsets").glob("[0-9]*")}
                commits = {int(p.name) for p in (checkpoint / "commits").glob("[0-9]*")}
                running = offsets - commits
                if running and min(running) >= 1:  # a batch is logged but not committed: it is running
                    os.killpg(proc.pid, signal.SIGKILL)  # the driver, its JVM and its Python workers at once
                    killed_in = min(running)
                    break
                time.sleep(0.02)
        finally:
            if proc.poll() is None and killed_in is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert killed_in is not None, f"the job ended before it could be killed mid-batch:\n{log.read_text()[-3000:]}"
    assert not (checkpoint / "commits" / str(killed_in)).exists()

    # Restart the same job (in this process's session: a second JVM start would only cost time).
    job = ExportJob(
        topics=(ORDERS, PAYMENTS),
        to=str(out),
        checkpoint=str(checkpoint),
        url=redis_url,
        namespace=namespace,
        max_events_per_trigger=400,
    )
    assert run_export(job, spark=spark) == 0
    assert "exported" in capfd.readouterr().err
    ids = exported(spark, out)
    assert len(ids) == 1200, f"{len(ids)} rows, {len(set(ids))} distinct"
    assert set(ids) == {e.id for e in sent}


def test_events_trimmed_before_they_were_read_fail_the_query_with_the_gap_named(
    spark: Any, publish: Any, namespace: str, sync_redis: redis.Redis, tmp_path: Path
) -> None:
    publish(ORDERS, 100, partitions=1)
    out = tmp_path / "events"
    job = ExportJob(topics=(ORDERS,), to=str(out), namespace=namespace)
    assert sum(run_job(spark, job)) == 100
    stream = KeySpace(namespace).partition(ORDERS, 0).stream
    last_read = sync_redis.xrevrange(stream, count=1)[0][0].decode()
    publish(ORDERS, 100, partitions=1, start=100)
    unread = [entry_id.decode() for entry_id, _ in sync_redis.xrange(stream, f"({last_read}", "+")]
    sync_redis.xtrim(stream, minid=unread[40], approximate=False)  # retention drops 40 events never read

    with pytest.raises(Exception) as failure:
        run_job(spark, job)

    message = str(failure.value)
    assert "DataLossError" in message and "failOnDataLoss=false" in message
    assert f"data loss in topic '{ORDERS}' partition 0: 40 event(s) after offset {last_read} were deleted" in message
    assert f"the oldest event still retained is {unread[40]}" in message

    tolerant = ExportJob(topics=(ORDERS,), to=str(out), namespace=namespace, fail_on_data_loss=False)
    assert sum(run_job(spark, tolerant)) == 60  # logged the gap, read what is still there
    ids = exported(spark, out)
    assert len(ids) == len(set(ids)) == 160


def test_a_continuous_export_picks_up_new_events_until_signalled(
    spark: Any, publish: Any, namespace: str, tmp_path: Path
) -> None:
    sent = publish(ORDERS, 50)
    out, checkpoint = tmp_path / "events", tmp_path / "checkpoint"
    job = ExportJob(
        topics=(ORDERS,),
        to=str(out),
        checkpoint=str(checkpoint),
        trigger="continuous",
        interval_s=0.5,
        namespace=namespace,
    )
    more: list[Any] = []

    def operator() -> None:  # publishes while the job runs, then stops it as Ctrl-C would
        deadline = time.monotonic() + 120
        while not (checkpoint / "commits" / "0").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        more.extend(publish(ORDERS, 30, start=50))
        while len(list((checkpoint / "commits").glob("[0-9]*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=operator, daemon=True)
    thread.start()
    assert run_export(job, spark=spark) == 0
    thread.join()
    ids = exported(spark, out)
    assert len(ids) == len(set(ids)) == 80 and set(ids) == {e.id for e in sent + more}


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spark_bridge", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )


def test_the_cli_explains_wrong_arguments_in_one_line(redis_url: str, namespace: str, publish: Any) -> None:
    publish(ORDERS, 1)
    assert _cli("export", "--help").returncode == 0

    bad_interval = _cli("export", "--topics", ORDERS, "--to", "/tmp/x", "--trigger", "continuous", "--interval", "10")
    assert bad_interval.returncode == 2
    assert (
        bad_interval.stderr.strip()
        .splitlines()[-1]
        .endswith("'10' is not an interval: use a number and ms, s, m or h, like 10s")
    )

    unknown = _cli(
        "export", "--topics", "orders.plcaed", "--to", "/tmp/x", "--redis-url", redis_url, "--namespace", namespace
    )
    assert unknown.returncode == 2
    assert f"unknown topic(s) orders.plcaed in namespace '{namespace}'; known topics: {ORDERS}" in unknown.stderr

    down = _cli("export", "--topics", ORDERS, "--to", "/tmp/x", "--redis-url", "redis://127.0.0.1:1/0")
    assert down.returncode == 1
    assert "cannot reach the broker at redis://127.0.0.1:1/0" in down.stderr and "Start one" in down.stderr
