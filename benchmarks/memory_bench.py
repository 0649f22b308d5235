"""Memory: peak RSS of one framework worker draining a pre-filled backlog, and the server memory
its inbox holds afterwards (issue #15).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import anyio
import redis

from benchmarks.bench_services import COMMANDS, body
from benchmarks.framework_bench import declare, drain
from benchmarks.streams import Progress, quiet, raw_client
from broker import Envelope
from broker.codec import encode_fields
from framework.testing import delete_namespace, unique_namespace

__all__ = ["memory"]


def _fill_queue(url: str, namespace: str, n: int, progress: Progress) -> float:
    """XADD ``n`` commands to the benchmark queue with raw pipelines, in the framework's field layout."""
    anyio.run(functools.partial(declare, url, namespace, COMMANDS.spec()))
    client = redis.Redis.from_url(url, protocol=2)
    stream = f"{namespace}:{{{COMMANDS.name}:0}}"
    started = time.perf_counter()
    try:
        pipe = client.pipeline(transaction=False)
        for i in range(n):
            env = Envelope(destination=COMMANDS.name, kind="command", type="BenchMessage", body=body(i, time.time_ns()))
            pipe.execute_command("XADD", stream, "*", *encode_fields(env))
            if len(pipe) >= 10_000:
                pipe.execute()
                if (i + 1) % 200_000 == 0:
                    progress(f"memory: filled {i + 1:,}/{n:,}")
        pipe.execute()
    finally:
        client.close()
    return n / (time.perf_counter() - started)


def _inbox_bytes(client: redis.Redis, inbox: str) -> int:
    """Server bytes of a group's inbox: the zset and every bucket key (MEMORY USAGE of each, plus
    about 56 bytes per key for its keyspace and expiry entries, which MEMORY USAGE leaves out)."""
    total = 0
    for key in [inbox, *client.scan_iter(f"{inbox}:*", count=1000)]:
        used = client.memory_usage(key, samples=0)
        if used:
            total += int(used) + 56
    return total


def memory(url: str, backlog: int, *, progress: Progress = quiet) -> dict[str, Any]:
    """Peak RSS of one worker (inbox on) draining a pre-filled backlog of ``backlog`` commands.

    Also reports the server memory the group's inbox holds afterwards (one record per message id,
    kept for the dedup window) and what one remembered id costs (issue #15's target: <= 32 bytes).
    """
    namespace = unique_namespace("bench")
    client = raw_client(url)
    label = f"memory ({backlog:,} backlog)"
    try:
        fill_rate = _fill_queue(url, namespace, backlog, progress)
        progress(f"{label}: filled at {fill_rate:,.0f}/s; draining with one worker, sampling RSS every 0.2s")
        stream = f"{namespace}:{{{COMMANDS.name}:0}}"
        result = drain(url, namespace, "commands", n=backlog, handlers=1, stream=stream, label=label, progress=progress)
        return {
            "backlog": backlog,
            "peak_rss_mib": result["peak_rss_mib"],
            # peak RSS in the first and the second half of the drain: growth over time shows here
            "first_half_rss_mib": result["halves_rss_mib"][0],
            "second_half_rss_mib": result["halves_rss_mib"][1],
            "msgs_per_s": backlog / result["seconds"],
            "fill_msgs_per_s": fill_rate,
            "server_inbox_mib": (inbox := _inbox_bytes(client, f"{stream}:g:bench-commands:inbox")) / 2**20,
            "inbox_bytes_per_id": inbox / backlog,
        }
    finally:
        client.close()
        delete_namespace(url, namespace)
