"""Request/reply (#35): round trips per second and latency next to a raw redis-py request/reply loop, same run.

    python -m benchmarks --only reply                (2,000 round trips per kind; --quick: 500)
    python -m benchmarks.reply_bench URL [N]          (a quick look without the runner)

Both kinds run one replier process and one requester in this process, one request at a time
(a closed loop: the next request leaves when the reply came), then ``CONCURRENT`` requests in
flight at once:

* ``framework``: ``client.request(...)`` to a ``python -m framework run`` worker with default
  settings (inbox on) whose handler returns a dict: the request carries reply-to and deadline
  headers, the reply goes to the client's reply stream after the handler, before the ack;
* ``raw``: the same exchange by hand with redis-py, no guarantees beyond the streams': the
  requester XADDs to a request stream and blocks in XREAD on its reply stream; the replier
  (a process) blocks in XREADGROUP, XADDs the reply and XACKs.

Reported: round trips per second (one at a time, and with ``CONCURRENT`` in flight) and the
p50/p99 round trip of the one-at-a-time loop; ratio = raw rate over framework rate.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
import uuid
from typing import Any

import anyio
import redis

from benchmarks.procs import child
from framework import Client, Context, Service
from framework.testing import delete_namespace, unique_namespace

__all__ = ["run", "trial"]

CONCURRENT = 16
QUEUE = "bench.reply.quote"

pricing = Service("breply")


@pricing.command(QUEUE)
async def quote(q: dict[str, Any], ctx: Context) -> dict[str, Any]:
    """The replier: returns a small dict."""
    return {"sku": q["sku"], "cents": 250}


def _percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p))]


async def _framework_loop(url: str, namespace: str, n: int) -> dict[str, float]:
    async with Client(url, namespace=namespace) as client:
        for _ in range(20):  # warm up (the reply stream, the worker's first reads)
            await client.request(QUEUE, {"sku": "w"}, timeout=30)
        times = []
        started = time.perf_counter()
        for i in range(n):
            t0 = time.perf_counter()
            await client.request(QUEUE, {"sku": str(i)}, timeout=30)
            times.append(time.perf_counter() - t0)
        sequential = n / (time.perf_counter() - started)

        async def worker(count: int) -> None:
            for i in range(count):
                await client.request(QUEUE, {"sku": str(i)}, timeout=30)

        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(CONCURRENT):
                tg.start_soon(worker, n // CONCURRENT)
        concurrent = (n // CONCURRENT) * CONCURRENT / (time.perf_counter() - started)
    return _result(times, sequential, concurrent)


def _result(times: list[float], sequential: float, concurrent: float) -> dict[str, float]:
    return {
        "per_s": sequential,
        "concurrent_per_s": concurrent,
        "p50_ms": statistics.median(times) * 1000,
        "p99_ms": _percentile(times, 0.99) * 1000,
    }


def _framework(url: str, n: int) -> dict[str, float]:
    namespace = unique_namespace("bench-reply")
    args = ["-m", "framework", "run", "benchmarks.reply_bench:pricing", "--redis-url", url]
    args += ["--namespace", namespace, "--log-format", "json", "--consumer", "w"]
    try:
        with child("reply-framework", args) as worker:
            deadline = time.monotonic() + 60
            while b"runtime started" not in worker.log_path.read_bytes():
                worker.check()
                if time.monotonic() > deadline:
                    raise RuntimeError("reply benchmark: the worker did not start within 60 s")
                time.sleep(0.01)
            return anyio.run(functools.partial(_framework_loop, url, namespace, n))
    finally:
        delete_namespace(url, namespace)


def _raw(url: str, n: int) -> dict[str, float]:
    namespace = unique_namespace("bench-reply-raw")
    requests, replies = f"{namespace}:requests", f"{namespace}:replies:{uuid.uuid4().hex}"
    r = redis.Redis.from_url(url)
    r.xgroup_create(requests, "g", id="0", mkstream=True)
    args = ["-m", "benchmarks.reply_bench", "--raw-replier", url, requests]
    try:
        with child("reply-raw", args):
            last = "0"

            def ask(i: int) -> None:
                nonlocal last
                r.xadd(requests, {"sku": str(i), "reply_to": replies, "id": str(i)})
                while True:
                    got = r.xread({replies: last}, count=100, block=5000)
                    if not got:
                        raise RuntimeError("raw replier did not answer within 5 s")
                    for entry_id, fields in got[0][1]:
                        last = entry_id
                        if fields[b"id"] == str(i).encode():
                            return

            for i in range(20):
                ask(i)
            times = []
            started = time.perf_counter()
            for i in range(n):
                t0 = time.perf_counter()
                ask(i)
                times.append(time.perf_counter() - t0)
            sequential = n / (time.perf_counter() - started)
            concurrent = _raw_concurrent(r, requests, replies, n)
            return _result(times, sequential, concurrent)
    finally:
        r.close()
        delete_namespace(url, namespace)


def _raw_concurrent(r: redis.Redis, requests: str, replies: str, n: int) -> float:
    """``CONCURRENT`` requests in flight: a new one leaves as each reply comes (one connection, pipelined)."""
    last = r.xinfo_stream(replies)["last-generated-id"]
    total = (n // CONCURRENT) * CONCURRENT
    started = time.perf_counter()
    sent = 0
    pipe = r.pipeline(transaction=False)
    for _ in range(CONCURRENT):
        pipe.xadd(requests, {"sku": str(sent), "reply_to": replies, "id": str(sent)})
        sent += 1
    pipe.execute()
    done = 0
    while done < total:
        got = r.xread({replies: last}, count=100, block=5000)
        if not got:
            raise RuntimeError("raw replier did not answer within 5 s")
        entries = got[0][1]
        last = entries[-1][0]
        done += len(entries)
        more = min(len(entries), total - sent)
        if more > 0:
            pipe = r.pipeline(transaction=False)
            for _ in range(more):
                pipe.xadd(requests, {"sku": str(sent), "reply_to": replies, "id": str(sent)})
                sent += 1
            pipe.execute()
    return total / (time.perf_counter() - started)


def _raw_replier(url: str, requests: str) -> None:
    """The raw replier process: XREADGROUP, XADD the reply, XACK; until killed."""
    r = redis.Redis.from_url(url)
    while True:
        got = r.xreadgroup("g", "c", {requests: ">"}, count=100, block=1000)
        if not got:
            continue
        pipe = r.pipeline(transaction=False)
        ids = []
        for entry_id, fields in got[0][1]:
            pipe.xadd(fields[b"reply_to"], {"id": fields[b"id"], "sku": fields[b"sku"], "cents": 250})
            ids.append(entry_id)
        pipe.xack(requests, "g", *ids)
        pipe.xdel(requests, *ids)
        pipe.execute()


def trial(url: str, n: int) -> dict[str, dict[str, float]]:
    """One round: raw, then the framework."""
    return {"raw": _raw(url, n), "framework": _framework(url, n)}


def run(url: str, *, requests: int = 2_000, repeats: int = 1) -> dict[str, Any]:
    """``repeats`` rounds; medians of each figure per kind, and raw over framework."""
    trials = [trial(url, requests) for _ in range(repeats)]
    medians = {
        kind: {k: statistics.median(t[kind][k] for t in trials) for k in trials[0][kind]}
        for kind in ("raw", "framework")
    }
    return {
        "requests": requests,
        "concurrent": CONCURRENT,
        "trials": trials,
        "medians": medians,
        "ratio": medians["raw"]["per_s"] / medians["framework"]["per_s"],
        "concurrent_ratio": medians["raw"]["concurrent_per_s"] / medians["framework"]["concurrent_per_s"],
    }


if __name__ == "__main__":
    if sys.argv[1] == "--raw-replier":
        _raw_replier(sys.argv[2], sys.argv[3])
    else:
        import orjson

        n = int(sys.argv[2]) if len(sys.argv) > 2 else 1_000
        print(orjson.dumps(run(sys.argv[1], requests=n)).decode())
