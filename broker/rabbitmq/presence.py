"""The RabbitMQ broker's ``workers`` role: worker processes' heartbeats kept beside the server
(:class:`~broker.rabbitmq.side.SideWorkers`; the Redis inbox's server, under the keys the Redis transport
uses), so ``framework status`` and the dashboard show live workers with their last-seen time on RabbitMQ
as on Redis. Without it (``?inbox=none``) they fall back to the server's consumer counts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from broker.operators import WorkerBeat
from broker.rabbitmq.ownership import Ownership
from broker.rabbitmq.side import SideWorkers

__all__ = ["Presence"]


class Presence(Ownership):
    """The ``workers`` capability (see the module's docstring)."""

    side_workers: SideWorkers | None = None

    def _workers(self) -> SideWorkers:
        if self.side_workers is None:
            raise TypeError("the rabbitmq transport keeps no worker heartbeats here (the broker URL says ?inbox=none)")
        return self.side_workers

    async def beat_worker(
        self, name: str, groups: Sequence[tuple[str, str]], ttl_ms: int, info: Mapping[str, str]
    ) -> None:
        """Record that worker ``name`` runs now, consuming ``groups``; it beats again within ``ttl_ms``."""
        await self._workers().beat_worker(name, groups, ttl_ms, info)

    async def leave_worker(self, name: str) -> None:
        """Mark worker ``name`` gone now (a graceful stop)."""
        await self._workers().leave_worker(name)

    async def workers(self) -> list[WorkerBeat]:
        """Every worker recorded (live or gone for less than an hour), by name."""
        return await self._workers().workers()
