"""The peer benchmark of ``make bench`` (issue #33) runs end to end at a tiny size against a real server.

FastStream's batch and per-message subscribers drain a 500-message backlog and take a short paced load
in a worker process of their own; the framework's latency trial runs with the inbox off; the table rows
come out of the trials' numbers, and without FastStream the peer rows say how to install it.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from benchmarks import __main__ as bench_main
from benchmarks import faststream_bench, runtime_bench

needs_faststream = pytest.mark.skipif(  # (under CI, `make test` installs it: the tests run, never skip)
    faststream_bench.missing() is not None and not os.environ.get("CI"), reason="faststream[redis] not installed"
)


pytestmark = pytest.mark.usefixtures("no_bench_child_left")


@needs_faststream
@pytest.mark.parametrize("mode", faststream_bench.MODES)
def test_faststream_drain_and_latency_run_end_to_end(redis_url: str, mode: str) -> None:
    drained = faststream_bench.drain(redis_url, 500, mode)
    assert drained["n"] == 500 and drained["mode"] == mode
    assert drained["msgs_per_s"] > 0 and drained["seconds"] > 0
    assert 100 < drained["entry_bytes"] < 300  # FastStream's __data__ field around the 60-byte body

    lat = faststream_bench.latency(redis_url, mode, rate=500, seconds=0.4, warmup=0.2)
    assert lat["samples"] == 200  # the 100 warm-up messages are dropped
    assert 0 < lat["p50_ms"] <= lat["p99_ms"] <= lat["max_ms"]
    assert 0 < lat["cpu_us_per_msg"] < 100_000  # its worker's CPU over the paced load, per message


def test_framework_latency_runs_with_the_inbox_off(redis_url: str) -> None:
    lat = runtime_bench.latency(redis_url, rate=500, seconds=0.4, warmup=0.2, inbox=False)
    assert lat["inbox"] is False and lat["samples"] == 200
    assert 0 < lat["p50_ms"] <= lat["p99_ms"]


def _trial(round_: int, **figures: float) -> dict[str, Any]:
    return {"round": round_, **figures}


def test_rows_pair_each_round_with_its_own_ceiling() -> None:
    trials = {
        "raw:xack": [_trial(0, drain_msgs_per_s=200_000), _trial(1, drain_msgs_per_s=100_000)],
        "commands:on": [_trial(0, msgs_per_s=60_000), _trial(1, msgs_per_s=30_000)],
        "commands:off": [_trial(0, msgs_per_s=90_000), _trial(1, msgs_per_s=45_000)],
        "peer:batch": [
            _trial(r, msgs_per_s=rate, fill_msgs_per_s=20_000, entry_bytes=170)
            for r, rate in ((0, 50_000), (1, 25_000))
        ],
        "peer:latency-batch": [
            _trial(r, p50_ms=0.4, p90_ms=0.5, p99_ms=p99, max_ms=2.0, achieved_rate=500.0)
            for r, p99 in ((0, 0.9), (1, 1.1))
        ],
    }
    sm = faststream_bench.summary(trials)
    assert sm["peer:batch"]["ratio_to_raw"]["runs"] == [0.25, 0.25]  # paired per round, not median over median
    assert sm["peer:batch"]["framework_on_over_this"]["median"] == pytest.approx(1.2)
    sm["latency:framework"] = {"p99_ms": {"median": 0.8}}
    sm["latency:raw"] = {"p50_ms": {"median": 0.1}, "p99_ms": {"median": 0.25}}
    rows = faststream_bench.rows(sm, {}, 500)
    drain_row, latency_row = rows
    assert "batch subscriber" in drain_row["benchmark"] and drain_row["ratio"].startswith("25%")
    assert "1.20x / 1.80x this" in drain_row["ratio"]  # 60k / 50k, 90k / 50k
    assert latency_row["ok"] is True and "p99 4.0x" in latency_row["ratio"]  # 0.8 < 1.0; 1.0 / 0.25


def test_without_faststream_the_peer_rows_say_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    reason = f"not run: {faststream_bench.INSTALL}"
    monkeypatch.setattr(faststream_bench, "missing", lambda: reason)
    runner = bench_main.Runner("redis://unused", bench_main.QUICK, 1, ["peer"], None)
    runner.run()  # records the reason; runs no trial (the server is never contacted)
    assert runner.errors == {"peer": reason} and not runner.trials
    assert [(r.benchmark, r.result) for r in runner.rows()] == [
        ("peer: FastStream (Redis Streams)", "[yellow]not run: pip install faststream\\[redis][/yellow]")
    ]
    assert "peer" in bench_main.BENCHMARKS
