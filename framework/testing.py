"""Testing services against the real server: run services in-process until idle, no mocks.

Importable without pytest (the demo and benchmarks use it). The pytest fixtures
(``framework_redis_url``, ``framework_namespace``) live in :mod:`framework.pytest_plugin`, which
pytest loads by itself (entry point ``framework``). :class:`ServiceHarness` runs services::

    async with ServiceHarness([billing], url=framework_redis_url, namespace=framework_namespace) as h:
        await h.client.publish("orders.placed", OrderPlaced("o-1", 100))
        await h.run_until_idle()
        assert [e.type for e in await h.messages("payments.captured")] == ["PaymentCaptured"]
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import redis

from broker import EmbeddedServer, Envelope, RedisBroker, connect
from broker.codec import decode_fields
from framework.client import Client
from framework.runtime import Runtime
from framework.service import Service
from framework.settings import RuntimeSettings

__all__ = [
    "ServiceHarness",
    "delete_namespace",
    "embedded_server",
    "unique_namespace",
]

TEST_SETTINGS = RuntimeSettings(
    block_ms=200, ack_interval=0.001, visibility_timeout=5.0, retry_interval=0.05, shutdown_timeout=5.0
)
"""Settings that keep tests quick: short blocking reads, quick retries and claims."""


def unique_namespace(prefix: str = "test") -> str:
    """A key prefix no other run uses."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def delete_namespace(url: str, namespace: str) -> int:
    """Delete every key under ``namespace`` (and only those); return how many."""
    client = redis.Redis.from_url(url)
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


class ServiceHarness:
    """Runs services in this process against a real broker, with helpers to observe them."""

    def __init__(
        self,
        services: Sequence[Service],
        *,
        url: str | None = None,
        namespace: str | None = None,
        settings: RuntimeSettings | None = None,
    ) -> None:
        self.services = list(services)
        self.url = url
        self.namespace = namespace or unique_namespace()
        self.settings = settings or TEST_SETTINGS
        self.runtime: Runtime | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._done: anyio.Event | None = None  # created by start()
        self.broker: RedisBroker
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
        runtime = Runtime(self.services, broker=self.broker, settings=self.settings)
        self._done = anyio.Event()
        await self._tg.start(self._run_runtime, runtime, self._done)
        self.runtime = runtime
        return runtime

    @staticmethod
    async def _run_runtime(
        runtime: Runtime, done: anyio.Event, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
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
        if spec is None:
            return []
        out: list[Envelope] = []
        for p in range(spec.partitions):
            stream = self.broker.keyspace.partition(destination, p).stream
            for _, flat in await self.broker.redis.execute_command("XRANGE", stream, "-", "+"):
                fields = dict(zip(flat[::2], flat[1::2], strict=True))
                out.append(decode_fields(fields, spec.name, spec.kind))
        return out

    def stats(self) -> dict[str, Any]:
        """Counters per handler of the running runtime."""
        return self.runtime.stats() if self.runtime is not None else {}
