"""The memory broker's reading role: group reads (blocking ones woken by appends), own pending entries, claims,
keeping deliveries owned (extend) and the inbox check."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import anyio

from broker.memory.core import MemoryCore
from broker.memory.streams import ZERO, Group, Stream, mono_ms, parse_id, wall_ms
from broker.protocol import Delivery, Extension, GroupPartition

__all__ = ["Reading"]


class Reading(MemoryCore):
    """Delivers entries of a group's partition (and its redeliver stream) to consumers."""

    def channel(self) -> Any:
        """None: every call of the memory transport is local (no connection to hold)."""
        return None

    def _groups(self, source: GroupPartition) -> list[tuple[Stream, Group]]:
        """The partition stream and the redeliver stream with the group on each (NOGROUP unless both exist)."""
        return [self._group_of(name, source.group) for name in (source.stream, source.keys.redeliver)]

    def _take_new(self, source: GroupPartition, consumer: str, count: int) -> list[Delivery]:
        """XREADGROUP ``>`` of the partition stream then the redeliver stream: up to ``count`` from each."""
        now = mono_ms()
        return [
            self._delivery(source, s, e) for s, g in self._groups(source) for e in s.read_new(g, consumer, count, now)
        ]

    async def read(
        self,
        source: GroupPartition,
        consumer: str,
        count: int,
        block_ms: int,
        *,
        channel: Any = None,
        token: int | None = None,
    ) -> list[Delivery]:
        """Deliver up to ``count`` new entries of the partition stream and as many of the group's redeliver
        stream to ``consumer``, waiting up to ``block_ms`` for one (woken at once by an append; no waiting
        when ``block_ms`` <= 0). ``token``: fenced, ``LeaseLost`` once another instance holds the lease."""
        await self._checkpoint()
        deadline = anyio.current_time() + max(block_ms, 0) / 1000
        while True:
            self._holder(source, consumer, token)
            got = self._take_new(source, consumer, count)
            remaining = deadline - anyio.current_time()
            if got or block_ms <= 0 or remaining <= 0:
                return got
            event = anyio.Event()
            streams = [stream for stream, _ in self._groups(source)]
            for stream in streams:
                stream.waiters.add(event)
            try:
                with anyio.move_on_after(remaining):
                    await event.wait()
            finally:
                for stream in streams:
                    stream.waiters.discard(event)
            if not event.is_set():  # the time passed with nothing appended
                return []

    async def read_own_pending(
        self, source: GroupPartition, consumer: str, count: int, after: dict[str, str] | None = None
    ) -> list[Delivery]:
        """Re-read entries pending for ``consumer`` itself, oldest first, after ids in ``after`` (per
        stream); up to ``count`` from each stream, their delivery counts raised."""
        await self._checkpoint()
        after = after or {}
        now = mono_ms()
        out: list[Delivery] = []
        for stream, group in self._groups(source):
            start = parse_id(after[stream.name]) if stream.name in after else ZERO
            for entry, n in stream.read_history(group, consumer, start, count, now):
                out.append(self._delivery(source, stream, entry, n))
        return out

    async def claim_idle(
        self, source: GroupPartition, consumer: str, min_idle_ms: int, count: int, *, token: int | None = None
    ) -> list[Delivery]:
        """XAUTOCLAIM entries idle ``min_idle_ms`` or longer from any consumer, continuing each stream's scan
        where this broker's last call stopped; delivery counts raised by one. ``token``: fenced like :meth:`read`."""
        await self._checkpoint()
        self._holder(source, consumer, token)
        self._groups(source)
        out: list[Delivery] = []
        for name in (source.stream, source.keys.redeliver):
            key = (name, source.group)
            self._claim_cursor[key], claimed = self._autoclaim(
                source, name, consumer, min_idle_ms, self._claim_cursor.get(key, "0-0"), count
            )
            out += claimed
        return out

    def _autoclaim(
        self, source: GroupPartition, name: str, consumer: str, min_idle_ms: int, start: str, count: int
    ) -> tuple[str, list[Delivery]]:
        """One XAUTOCLAIM of stream ``name`` from ``start``: the next cursor and the claimed deliveries."""
        stream, group = self._group_of(name, source.group)
        cursor, claimed = stream.autoclaim(group, consumer, min_idle_ms, parse_id(start), count, mono_ms())
        return cursor, [self._delivery(source, stream, e, n) for e, n in claimed]

    async def release_own_pending(
        self, source: GroupPartition, consumer: str, idle_ms: int, *, keep: Iterable[str] = ()
    ) -> int:
        """Make entries pending for ``consumer`` (except ``keep``) claimable by others at once: they stay
        pending with their idle time set to ``idle_ms``. Returns how many were released."""
        await self._checkpoint()
        kept = {parse_id(i) for i in keep}
        released = 0
        now = mono_ms()
        for stream, group in self._groups(source):
            ids = [e for e, p in group.pel.items() if p.consumer == consumer and e not in kept][:10_000]
            released += stream.touch(group, consumer, ids, idle_ms, now)
        return released

    async def prune_consumers(self, source: GroupPartition, min_idle_ms: int, *, keep: str = "") -> int:
        """Forget consumers of the group that hold nothing and were idle ``min_idle_ms`` or longer (never
        ``keep``); a consumer is counted once per stream it is known on (partition and redeliver)."""
        await self._checkpoint()
        deleted = 0
        now = mono_ms()
        for name in (source.stream, source.keys.redeliver):
            stream = self.server.streams.get(name)
            group = stream.groups.get(source.group) if stream is not None else None
            if group is None:  # no stream or group yet
                continue
            for consumer, seen in list(group.consumers.items()):
                if consumer != keep and now - seen >= min_idle_ms and group.pending_count(consumer) == 0:
                    del group.consumers[consumer]
                    deleted += 1
        return deleted

    async def extend(
        self, source: GroupPartition, consumer: str, deliveries: Sequence[Delivery], *, lease_ms: int = 60_000
    ) -> Extension:
        """Touch deliveries ``consumer`` still owns (idle time reset) and push out their inbox leases to
        ``lease_ms`` from now; return their entry ids, with ``.taken``: those pending under another consumer."""
        await self._checkpoint()
        owned: list[str] = []
        taken: list[str] = []
        by_stream: dict[str, list[Delivery]] = defaultdict(list)
        for d in deliveries:
            by_stream[d.stream].append(d)
        expiry = wall_ms() + lease_ms
        inbox = self.server.group(source.stream, source.group).inbox
        now = mono_ms()
        for name, items in by_stream.items():
            stream, group = self._group_of(name, source.group)
            mine = []
            for d in items:
                entry = parse_id(d.entry_id)
                p = group.pel.get(entry)
                if p is None:  # settled meanwhile
                    continue
                if p.consumer != consumer:  # claimed away: left alone, as is its inbox lease
                    taken.append(d.entry_id)
                    continue
                owned.append(d.entry_id)
                mine.append(entry)
                if d.message_id:
                    inbox.extend(d.message_id, expiry)
            stream.touch(group, consumer, mine, 0, now)
        return Extension(owned, taken)

    async def inbox_claim(
        self,
        source: GroupPartition,
        deliveries: Sequence[Delivery],
        lease_ms: int,
        *,
        channel: Any = None,
        window_ms: int = 0,
    ) -> list[int]:
        """Check deliveries against the group's inbox and lease the new ones: per delivery 0 leased to us
        (run it), 1 already processed (ack it), 2 leased elsewhere (leave it pending). Redelivered entries
        take over live leases; ``window_ms`` (when not 0) is stored as the group's dedup window."""
        await self._checkpoint()
        first = [d for d in deliveries if d.delivery_count == 1]
        again = [d for d in deliveries if d.delivery_count != 1]
        ordered = first + again
        inbox = self.server.group(source.stream, source.group).inbox
        statuses = inbox.claim([d.message_id for d in ordered], len(first), lease_ms, wall_ms(), window_ms)
        status = {id(d): s for d, s in zip(ordered, statuses, strict=True)}
        return [status[id(d)] for d in deliveries]

    async def read_leased(
        self,
        source: GroupPartition,
        consumer: str,
        count: int,
        block_ms: int,
        *,
        lease_ms: int,
        window_ms: int = 0,
        channel: Any = None,
        token: int | None = None,
    ) -> list[Delivery]:
        """:meth:`read`, then the read deliveries leased as :meth:`inbox_claim` leases them (nothing
        runs in between: one step of the event loop), their ``inbox_status`` set."""
        got = await self.read(source, consumer, count, block_ms, token=token)
        if got:
            inbox = self.server.group(source.stream, source.group).inbox
            valid = [d for d in got if d.envelope is not None]
            for d, status in zip(
                valid,
                inbox.claim([d.message_id for d in valid], len(valid), lease_ms, wall_ms(), window_ms),
                strict=True,
            ):
                d.inbox_status = status
            for d in got:
                if d.envelope is None:
                    d.inbox_status = 0
        return got
