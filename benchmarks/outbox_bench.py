"""Outbox relay throughput: messages per second one relay moves from PostgreSQL to the broker.

    python benchmarks/outbox_bench.py [--redis-url URL] [--database-url URL] [--messages N] [--repeats N]

Without ``--database-url`` (or ``DATABASE_URL``) an embedded PostgreSQL is started; without
``--redis-url`` (or ``REDIS_URL``) an embedded Valkey. Either way the benchmark works in a database
and a namespace of its own and removes both afterwards.

Each run commits N messages (100 keys, ~100-byte JSON bodies, 5,000 per transaction), then times
one :class:`~framework.outbox.OutboxRelay` publishing all of them (``drain``: claim, read, publish
in one pipeline, mark sent, commit, per batch). The median of the runs is reported; the load rate
(producers staging rows) is shown alongside.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from broker import Envelope, connect
from broker.redis import EmbeddedServer
from framework import outbox
from framework.logconfig import configure_logging
from framework.sql import redact_url
from framework.testing import embedded_postgres, temporary_database

TARGET = 20_000
_KEYS = 100
_CHUNK = 5000


async def _clear_namespace(broker: Any) -> None:
    keys = [k async for k in broker.redis.scan_iter(match=f"{broker.namespace}:*", count=1000)]
    for i in range(0, len(keys), 500):
        await broker.redis.delete(*keys[i : i + 500])


async def _load(engine: Any, messages: int) -> float:
    body = b'{"order_id":"%d","note":"' + b"x" * 64 + b'"}'
    started = time.perf_counter()
    for start in range(0, messages, _CHUNK):
        envelopes = [
            Envelope(destination="bench.outbox", kind="event", type="BenchEvent", body=body % i, key=f"k{i % _KEYS}")
            for i in range(start, min(start + _CHUNK, messages))
        ]
        async with engine.begin() as conn:
            await outbox.stage(conn, envelopes)
    return messages / (time.perf_counter() - started)


async def _measure(redis_url: str, database_url: str, messages: int, repeats: int, batch_size: int) -> dict[str, Any]:
    engine = outbox.create_engine(database_url)
    broker = await connect(redis_url, namespace=f"bench-{uuid.uuid4().hex[:12]}")
    try:
        await outbox.create_tables(engine)
        relay_rates: list[float] = []
        load_rates: list[float] = []
        for _ in range(repeats):
            async with engine.begin() as conn:
                await conn.exec_driver_sql("TRUNCATE framework_outbox, framework_outbox_sent")  # our scratch db
            await _clear_namespace(broker)
            load_rates.append(await _load(engine, messages))
            async with engine.connect() as conn:  # fresh statistics, as autovacuum would give a live table
                await conn.execution_options(isolation_level="AUTOCOMMIT")
                await conn.exec_driver_sql("VACUUM ANALYZE framework_outbox")
            relay = outbox.OutboxRelay(engine, broker, batch_size=batch_size)
            started = time.perf_counter()
            settled = await relay.drain()
            elapsed = time.perf_counter() - started
            stored = await broker.redis.xlen(broker.keyspace.partition("bench.outbox", 0).stream)
            if settled != messages or stored != messages:
                raise RuntimeError(f"relay settled {settled} and the stream holds {stored}, expected {messages}")
            relay_rates.append(messages / elapsed)
        async with engine.connect() as conn:
            version = (await conn.exec_driver_sql("SHOW server_version")).scalar()
        return {
            "messages": messages,
            "repeats": repeats,
            "batch_size": batch_size,
            "database": f"PostgreSQL {version}",
            "relay_msgs_per_s": statistics.median(relay_rates),
            "relay_runs": relay_rates,
            "load_msgs_per_s": statistics.median(load_rates),
            "load_runs": load_rates,
            "target_msgs_per_s": TARGET,
            "meets_target": statistics.median(relay_rates) >= TARGET,
        }
    finally:
        await _clear_namespace(broker)
        await broker.close()
        await engine.dispose()


def run(
    redis_url: str,
    database_url: str | None = None,
    *,
    messages: int = 100_000,
    repeats: int = 3,
    batch_size: int = 1000,
) -> dict[str, Any]:
    """Measure one relay's throughput ``repeats`` times over ``messages`` messages; return the results.

    ``database_url`` names a PostgreSQL server (a scratch database is created there and dropped);
    None starts an embedded PostgreSQL. ``relay_msgs_per_s`` is the median.
    """
    with contextlib.ExitStack() as stack:
        server = database_url or stack.enter_context(embedded_postgres())
        scratch = stack.enter_context(temporary_database(server, prefix="outbox_bench"))
        result = anyio.run(_measure, redis_url, scratch, messages, repeats, batch_size)
        result["server"] = "embedded" if database_url is None else redact_url(database_url)
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL"))
    parser.add_argument("--database-url", default=os.environ.get("DATABASE_URL"))
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=1000)
    args = parser.parse_args()
    configure_logging("warning")
    with contextlib.ExitStack() as stack:
        redis_url = args.redis_url
        if not redis_url:
            data_dir = tempfile.mkdtemp(prefix="outbox-bench-valkey-")
            stack.callback(shutil.rmtree, data_dir, ignore_errors=True)
            server = EmbeddedServer(data_dir)
            redis_url = server.ensure_running()
            stack.callback(server.stop)
        r = run(redis_url, args.database_url, messages=args.messages, repeats=args.repeats, batch_size=args.batch_size)
    rows = [
        ("database", f"{r['database']} ({r['server']})"),
        ("messages per run", f"{r['messages']:,} x {r['repeats']} runs, batch {r['batch_size']}"),
        (
            "relay (median)",
            f"{r['relay_msgs_per_s']:,.0f} msg/s   target {TARGET:,}: {'met' if r['meets_target'] else 'MISSED'}",
        ),
        ("relay runs", ", ".join(f"{x:,.0f}" for x in r["relay_runs"])),
        ("load (median)", f"{r['load_msgs_per_s']:,.0f} msg/s (stage, {_CHUNK:,} per transaction)"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
