"""``python -m benchmarks --only dashboard``: the dead-letters page with N dead letters.

Fills one group's DLQ with ``count`` dead letters (default 100,000; pipelined XADDs of entries
shaped as the runtime writes them), serves the dashboard in-process (uvicorn on loopback), and
measures the time to first byte and the weight (HTML bytes; the stylesheet and htmx are static
files fetched once and cached) of the first page, the next page (its cursor), the classes table
the page loads after it is shown (the newest 2,000 entries grouped), a text search (which reads
at most 5,000 entries per page) and a message view, each the median of several loads. Prints
one row per measure.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import anyio
import httpx

from broker import connect
from broker import headers as h
from broker.topology import DestinationSpec

__all__ = ["main", "run_dashboard_bench"]


async def _fill(url: str | None, namespace: str, count: int) -> None:
    broker: Any = await connect(url, namespace=namespace)
    try:
        spec = DestinationSpec(name="bench.dlq", kind="command")
        await broker.declare(spec)
        views = await broker.subscribe(spec, "bench", "earliest")
        key = views[0].keys.dlq
        now = int(time.time() * 1000)
        for start in range(0, count, 5000):
            pipe = broker.redis.pipeline(transaction=False)
            for i in range(start, min(start + 5000, count)):
                fields = {
                    "id": f"msg-{i:08d}",
                    "type": "bench.Failed",
                    "headers": "{}",
                    "body": f'{{"order_id": "o-{i}", "password": "x"}}',
                    h.DLQ_REASON: f"handler failed: ValueError: order {i} not found",
                    h.DLQ_ERROR_TYPE: "builtins.ValueError",
                    h.DLQ_ERROR_MESSAGE: f"order {i} not found",
                    h.DLQ_ATTEMPTS: "3",
                    h.DLQ_HANDLER: "bench.handle",
                    h.DLQ_DEAD_AT: str(now),
                }
                pipe.xadd(key, fields)
            await pipe.execute()
    finally:
        await broker.close()


def run_dashboard_bench(url: str | None, count: int = 100_000, loads: int = 5) -> list[dict[str, Any]]:
    """Rows of (measure, ttfb ms, bytes) for the dead-letters page over ``count`` dead letters."""
    import uuid

    from framework.dashboard import create_app

    namespace = f"bench-dash-{uuid.uuid4().hex[:8]}"
    anyio.run(_fill, url, namespace, count)
    served = Served(create_app(url, namespace))
    rows = []
    try:
        for label, path in (
            ("first page", "/dead-letters"),
            ("next page", "next"),
            ("classes (newest 2,000)", "/dead-letters/classes"),
            ("search 'order 7'", "/dead-letters?q=order+7"),
            ("message view", None),
        ):
            if path == "next":
                page = httpx.get(served.url + "/dead-letters").text
                path = _next_link(page)
            if path is None:
                page = httpx.get(served.url + "/dead-letters").text
                ref = page.split("/dead-letters/message?ref=", 1)[1].split('"', 1)[0]
                path = "/dead-letters/message?ref=" + ref
                assert httpx.get(served.url + path).status_code == 200, "the message view did not open"
            ttfb, size = [], 0
            for _ in range(loads):
                start = time.perf_counter()
                with httpx.stream("GET", served.url + path) as r:
                    chunks = r.iter_raw()
                    first = next(chunks, b"")
                    ttfb.append((time.perf_counter() - start) * 1000)
                    size = len(first) + sum(len(c) for c in chunks)
            rows.append({"measure": label, "dead_letters": count, "ttfb_ms": statistics.median(ttfb), "bytes": size})
    finally:
        served.close()
        anyio.run(_drop, url, namespace)
    for row in rows:
        print(
            f"dashboard {row['measure']:<20} {row['dead_letters']:>8,} dead letters  "
            f"ttfb {row['ttfb_ms']:8.1f} ms  page {row['bytes'] / 1024:7.1f} KiB"
        )
    return rows


class Served:
    """The app served by uvicorn on a free loopback port, in a thread, until :meth:`close`."""

    def __init__(self, app: Any) -> None:
        import socket
        import threading

        import uvicorn

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the dashboard did not start")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def _next_link(page: str) -> str:
    """The page's "next page" link (HTML-unescaped)."""
    import html

    return "/dead-letters" + html.unescape(page.split('id="next"', 1)[0].rsplit('<a href="', 1)[1].split('"', 1)[0])


async def _drop(url: str | None, namespace: str) -> None:
    broker: Any = await connect(url, namespace=namespace)
    try:
        keys = [k async for k in broker.redis.scan_iter(match=f"{namespace}:*")]
        for i in range(0, len(keys), 500):
            await broker.redis.delete(*keys[i : i + 500])
    finally:
        await broker.close()


def main(argv: list[str]) -> int:
    """``--only dashboard [--quick] [--count N]``: fill, serve, measure (``$REDIS_URL``, else the embedded Valkey)."""
    import argparse
    import os

    p = argparse.ArgumentParser(prog="python -m benchmarks --only dashboard")
    p.add_argument("--only", nargs="+")
    p.add_argument("--quick", action="store_true", help="1,000 dead letters instead of 100,000")
    p.add_argument("--count", type=int, default=None)
    args, _ = p.parse_known_args(argv)
    count = args.count or (1_000 if args.quick else 100_000)
    url = os.environ.get("BROKER_URL") or os.environ.get("REDIS_URL")  # else the shared embedded Valkey
    run_dashboard_bench(url, count)
    return 0
