"""The commands and latency rows of ``make bench`` (issue #33) at a tiny size against a real server.

A profiled commands drain says where its time goes (the worker's CPU per message and how busy it
was, the server's CPU per message), the table turns that into rows with what the inbox adds, and
the raw consumer of the latency trial starts on every server (Redis 7.0 registers a consumer only
once it reads something: the trial waited for one that never showed).
"""

from __future__ import annotations

import pytest

from benchmarks import machine, runtime_bench
from benchmarks.cpu_watch import CpuWatch
from benchmarks.paced import cpu_per_message
from benchmarks.runner import QUICK, Runner

pytestmark = pytest.mark.usefixtures("no_bench_child_left")


def test_a_profiled_drain_reports_worker_and_server_cpu_per_message(redis_url: str) -> None:
    pid = machine.server_pid(redis_url)
    result = runtime_bench.commands(redis_url, 3000, inbox=True, profile=True, server_pid=pid)
    assert result["n"] == 3000 and result["msgs_per_s"] > 0
    assert 0 < result["worker_us_per_msg"] < 10_000
    assert 0 < result["worker_busy"] <= 1.5  # (CPU of all its threads over the span: may pass 1 a little)
    if pid is not None:  # a server on this machine: its CPU over the same span
        assert 0 < result["server_us_per_msg"] < 10_000


def test_the_raw_latency_consumer_starts_and_measures(redis_url: str) -> None:
    pid = machine.server_pid(redis_url)
    lat = runtime_bench.raw_latency(redis_url, rate=500, seconds=0.4, warmup=0.2, server_pid=pid)
    assert lat["samples"] == 200
    assert 0 < lat["p50_ms"] <= lat["p99_ms"]
    assert 0 < lat["cpu_us_per_msg"] < 100_000  # the consumer's CPU over the paced load, per message
    if pid is not None:
        assert 0 < lat["server_cpu_us_per_msg"] < 100_000


def test_the_framework_latency_trial_reports_the_workers_cpu_per_message(redis_url: str) -> None:
    pid = machine.server_pid(redis_url)
    lat = runtime_bench.latency(redis_url, rate=500, seconds=0.4, warmup=0.2, server_pid=pid)
    assert lat["samples"] == 200 and lat["inbox"] is True
    assert 0 < lat["cpu_us_per_msg"] < 100_000
    assert ("server_cpu_us_per_msg" in lat) == (pid is not None)


def test_the_table_shows_cpu_per_message_at_the_latency_rate_next_to_the_raw_consumers() -> None:
    figures = {
        "latency:raw": (0.2, 0.4, 100.0, 80.0),
        "latency:framework": (0.5, 1.0, 600.0, 400.0),
        "latency:framework-noinbox": (0.4, 0.9, 450.0, 250.0),
    }
    trials = {
        key: [
            {"round": r, "p50_ms": p50, "p90_ms": p99, "p99_ms": p99, "max_ms": 2.0, "achieved_rate": 500.0}
            | {"cpu_us_per_msg": cpu * (r + 1), "server_cpu_us_per_msg": server}
            for r in (0, 1)
        ]
        for key, (p50, p99, cpu, server) in figures.items()
    }
    report = Runner("redis://unused", QUICK, 2, ["raw", "latency"], None)
    report.trials = trials
    rows = {r.benchmark: r for r in report.rows()}
    cpu = rows["CPU per message @ 500/s (the latency trials), consumer + server µs"]
    assert cpu.result.splitlines() == ["inbox on 900 + 400", "inbox off 675 + 250"]  # medians of the two rounds
    assert cpu.ceiling == "raw consumer\n150 + 80"
    assert cpu.ratio.startswith("6.0x / 4.5x")  # paired by round: 600/100 and 1200/200; 450/100 and 900/200


def test_the_table_shows_where_the_time_goes_and_what_the_inbox_adds() -> None:
    profile = {"on": (9.0, 0.75, 6.5), "off": (8.0, 0.97, 3.5)}
    trials = {"raw:xack": [{"round": 0, "drain_msgs_per_s": 300_000.0}]}
    for mode, (worker, busy, server) in profile.items():
        trials[f"commands:{mode}"] = [
            {
                "round": 0,
                "msgs_per_s": 90_000.0,
                "worker_us_per_msg": worker,
                "worker_busy": busy,
                "server_us_per_msg": server,
            }
        ]
    report = Runner("redis://unused", QUICK, 1, ["raw", "commands"], None)
    report.trials = trials
    rows = {r.benchmark: r.result for r in report.rows()}
    on = rows["where the time goes, inbox on: CPU per message, worker + server"]
    assert on.startswith("9.0 + 6.5 µs") and "worker busy 75%" in on
    assert rows["what the inbox adds per message (medians, on - off)"] == "1.0 µs worker + 3.0 µs server"


def test_a_trial_without_cpu_figures_keeps_its_latency_and_is_left_out_of_the_ratio() -> None:
    unsampled = CpuWatch(pid=None)  # never started: nothing sampled around the span
    assert cpu_per_message(unsampled, {"first_ns": 1, "last_ns": 2}, 100) == {}
    base = {"p50_ms": 0.2, "p90_ms": 0.3, "p99_ms": 0.4, "max_ms": 1.0, "achieved_rate": 500.0}
    report = Runner("redis://unused", QUICK, 2, ["raw", "latency"], None)
    report.trials = {
        "latency:raw": [{"round": r, **base, "cpu_us_per_msg": 100.0} for r in (0, 1)],
        "latency:framework": [{"round": 0, **base, "cpu_us_per_msg": 300.0}, {"round": 1, **base}],
    }
    rows = {r.benchmark: r for r in report.rows()}
    assert rows["latency publish → handler start @ 500/s, p50 / p99 ms"].result.startswith("p50 0.20")
    cpu = rows["CPU per message @ 500/s (the latency trials), consumer + server µs"]
    assert cpu.result == "inbox on 300" and cpu.ratio.startswith("3.0x")  # the round with a figure alone
