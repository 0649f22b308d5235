"""Runtime benchmarks: one worker process against the raw redis-py ceiling measured beside it.

Each trial runs in a fresh namespace (deleted afterwards) and returns plain numbers;
``python -m benchmarks`` repeats them and reports medians. This module gathers the trials; they live
by job in:

* :mod:`benchmarks.raw_bench`: :func:`raw_ceiling` (pipelined XADD, XREADGROUP COUNT 500 + XACK per
  batch, or XACK+XDEL) and :func:`raw_latency`, plain redis-py with no framework in the path;
* :mod:`benchmarks.framework_bench`: :func:`commands` and :func:`events` (a backlog drained by ONE
  ``python -m framework run`` worker) and :func:`latency` (publish to handler start at a fixed rate);
* :mod:`benchmarks.memory_bench`: :func:`memory`, peak RSS of the worker draining a pre-filled backlog;
* :mod:`benchmarks.streams` and :mod:`benchmarks.paced`: the redis-py client, the group polling that
  times a drain, percentiles, and the paced producer process of the latency trials.

Throughput runs from the first handler start (taken in the worker) to the moment the benchmark
sees every entry acknowledged (XINFO GROUPS pending 0, polled every millisecond once the worker
reported its last message), so worker start-up is left out and the final acks are counted in.
"""

from __future__ import annotations

from benchmarks.framework_bench import FRAMEWORK, commands, events, latency
from benchmarks.memory_bench import memory
from benchmarks.paced import run_producer
from benchmarks.raw_bench import raw_ceiling, raw_latency
from benchmarks.streams import FILL_BATCH, Progress, percentile

__all__ = [
    "FILL_BATCH",
    "FRAMEWORK",
    "Progress",
    "commands",
    "events",
    "latency",
    "memory",
    "percentile",
    "raw_ceiling",
    "raw_latency",
    "run_producer",
]
