"""Run your services as worker processes while faults hit them, then check nothing was lost or doubled.

:class:`Chaos` puts a TCP proxy between the workers and the broker (so their connections can be
reset), starts workers through a :class:`~framework.faults.workers.WorkerPool`, and injects:

* :meth:`~Chaos.kill`: SIGKILL (no drain, no acks: what it held is redelivered to the others);
* :meth:`~Chaos.pause`: SIGSTOP past the partition lease, then SIGCONT (its partitions move; its
  late acks are fenced off);
* :meth:`~Chaos.reset_connections`: every worker's broker connection closed abruptly (an RST);
* :meth:`~Chaos.duplicate`: messages already stored on a destination published again *with their
  ids*, as a producer retry or an at-least-once relay would.

:func:`exactly_once` then compares the effects your handlers recorded (one entry per application,
read from your database or Redis) with the messages you sent: it names every message lost, applied
twice, or applied without being sent.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

import anyio
import attrs

from broker import connect
from broker.capabilities import as_introspection
from framework.faults.netproxy import NetProxy
from framework.faults.workers import WorkerPool

__all__ = ["Chaos", "ExactlyOnce", "exactly_once"]


@attrs.frozen
class ExactlyOnce:
    """How the applied effects compare with what was sent."""

    expected: int
    applied: int
    lost: tuple[str, ...]  # sent, never applied
    doubled: tuple[str, ...]  # applied more than once
    unexpected: tuple[str, ...]  # applied, never sent

    @property
    def ok(self) -> bool:
        return not (self.lost or self.doubled or self.unexpected)

    def check(self) -> None:
        """Raise AssertionError naming (up to ten of) the lost, doubled and unexpected ids."""
        if not self.ok:
            raise AssertionError(
                f"not exactly once: {len(self.lost)} lost {list(self.lost[:10])}, "
                f"{len(self.doubled)} applied twice or more {list(self.doubled[:10])}, "
                f"{len(self.unexpected)} never sent {list(self.unexpected[:10])} "
                f"({self.applied} effects for {self.expected} messages)"
            )


def exactly_once(expected: Iterable[str], applied: Iterable[str]) -> ExactlyOnce:
    """Compare the ids of the messages sent with the ids of the effects applied (one per application)."""
    want = set(expected)
    seen = Counter(applied)
    return ExactlyOnce(
        expected=len(want),
        applied=sum(seen.values()),
        lost=tuple(sorted(want - set(seen))),
        doubled=tuple(sorted(k for k, n in seen.items() if n > 1)),
        unexpected=tuple(sorted(set(seen) - want)),
    )


class Chaos:
    """Worker processes behind a resettable connection, and the faults; see the module docstring.

    ``env`` is the workers' environment (default: this process's), to which the proxied broker URL
    and ``namespace`` are added; logs go to ``logs``. Use it as a context manager: leaving it stops
    the workers and the proxy."""

    def __init__(self, broker_url: str, namespace: str, logs: Path, env: Mapping[str, str] | None = None) -> None:
        self.broker_url = broker_url
        self.namespace = namespace
        self.proxy = NetProxy.for_url(broker_url)  # started
        worker_env = dict(os.environ if env is None else env)
        for name in ("BROKER_URL", "REDIS_URL"):
            worker_env.pop(name, None)
        worker_env.update(REDIS_URL=self.proxy.url(broker_url), FRAMEWORK_NAMESPACE=namespace)
        self.pool = WorkerPool(worker_env, logs)

    def start(self, target: str, name: str, *extra: str, env: Mapping[str, str] | None = None) -> None:
        """Start a worker (``framework run target --consumer name *extra``) connected through the proxy."""
        self.pool.start(target, name, *extra, env=env)

    def kill(self, name: str) -> None:
        """SIGKILL a worker."""
        self.pool.kill(name)

    def pause(self, name: str, seconds: float) -> None:
        """SIGSTOP a worker for ``seconds`` (longer than its ``--lease-ttl`` to move its partitions)."""
        self.pool.pause(name, seconds)

    def reset_connections(self) -> int:
        """Close every worker's broker connection abruptly; return how many were open."""
        return self.proxy.reset_all()

    def duplicate(self, destination: str, count: int | None = None) -> int:
        """Publish the first ``count`` (default all) messages stored on ``destination`` again, same ids."""

        async def go() -> int:
            broker = await connect(self.broker_url, namespace=self.namespace)
            try:
                spec = await broker.get_destination(destination)
                if spec is None:
                    raise LookupError(f"no destination {destination!r} in namespace {self.namespace!r}")
                stored = await as_introspection(broker).stored_messages(spec)
                again = stored[:count] if count is not None else stored
                if again:
                    await broker.publish(again)
                return len(again)
            finally:
                await broker.close()

        return anyio.run(go)

    def close(self) -> None:
        """Stop the workers (SIGTERM, then SIGKILL) and the proxy."""
        try:
            self.pool.stop_all(timeout=15)
        finally:
            self.proxy.close()

    def __enter__(self) -> Chaos:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
