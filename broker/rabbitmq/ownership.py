"""The RabbitMQ broker's ownership role: partition leases kept beside the server decide which worker
reads which partition queue (``ownership``, from :class:`~broker.rabbitmq.side.SideLeases`; the Redis
one shares the Redis inbox's server).

Each partition queue is also a single-active-consumer queue, so the server never delivers a partition
to two consumers at once; the leases add balance: a worker subscribes only to the partitions whose
lease it holds (the runtime reads nothing else), so N workers share N partitions instead of the first
one reading them all. Handing a partition back (rebalance, shutdown, a lease lost) cancels this
worker's consumer of that queue first: what it had prefetched and not started goes back to the queue,
and the next owner's consumer becomes the active one. The leases do not fence: a worker paused past its
lease keeps its consumer until the server's heartbeat closes its connection (docs/transports.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from broker.protocol import Delivery, GroupPartition
from broker.rabbitmq.scheduling import Scheduling
from broker.rabbitmq.side import SideLeases

__all__ = ["Ownership"]


class Ownership(Scheduling):
    """The ``ownership`` capability (see the module's docstring)."""

    side_leases: SideLeases | None = None

    def _leases(self) -> SideLeases:
        if self.side_leases is None:
            raise TypeError(
                "the rabbitmq transport has no 'ownership' capability here: its partition leases live in the "
                "Redis beside it, which the broker URL turns off (?inbox=none)"
            )
        return self.side_leases

    async def heartbeat(
        self, destination: str, group: str, instance: str, ttl_ms: int, *, leave: bool = False
    ) -> list[str]:
        """Beat ``instance``'s heartbeat in the group (or leave it); the live instances, sorted."""
        return await self._leases().heartbeat(destination, group, instance, ttl_ms, leave)

    async def acquire_lease(self, source: GroupPartition, instance: str, ttl_ms: int) -> int:
        """Take the partition's lease if free or expired: the new token, or 0."""
        return await self._leases().acquire(source, instance, ttl_ms)

    async def renew_leases(self, held: Sequence[tuple[GroupPartition, int]], instance: str, ttl_ms: int) -> list[bool]:
        """Renew (partition, token) leases in one round trip; False for each taken over meanwhile."""
        return await self._leases().renew(held, instance, ttl_ms)

    async def release_lease(self, source: GroupPartition, instance: str, token: int) -> bool:
        """Stop consuming the partition's queue here (its prefetched messages go back), then free the lease."""
        await self.stop_reading(source)
        return await self._leases().release(source, instance, token)

    async def stop_reading(self, source: GroupPartition) -> None:
        """Cancel this broker's consumer of the partition's queue (what it held and had not settled goes
        back to the queue), so the partition's next owner becomes its active consumer."""
        await self._stop_feed(source.keys.queue)

    async def take_over(
        self, source: GroupPartition, consumer: str, count: int, cursors: dict[str, str], *, token: int | None = None
    ) -> list[Delivery]:
        """Nothing to claim: what an earlier owner held went back to the queue when its consumer ended."""
        cursors["done"] = "done"
        return []

    def taken_over(self, cursors: dict[str, str]) -> bool:
        """Always complete (see :meth:`take_over`)."""
        return True
