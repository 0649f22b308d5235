"""The demo's running shop: the servers, the worker processes, the outbox relay and the HTTP API."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import anyio
import attrs

from broker import redact, resolve_url
from framework.faults import WorkerPool, free_port, wait_for
from framework.testing import delete_namespace

LEASE_TTL = 4.0  # billing's and inventory's partition leases (seconds; the default, 5, elsewhere)
FULFILMENT_TIMEOUT = 12.0  # seconds shipping waits for payment and stock before cancelling

WORKERS = {  # consumer name -> the service it runs; two billing and two inventory workers
    "orders-1": "example_services.shop.orders:orders",
    "billing-1": "example_services.shop.billing:billing",
    "billing-2": "example_services.shop.billing:billing",
    "inventory-1": "example_services.shop.inventory:inventory",
    "inventory-2": "example_services.shop.inventory:inventory",
    "shipping-1": "example_services.shop.shipping:shipping",
    "notifications-1": "example_services.shop.notifications:notifications",
}


class DemoError(Exception):
    """Something the demo needs is missing or broken (one line: what and what to do)."""


@attrs.define
class Stack:
    """Where everything runs; see :func:`running_stack`."""

    broker_url: str
    database_url: str
    namespace: str
    logs: Path
    pool: WorkerPool
    api: str  # http://127.0.0.1:<port>
    embedded_broker: bool
    database_note: str


@contextlib.contextmanager
def _database(url: str | None) -> Iterator[tuple[str, str]]:
    """A fresh PostgreSQL database for this run: on ``url``'s server, else on an embedded one."""
    from framework.sql import DatabaseUnavailable, resolve_url
    from framework.testing import embedded_postgres, temporary_database

    if url:
        if resolve_url(url).get_backend_name() != "postgresql":
            raise DemoError(
                f"--database-url must be a PostgreSQL URL (the demo creates its own database there), not {url!r}"
            )
        with temporary_database(url, prefix="shop_demo") as fresh:
            yield fresh, "a fresh database on the server of --database-url, dropped at the end"
        return
    try:
        with embedded_postgres() as server:
            yield server, "embedded PostgreSQL in a temporary directory, deleted at the end"
    except DatabaseUnavailable as exc:
        raise DemoError(f"{exc} (or pass --database-url postgresql://...)") from None


async def _prepare(database_url: str, stock: dict[str, int]) -> None:
    from example_services.shop import db

    engine = db.open_engine(database_url)
    try:
        await db.prepare(engine)
        async with engine.begin() as conn:
            await db.set_stock(conn, stock)
    finally:
        await engine.dispose()


def _api_ready(api: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api}/orders", timeout=1) as r:
            return bool(r.status == 200)
    except OSError:
        return False


@contextlib.contextmanager
def running_stack(
    *, broker_url: str | None, database_url: str | None, namespace: str, stock: dict[str, int], otlp: str | None
) -> Iterator[Stack]:
    """Start the servers, the tables, seven workers, the relay and the API; stop them all on exit."""
    embedded = not (broker_url or os.environ.get("BROKER_URL") or os.environ.get("REDIS_URL"))
    url = resolve_url(broker_url)  # starts the embedded Valkey when no URL is given
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise DemoError(f"the demo runs on Redis or Valkey; {redact(url)} is not a redis:// URL")
    delete_namespace(url, namespace)  # the demo's own keys only
    logs = Path(tempfile.mkdtemp(prefix="shop-demo-"))
    with _database(database_url) as db_url:
        database, note = db_url
        anyio.run(_prepare, database, stock)
        env = {
            **os.environ,
            "REDIS_URL": url,
            "DATABASE_URL": database,
            "FRAMEWORK_NAMESPACE": namespace,
            "SHOP_FULFILMENT_TIMEOUT": str(FULFILMENT_TIMEOUT),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(Path.cwd()), os.environ.get("PYTHONPATH", "")])),
        }
        env.pop("BROKER_URL", None)
        if otlp:
            env["OTEL_EXPORTER_OTLP_ENDPOINT"] = otlp
        pool = WorkerPool(env, logs)
        api = f"http://127.0.0.1:{free_port()}"
        try:
            common = ("--visibility-timeout", "10", "--shutdown-timeout", "10")
            for name, target in WORKERS.items():
                faulted = name.startswith(("billing", "inventory"))
                pool.start(target, name, *common, *(("--lease-ttl", str(LEASE_TTL)) if faulted else ()))
            pool.spawn("relay", [sys.executable, "-m", "framework", "outbox", "relay", "--poll-interval", "0.5"])
            port = api.rsplit(":", 1)[1]
            pool.spawn(
                "api",
                [
                    sys.executable,
                    "-m",
                    "uvicorn",
                    "example_services.shop.orders:app",
                    "--port",
                    port,
                    "--log-level",
                    "warning",
                    "--no-access-log",
                ],
            )
            started = time.monotonic()
            try:
                wait_for(lambda: _api_ready(api) or _died(pool), 60, "the HTTP API to answer")
                wait_for(lambda: _subscribed(pool) or _died(pool), 60, "the workers to start")
            except TimeoutError as exc:
                raise DemoError(f"{exc} (logs in {logs})") from None
            if dead := _died(pool):
                raise DemoError(f"{dead} exited at start: see {logs / (dead + '.log')}")
            yield Stack(
                url,
                database,
                namespace,
                logs,
                pool,
                api,
                embedded,
                f"{note} (ready in {time.monotonic() - started:.1f} s)",
            )
        finally:
            pool.stop_all(timeout=15)


def _died(pool: WorkerPool) -> str:
    return next((n for n in pool.procs if not pool.alive(n)), "")


def _subscribed(pool: WorkerPool) -> bool:
    """Every worker logged that its runtime started."""
    started = {e["worker"] for e in pool.events() if str(e.get("event", "")).startswith("runtime started")}
    return set(WORKERS) <= started
