"""Partition leases of a transport that keeps none itself (RabbitMQ), in the Redis beside it:
:class:`RedisLeases` (the ``SideLeases`` of :mod:`broker.rabbitmq.ownership`).

It shares the Redis inbox's connection (:class:`~broker.redis.side_inbox.RedisInbox`) and calls the
Redis transport's own heartbeat and lease scripts (``members.lua``, ``lease.lua``) on the keys that
transport keeps for the same group partition, so instances of a group agree on who reads which
partition exactly as they do on Redis. The leases decide; they do not fence: the other transport's
server does not check a token when a message is settled.
"""

from __future__ import annotations

from collections.abc import Sequence

from broker.protocol import GroupPartition
from broker.redis.side_inbox import RedisInbox

__all__ = ["RedisLeases"]


class RedisLeases:
    """Heartbeats and partition leases in the Redis of ``inbox`` (see the module's docstring)."""

    def __init__(self, inbox: RedisInbox) -> None:
        self.inbox = inbox

    def describe(self) -> str:
        """Where the leases live (no password)."""
        return self.inbox.describe()

    async def heartbeat(self, destination: str, group: str, instance: str, ttl_ms: int, leave: bool) -> list[str]:
        """Beat ``instance``'s heartbeat in the group (or leave it); the live instances, sorted."""
        broker = await self.inbox.redis_broker()
        return await broker.heartbeat(destination, group, instance, ttl_ms, leave=leave)

    async def acquire(self, source: GroupPartition, instance: str, ttl_ms: int) -> int:
        """The Redis transport's ``acquire_lease`` on the same group partition: a new token, or 0."""
        broker = await self.inbox.redis_broker()
        return await broker.acquire_lease(
            broker.group_partition(source.spec, source.partition, source.group), instance, ttl_ms
        )

    async def renew(self, held: Sequence[tuple[GroupPartition, int]], instance: str, ttl_ms: int) -> list[bool]:
        """Renew (partition, token) leases in one round trip; False for each taken over meanwhile."""
        broker = await self.inbox.redis_broker()
        views = [(broker.group_partition(v.spec, v.partition, v.group), token) for v, token in held]
        return await broker.renew_leases(views, instance, ttl_ms)

    async def release(self, source: GroupPartition, instance: str, token: int) -> bool:
        """Free the lease; False when the token is not current."""
        broker = await self.inbox.redis_broker()
        return await broker.release_lease(
            broker.group_partition(source.spec, source.partition, source.group), instance, token
        )
