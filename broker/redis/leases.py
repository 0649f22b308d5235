"""The broker's leases role: which instance of a group owns which partition, and taking a partition over.

Partition ownership (``framework.runtime.ownership`` drives it): the live instances of a group on a
destination beat a heartbeat into a members zset (``members.lua``), and each partition of the group
has a lease hash (``lease.lua``) holding its owner, the time the lease ends, and a fencing token
raised by every acquisition. The settle scripts compare a caller's token with the lease's
(:mod:`broker.redis.settlement`), so an instance whose lease was taken over cannot settle
anything. Times are the server's (``TIME`` in the scripts), never a host's clock.
"""

from __future__ import annotations

from collections.abc import Sequence

from broker.protocol import Delivery, GroupPartition
from broker.redis.core import LeaseState, ScriptCall, text
from broker.redis.reading import Reading

__all__ = ["LeaseState", "Leases"]


class Leases(Reading):
    """Heartbeats of a group's instances and leases of its partitions."""

    async def heartbeat(
        self, destination: str, group: str, instance: str, ttl_ms: int, *, leave: bool = False
    ) -> list[str]:
        """Beat ``instance``'s heartbeat (or leave, ``leave=True``); return the live instances, sorted."""
        key = self.keyspace.members(destination, group)
        reply = await self.scripts["members"](self.redis, [key], [instance, ttl_ms, "0" if leave else "1"])
        return [text(m) for m in reply]

    async def acquire_lease(self, source: GroupPartition, instance: str, ttl_ms: int) -> int:
        """Take the partition's lease if it is free or expired; return the new fencing token, or 0."""
        return int(await self.scripts["lease"](self.redis, [source.keys.lease], ["acquire", instance, ttl_ms, 0]))

    async def renew_leases(self, held: Sequence[tuple[GroupPartition, int]], instance: str, ttl_ms: int) -> list[bool]:
        """Renew leases ``instance`` holds (view, token) in one round trip (one call each on a Cluster);
        False for each one taken over meanwhile."""
        calls: list[ScriptCall] = [("lease", [v.keys.lease], ["renew", instance, ttl_ms, token]) for v, token in held]
        if not calls:
            return []
        if self.cluster:
            replies = [await self.scripts["lease"](self.redis, keys, args) for _, keys, args in calls]
        else:
            replies = await self._run_pipeline(calls)
        return [int(r) == 1 for r in replies]

    async def release_lease(self, source: GroupPartition, instance: str, token: int) -> bool:
        """Give the partition's lease back (another instance may acquire it at once)."""
        return int(await self.scripts["lease"](self.redis, [source.keys.lease], ["release", instance, 0, token])) == 1

    async def lease_state(self, source: GroupPartition) -> LeaseState:
        """The partition's lease as stored now (for ``framework status``), with the clock of its server."""
        script = self.scripts["lease"]
        owner, token, until, since, secs, micros = await script(self.redis, [source.keys.lease], ["read", "", 0, 0])
        return LeaseState(
            owner=text(owner),
            token=int(token or 0),
            until_ms=int(until or 0),
            since_ms=int(since or 0),
            now_ms=int(secs) * 1000 + int(micros) // 1000,
        )

    async def take_over(
        self, source: GroupPartition, consumer: str, count: int, cursors: dict[str, str], *, token: int | None = None
    ) -> list[Delivery]:
        """Claim up to ``count`` entries pending in the partition for anyone, however recently read.

        Only the partition's new owner calls this, right after acquiring its lease: whatever
        earlier owners left pending (dead, paused past their lease, or handed back) becomes
        ``consumer``'s, oldest first, delivery counts raised by one. ``cursors`` (stream -> next
        id, empty at first) is advanced; the take-over is complete when a call returns nothing
        and every cursor is ``"0-0"``. ``token`` (the lease's): fenced, :class:`~broker.errors.LeaseLost`
        once another instance holds the lease (nothing claimed).
        """
        out: list[Delivery] = []
        for stream in (source.stream, source.keys.redeliver):
            start = cursors.get(stream, "0-0")
            if start == "done":
                continue
            nxt, claimed = await self._autoclaim(source, stream, consumer, 0, start, count, token)
            cursors[stream] = "done" if nxt == "0-0" else nxt
            out += claimed
        return out

    async def stop_reading(self, source: GroupPartition) -> None:
        """Nothing to end: reads pull, and the next owner takes over what is pending."""

    @staticmethod
    def taken_over(cursors: dict[str, str]) -> bool:
        """Whether a :meth:`take_over` with ``cursors`` has gone through every pending entry."""
        return len(cursors) == 2 and all(c == "done" for c in cursors.values())
