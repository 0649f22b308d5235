"""The memory broker's leases role: instances' heartbeats, partition leases with fencing tokens, take-over.

The same model as ``broker/redis/leases.py`` (``members.lua``, ``lease.lua``) within one process: times
come from one monotonic clock, so every broker of the process agrees on expiry. Every acquisition
raises the partition's token, which never goes back (unsubscribe forgets it, as on Redis).
"""

from __future__ import annotations

from collections.abc import Sequence

from broker.memory.reading import Reading
from broker.memory.streams import mono_ms
from broker.protocol import Delivery, GroupPartition

__all__ = ["Leases"]


class Leases(Reading):
    """Heartbeats of a group's instances and leases of its partitions."""

    async def heartbeat(
        self, destination: str, group: str, instance: str, ttl_ms: int, *, leave: bool = False
    ) -> list[str]:
        """Beat ``instance``'s heartbeat for ``ttl_ms`` (or leave: ``leave=True``); return the live instances."""
        await self._checkpoint()
        now = mono_ms()
        members = self.registry.members.setdefault((destination, group), {})
        if leave:
            members.pop(instance, None)
        else:
            members[instance] = now + ttl_ms
        for name in [m for m, until in members.items() if until <= now]:
            del members[name]
        return sorted(members)

    async def acquire_lease(self, source: GroupPartition, instance: str, ttl_ms: int) -> int:
        """Take the partition's lease if it is free, expired or held under ``instance``'s own name; return
        the new fencing token, or 0 (a live lease held by another instance)."""
        await self._checkpoint()
        now = mono_ms()
        lease = self.server.lease(source.stream, source.group)
        if lease.owner and lease.owner != instance and lease.until > now:
            return 0
        lease.token += 1
        lease.owner, lease.until, lease.since = instance, now + ttl_ms, now
        return lease.token

    async def renew_leases(self, held: Sequence[tuple[GroupPartition, int]], instance: str, ttl_ms: int) -> list[bool]:
        """Renew (view, token) leases ``instance`` holds for ``ttl_ms``; False for each taken over meanwhile."""
        await self._checkpoint()
        now = mono_ms()
        out: list[bool] = []
        for view, token in held:
            lease = self.server.lease(view.stream, view.group)
            current = lease.owner == instance and lease.token == token
            if current:
                lease.until = now + ttl_ms
            out.append(current)
        return out

    async def release_lease(self, source: GroupPartition, instance: str, token: int) -> bool:
        """Give the partition's lease back (another instance may acquire it at once); False when the token
        is not current (nothing changed)."""
        await self._checkpoint()
        lease = self.server.lease(source.stream, source.group)
        if lease.owner != instance or lease.token != token:
            return False
        lease.owner, lease.until = "", 0
        return True

    async def take_over(
        self, source: GroupPartition, consumer: str, count: int, cursors: dict[str, str], *, token: int | None = None
    ) -> list[Delivery]:
        """Claim up to ``count`` entries pending in the partition for anyone, however recently read, oldest
        first, delivery counts raised (a new owner's first step); ``cursors`` (stream -> next id) carries the
        scan from call to call. ``token``: fenced, ``LeaseLost`` once another instance holds the lease."""
        await self._checkpoint()
        self._holder(source, consumer, token)
        self._groups(source)
        out: list[Delivery] = []
        for name in (source.stream, source.keys.redeliver):
            start = cursors.get(name, "0-0")
            if start == "done":
                continue
            nxt, claimed = self._autoclaim(source, name, consumer, 0, start, count)
            cursors[name] = "done" if nxt == "0-0" else nxt
            out += claimed
        return out

    async def stop_reading(self, source: GroupPartition) -> None:
        """Nothing to end: reads pull, and the next owner takes over what is pending."""

    @staticmethod
    def taken_over(cursors: dict[str, str]) -> bool:
        """Whether a :meth:`take_over` with ``cursors`` has gone through every pending entry."""
        return len(cursors) == 2 and all(c == "done" for c in cursors.values())
