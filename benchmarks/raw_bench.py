"""The raw redis-py ceiling the framework is measured against, no framework in the path.

* :func:`raw_ceiling`: sync redis-py. Fill ``n`` entries with pipelined XADD (the framework's
  field layout: id, type, ~60-byte JSON body, ts), then drain them with XREADGROUP COUNT 500 and
  one XACK per batch (variant ``delete``: XACK and XDEL in one pipeline per batch, as the
  framework's queues delete acknowledged entries). Replies are left unparsed, as the broker does.
* :func:`raw_latency`: XADD from a paced producer process, XREADGROUP BLOCK in a consumer process.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.cpu_watch import CpuWatch
from benchmarks.paced import CPU_SAMPLE_S, cpu_per_message, latency_summary, produce, wait_consumer
from benchmarks.procs import child
from benchmarks.roles import RAW_GROUP, raw_stream, raw_xadd
from benchmarks.streams import FILL_BATCH, Progress, quiet, raw_client, wait_done
from framework.testing import delete_namespace, unique_namespace

__all__ = ["raw_ceiling", "raw_latency"]


def raw_ceiling(url: str, n: int, *, delete: bool = False, progress: Progress = quiet) -> dict[str, Any]:
    """Fill ``n`` entries with pipelined XADD, drain with XREADGROUP COUNT 500 + one XACK per batch."""
    namespace = unique_namespace("bench")
    client = raw_client(url)
    stream = f"{namespace}:raw"
    try:
        client.xgroup_create(stream, "g", id="0", mkstream=True)
        started = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for i in range(n):
            pipe.execute_command(*raw_xadd(stream, i))
            if len(pipe) >= FILL_BATCH:
                pipe.execute()
        pipe.execute()
        fill_s = time.perf_counter() - started
        progress(f"raw: filled {n:,} entries in {fill_s:.1f}s; draining{' (XACK+XDEL)' if delete else ''}")
        drained = 0
        started = time.perf_counter()
        while True:
            reply = client.execute_command("XREADGROUP", "GROUP", "g", "c", "COUNT", 500, "STREAMS", stream, ">")
            if not reply or not reply[0][1]:
                break
            ids = [entry_id for entry_id, _ in reply[0][1]]
            if delete:
                ack = client.pipeline(transaction=False)
                ack.xack(stream, "g", *ids)
                ack.xdel(stream, *ids)
                ack.execute()
            else:
                client.xack(stream, "g", *ids)
            drained += len(ids)
        drain_s = time.perf_counter() - started
        if drained != n:
            raise RuntimeError(f"raw drain read {drained} entries, expected {n}")
        return {"n": n, "fill_msgs_per_s": n / fill_s, "drain_msgs_per_s": n / drain_s}
    finally:
        client.close()
        delete_namespace(url, namespace)


def raw_latency(
    url: str,
    *,
    rate: float = 500.0,
    seconds: float = 10.0,
    warmup: float = 1.0,
    progress: Progress = quiet,
    server_pid: int | None = None,
) -> dict[str, Any]:
    """Latency with plain redis-py: XADD from a producer process, XREADGROUP BLOCK in a consumer
    process; its CPU per message meanwhile (the server's too, with ``server_pid``)."""
    namespace = unique_namespace("bench")
    skip = int(rate * warmup)
    count = skip + int(rate * seconds)
    client = raw_client(url)
    stream = raw_stream(namespace)
    try:
        client.xgroup_create(stream, RAW_GROUP, id="0", mkstream=True)
        args = ["-m", "benchmarks.roles", "raw-consume", "--url", url, "--namespace", namespace, "--count", str(count)]
        with child("raw-consumer", args, finishes=True) as consumer:
            wait_consumer(client, stream, consumer)
            progress(f"raw latency: producing {count:,} entries at {rate:,.0f}/s")
            with CpuWatch(CPU_SAMPLE_S, server_pid, pid=consumer.pid) as watch:
                achieved = produce("raw", url, namespace, rate, count, consumer, seconds + warmup)
                done = wait_done(
                    client,
                    namespace,
                    consumer,
                    stream=stream,
                    total=count,
                    timeout=60,
                    label="raw latency",
                    progress=progress,
                )
        summary = latency_summary(client, namespace, skip, count)
        return {"rate": rate, "achieved_rate": achieved, **summary, **cpu_per_message(watch, done, count)}
    finally:
        client.close()
        delete_namespace(url, namespace)
