"""Paced load for the latency trials: a producer process at a fixed rate, the wait for a consumer,
and the summary of the publish-to-handler samples the consumer recorded.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import orjson
import redis

from benchmarks.bench_services import latency_key
from benchmarks.cpu_watch import CpuWatch
from benchmarks.procs import Child, child
from benchmarks.streams import group_rows, percentile

__all__ = ["CPU_SAMPLE_S", "cpu_per_message", "latency_summary", "produce", "run_producer", "wait_consumer"]

CPU_SAMPLE_S = 0.02
"""How often a latency trial samples its consumer's (and the server's) CPU time."""


def wait_consumer(client: redis.Redis, stream: str, worker: Child, timeout: float = 60.0) -> None:
    """Wait until a consumer has read from ``stream`` (the group exists and the fetch loop runs)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(int(r.get("consumers") or 0) > 0 for r in group_rows(client, stream)):
            return
        worker.check()
        time.sleep(0.05)
    raise RuntimeError(f"no consumer read {stream} within {timeout:.0f}s; log ends:\n{worker.log_tail()}")


def latency_summary(client: redis.Redis, namespace: str, skip: int, count: int) -> dict[str, Any]:
    """Percentiles of the latency samples past the first ``skip`` (the warm-up), in ms."""
    raw = client.lrange(latency_key(namespace), 0, -1)
    samples = sorted(int(v) / 1e6 for s, v in (x.split(b":") for x in raw) if int(s) >= skip)
    if len(samples) != count - skip:
        raise RuntimeError(f"got {len(samples)} latency samples, expected {count - skip}")
    return {
        "samples": len(samples),
        "p50_ms": percentile(samples, 50),
        "p90_ms": percentile(samples, 90),
        "p99_ms": percentile(samples, 99),
        "max_ms": samples[-1],
        "mean_ms": sum(samples) / len(samples),
    }


def produce(mode: str, url: str, namespace: str, rate: float, count: int, consumer: Child, seconds: float) -> float:
    """Run ``python -m benchmarks.roles produce`` in ``mode`` (``framework`` or ``raw``); its achieved rate."""
    args = ["-m", "benchmarks.roles", "produce", "--mode", mode, "--url", url, "--namespace", namespace]
    return run_producer(f"producer-{mode}", [*args, "--rate", str(rate), "--count", str(count)], consumer, seconds)


def run_producer(name: str, args: Sequence[str], consumer: Child, seconds: float) -> float:
    """Run a paced producer process to its end (checking ``consumer`` meanwhile); its achieved rate,
    from the JSON line it prints last."""
    with child(name, list(args), finishes=True) as producer:
        deadline = time.monotonic() + seconds + 60
        while producer.alive():
            consumer.check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the producer did not finish; its log ends:\n{producer.log_tail()}")
            time.sleep(0.1)
        if producer.proc.returncode != 0:
            raise RuntimeError(f"the producer failed; its log ends:\n{producer.log_tail()}")
        last = producer.log_tail(500).strip().splitlines()[-1]
    return float(orjson.loads(last)["achieved_rate"])


def cpu_per_message(watch: CpuWatch, done: Mapping[str, Any], count: int) -> dict[str, float]:
    """The consumer's CPU µs per message under the paced load (all its threads, from its first
    handler start to its last, as its ``done`` summary says), and the server's over the same span
    when it was sampled (that includes serving the producer's publishes); nothing when the span
    was not sampled."""
    first, last = int(done["first_ns"]), int(done["last_ns"])
    n = max(1, count - 1)
    try:
        out = {"cpu_us_per_msg": watch.between(first, last) * 1e6 / n}
        server = watch.server_between(first, last)
    except RuntimeError:  # not sampled around the span (a consumer gone too soon): no figure, the trial stands
        return {}
    if server is not None:
        out["server_cpu_us_per_msg"] = server * 1e6 / n
    return out
