"""A worker process's heartbeat: who runs now, for ``framework status`` and the dashboard.

Every ``heartbeat_interval`` (a third of ``lease_ttl``) the process records, in the transport's
``workers`` capability (:class:`broker.operators.WorkerRegistry`), its consumer name, the
(destination, group) pairs it consumes, its host, pid and services. It is shown as gone once a
``lease_ttl`` passes without a beat (killed), and leaves at once on a graceful stop.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Sequence

import anyio

from broker import Broker
from broker.operators import WORKERS, as_workers
from framework.logs import get_logger
from framework.runtime.supervisor import is_connection_error

__all__ = ["Presence"]

log = get_logger("framework.runtime.presence")


class Presence:
    """Beats this process's heartbeat until cancelled; :meth:`leave` on a graceful stop."""

    def __init__(
        self,
        broker: Broker,
        name: str,
        groups: Callable[[], Sequence[tuple[str, str]]],
        ttl: float,
        services: Sequence[str],
    ) -> None:
        """``groups`` says, at each beat, the (destination, group) pairs consumed (pattern
        subscriptions add topics while the worker runs)."""
        self.registry = as_workers(broker) if WORKERS in broker.capabilities else None
        self.name = name
        self.groups = groups
        self.ttl_ms = int(ttl * 1000)
        self.interval = ttl / 3
        self.info = {
            "host": socket.gethostname(),
            "pid": str(os.getpid()),
            "services": ",".join(services),
            "started": str(int(time.time() * 1000)),
        }

    async def run(self) -> None:
        """Beat every interval; a failed beat is logged and tried again (the worker goes on)."""
        if self.registry is None:
            return
        while True:
            try:
                await self.registry.beat_worker(self.name, sorted(set(self.groups())), self.ttl_ms, self.info)
            except Exception as exc:
                if not is_connection_error(exc):
                    raise
                log.debug("heartbeat not recorded", error=str(exc))
            await anyio.sleep(self.interval)

    async def leave(self, timeout: float = 2.0) -> None:
        """Say this worker stopped, within ``timeout`` s (best effort: a beat not removed lapses by itself)."""
        if self.registry is None:
            return
        with anyio.move_on_after(timeout, shield=True):
            try:
                await self.registry.leave_worker(self.name)
            except Exception as exc:
                if not is_connection_error(exc):
                    raise
