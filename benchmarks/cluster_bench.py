"""Redis Cluster (#12): one service over 8 partitions, inbox on, 1, 2 and 4 worker processes, single server vs cluster.

    python -m benchmarks --only cluster

Each trial sends a backlog of commands (1,000 keys) to an 8-partition queue, then drains it with
``python -m framework run`` workers (partition ownership as configured, the default), either on
the benchmark's server (``$REDIS_URL`` or the run's embedded Valkey) or on a local 3-master
cluster of embedded Valkey servers started for this benchmark in a temporary directory (same
binary, AOF on) and stopped afterwards. The rate is measured from the first entry consumed to the
last, as in :mod:`benchmarks.ownership_bench`. On one machine the cluster's three servers share
its cores with the workers, so this measures the cost of the cluster client and the spread of
partitions, not the added capacity of more hosts.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import anyio

from benchmarks.drain import DRAIN_TIMEOUT, partition_streams, send_backlog, timed_drain, wait_until, worker_args
from benchmarks.ownership_bench import OWNED
from benchmarks.procs import child
from broker.redis.embedded_cluster import start_cluster
from broker.redis.sync_client import sync_client
from framework.testing import delete_namespace, unique_namespace

__all__ = ["SPREAD", "run", "trial"]

# The ownership benchmark's service and backlog (8 partitions, 1,000 keys, a handler that does nothing).
SPREAD = OWNED


def trial(url: str, n: int, workers: int, label: str) -> dict[str, Any]:
    """Drain ``n`` commands with ``workers`` processes on the server at ``url``; msgs/s from first consumed to last."""
    namespace = unique_namespace("bench-spread")
    r = sync_client(url)
    streams = partition_streams(namespace, SPREAD)

    def left() -> int:
        return sum(int(r.xlen(s)) for s in streams)  # one call per stream: they may live on different nodes

    try:
        anyio.run(functools.partial(send_backlog, url, namespace, SPREAD, n))
        args = worker_args("benchmarks.ownership_bench:owned", url, namespace)
        with contextlib.ExitStack() as stack:
            procs = [
                stack.enter_context(child(f"spread-{label}-{i}", [*args, "--consumer", f"w{i}"], {}, grace=10))
                for i in range(workers)
            ]
            deadline = time.monotonic() + DRAIN_TIMEOUT
            wait_until(lambda: left() < n, procs, deadline, "cluster", poll=0.005)  # the first entry consumed
            first_left, seconds = timed_drain(left, procs, deadline, "cluster", poll=0.01)
        return {"n": n, "workers": workers, "server": label, "msgs_per_s": first_left / seconds}
    finally:
        r.close()
        delete_namespace(url, namespace)


def run(url: str, *, messages: int = 50_000, repeats: int = 1, workers: tuple[int, ...] = (1, 2, 4)) -> dict[str, Any]:
    """Every configuration ``repeats`` times (single server and cluster back to back, order alternating)."""
    home = tempfile.mkdtemp(prefix="framework-bench-cluster-")
    cluster = start_cluster(home, nodes=3)
    try:
        urls = {"single": url, "cluster": cluster.url}
        runs: dict[str, list[float]] = {}
        ratios: dict[int, list[float]] = {w: [] for w in workers}
        for round_ in range(repeats):
            for w in workers:
                order = ("single", "cluster") if round_ % 2 == 0 else ("cluster", "single")
                got = {label: trial(urls[label], messages, w, label)["msgs_per_s"] for label in order}
                for label, rate in got.items():
                    runs.setdefault(f"{label}:{w}", []).append(rate)
                ratios[w].append(got["cluster"] / got["single"])
    finally:
        cluster.stop()
        shutil.rmtree(home, ignore_errors=True)
    return {
        "messages": messages,
        "cores": os.cpu_count(),
        "nodes": 3,
        "runs": runs,
        "medians": {k: statistics.median(v) for k, v in runs.items()},
        "ratio": {str(w): statistics.median(r) for w, r in ratios.items()},
    }


if __name__ == "__main__":  # a quick look without the benchmark runner
    import sys

    import orjson

    print(orjson.dumps(run(sys.argv[1], messages=int(sys.argv[2]) if len(sys.argv) > 2 else 20_000)).decode())
