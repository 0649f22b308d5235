"""The redis-py side every runtime trial shares: the client, the consumer-group polling that times
a drain, and percentiles.

The client reads replies the way the broker does (RESP2, XREADGROUP and XINFO GROUPS unparsed), so
the raw ceiling and the framework are measured on equal terms.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson
import redis

from benchmarks.bench_services import done_key
from benchmarks.procs import Child

__all__ = ["FILL_BATCH", "Progress", "group_rows", "percentile", "quiet", "raw_client", "wait_done", "wait_settled"]

FILL_BATCH = 5000  # messages per pipeline when filling a stream
Progress = Callable[[str], None]


def quiet(_: str) -> None:
    """The default progress callback: says nothing."""


def raw_client(url: str) -> redis.Redis:
    """A sync redis-py client that reads replies as the broker does (RESP2, streams left unparsed)."""
    client = redis.Redis.from_url(url, protocol=2)  # RESP2 like the broker (redis-py 8 defaults to RESP3)
    for command in ("XREADGROUP", "XINFO GROUPS"):  # like the broker: no per-entry dicts from redis-py
        client.set_response_callback(command, lambda response, **_: response)
    return client


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0..100) of already sorted values."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return float(sorted_values[rank - 1])


def group_rows(client: redis.Redis, stream: str) -> list[dict[str, Any]]:
    """XINFO GROUPS of ``stream`` as one dict per group (no group, no stream: an empty list)."""
    try:
        reply = client.execute_command("XINFO GROUPS", stream)
    except redis.ResponseError:
        return []
    rows = []
    for row in reply:
        items = row.items() if isinstance(row, dict) else zip(row[::2], row[1::2], strict=True)
        rows.append({(k.decode() if isinstance(k, bytes) else k): v for k, v in items})
    return rows


def wait_done(
    client: redis.Redis,
    namespace: str,
    worker: Child,
    *,
    stream: str,
    total: int,
    timeout: float,
    label: str,
    progress: Progress,
) -> dict[str, Any]:
    """Block until the worker reports its last message; report progress from the groups meanwhile."""
    deadline = time.monotonic() + timeout
    last_report = time.monotonic()
    while True:
        reply = client.blpop([done_key(namespace)], timeout=1)
        if reply is not None:
            return dict(orjson.loads(reply[1]))
        worker.check()
        now = time.monotonic()
        if now > deadline:
            raise RuntimeError(f"{label}: not done after {timeout:.0f}s; the worker's log ends:\n{worker.log_tail()}")
        if now - last_report >= 5:
            last_report = now
            rows = group_rows(client, stream)
            done = sum(int(r.get("entries-read") or 0) - int(r.get("pending") or 0) for r in rows)
            progress(f"{label}: {done:,}/{total:,} processed")


def wait_settled(client: redis.Redis, stream: str, groups: int, timeout: float = 30.0) -> int:
    """Poll XINFO GROUPS every millisecond until ``groups`` groups have nothing pending; return time_ns."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = group_rows(client, stream)
        if len(rows) >= groups and all(int(r["pending"]) == 0 for r in rows):
            return time.time_ns()
        time.sleep(0.001)
    raise RuntimeError(f"entries of {stream} still pending {timeout:.0f}s after the worker processed them all")
