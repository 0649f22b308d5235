"""The SQL rows of ``make bench`` (issue #33) at a tiny size against real servers.

A trial of the batch handler kind (one transaction and one ``executemany`` per batch, the plain
consumer's shape of work) applies every message exactly once and measures its client CPU, and
the table shows it at 0 ms of work only, as a ratio to the plain consumer of the same round.
"""

from __future__ import annotations

import pytest

from benchmarks import sql_bench
from benchmarks.runner import QUICK, Runner

pytestmark = pytest.mark.usefixtures("no_bench_child_left")


def test_a_batch_handler_trial_applies_every_message_once_and_measures_its_cpu(redis_url: str, pg_server: str) -> None:
    with sql_bench.database(pg_server, prefix="sql_bench_test") as db:
        result = sql_bench.drain_trial(redis_url, db, "framework-batch", 1, 2000, work_ms=0)
    # drain_trial raises unless the table holds every message exactly once and nothing is left unacknowledged
    assert result["kind"] == "framework-batch" and result["n"] == 2000
    assert result["msgs_per_s"] > 0 and 0 < result["cpu_ms_per_msg"] < 50


def test_the_batch_kind_is_a_zero_work_row_paired_with_the_plain_consumer() -> None:
    report = Runner("redis://unused", QUICK, 1, ["sql"], None)
    trials: dict[str, list[dict[str, float]]] = {}
    for work in ("sql", "sql:0ms"):
        for kind, cpu in (("plain", 0.05), ("framework", 0.5), ("framework-sqlinbox", 0.5), ("framework-batch", 0.1)):
            if kind == "framework-batch" and work == "sql":
                continue  # not run at 2 ms of work
            for w in (1, 3):
                trials[f"{work}:{kind}:{w}"] = [{"round": 0, "msgs_per_s": 1000.0, "cpu_ms_per_msg": cpu}]
    report.trials = trials
    rows = {r.benchmark: r for r in report.rows()}
    batch = [name for name in rows if "batch handler" in name]
    assert len(batch) == 4 and all(", 0 ms work" in name for name in batch)  # rate and CPU, 1 and 3 workers
    cpu = rows[next(name for name in batch if "client CPU" in name and "1 worker," in name)]
    assert cpu.ratio == "2.00x" and cpu.ok is False  # 0.1 ms against the plain 0.05: over the 1.0x target
