"""The memory broker's introspection role: depth, pending, lag, leases, what removing a group or destination deletes.

The same figures as ``broker/redis/inspect.py`` reads from Redis (``framework status``, "run until
idle", the reports before ``unsubscribe``/``delete``); nothing here changes state.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from broker.codec import decode_fields, fields_of
from broker.envelope import Envelope
from broker.ids import id_time_ms
from broker.introspection import (
    ConsumerSeen,
    DestinationState,
    DestinationUsage,
    GroupState,
    GroupUsage,
    InboxMemory,
    LeaseView,
    PartitionState,
    select_destinations,
)
from broker.memory.inbox import DEFAULT_WINDOW_MS, bucketed
from broker.memory.streams import Group, Stream, mono_ms, wall_ms
from broker.memory.topology import Topology
from broker.protocol import GroupPartition
from broker.topology import DestinationSpec

__all__ = ["Inspection"]

_SLOT_MS = 1 << 20  # the Redis inbox's slots (17.5 minutes): the rate is per slot, by the ids' own time
_RATE_SLOTS = 4  # the rate is the busiest of the last complete slots (about an hour)


def _lag(stream: Stream, group: Group) -> int:
    """Entries of ``stream`` not yet delivered to ``group``."""
    return len(stream.after(group.last_delivered))


class Inspection(Topology):
    """The ``introspection`` capability (:class:`broker.introspection.Introspection`) over the memory server."""

    def _found(self, stream: str, group: str) -> tuple[Stream, Group] | None:
        found = self.server.streams.get(stream)
        state = found.groups.get(group) if found is not None else None
        return (found, state) if found is not None and state is not None else None

    def _length(self, stream: str) -> int:
        found = self.server.streams.get(stream)
        return len(found) if found is not None else 0

    async def inbox_memory(self, view: GroupPartition, *, now: int | None = None) -> InboxMemory:
        """What ``view``'s inbox holds: leases and records of other ids, plus the UUIDv7/v8 records of the
        window's slots, and the busiest recent slot's rate."""
        await self._checkpoint()
        now = wall_ms() if now is None else now
        state = self.server.groups.get((view.stream, view.group))
        window = (state.inbox.window_ms if state is not None else 0) or DEFAULT_WINDOW_MS
        if state is None:
            return InboxMemory(0, 0, 0.0, window)
        inbox = state.inbox
        first, last = (now - window) // _SLOT_MS - 1, now // _SLOT_MS + 1
        per_slot = [0] * (last - first + 1)
        for message_id, expiry in inbox.records.items():
            at = id_time_ms(message_id) if bucketed(message_id) and expiry > now else None
            if at is not None and first <= at // _SLOT_MS <= last:
                per_slot[at // _SLOT_MS - first] += 1
        current = now // _SLOT_MS - first
        recent = per_slot[max(current - _RATE_SLOTS, 0) : current] or [0]
        rate = max(recent) / (_SLOT_MS / 1000)
        zset = len(inbox.leases) + len(inbox.final)
        return InboxMemory(zset + sum(per_slot), sum(per_slot), rate, window)

    async def group_state(self, view: GroupPartition) -> GroupState:
        """Depth figures of ``view``'s group on its partition (main and redeliver streams)."""
        consumers = pending = lag = 0
        for name in (view.stream, view.keys.redeliver):
            found = self._found(name, view.group)
            if found is not None:
                stream, group = found
                consumers = max(consumers, len(group.consumers))
                pending += len(group.pel)
                lag += _lag(stream, group)
        state = self.server.groups.get((view.stream, view.group))
        delayed = len(state.delayed) if state is not None else 0
        inbox = await self.inbox_memory(view)
        return GroupState(view.group, consumers, pending, lag, delayed, self._length(view.keys.dlq), inbox)

    async def _with_lease(self, view: GroupPartition) -> GroupState:
        state = await self.group_state(view)
        lease = self.server.leases.get((view.stream, view.group))
        if lease is None or not lease.token:  # never owned: every instance reads it
            return state
        now = mono_ms()
        live = bool(lease.owner) and lease.until > now
        seen = LeaseView(
            owner=lease.owner if live else "",
            token=lease.token,
            age_ms=now - lease.since if live else 0,
            expires_in_ms=lease.until - now,
        )
        return attrs.evolve(state, lease=seen)

    async def describe(self, names: Sequence[str] | None = None) -> list[DestinationState]:
        """State of every declared destination (or of ``names``: ``ValueError`` naming unknown ones), with
        all groups that subscribed."""
        specs = select_destinations(await self.list_destinations(), names)
        subs = await self.list_subscriptions()
        out = []
        for spec in specs:
            groups = sorted({g for d, g in subs if d == spec.name})
            parts = []
            for p in range(spec.partitions):
                name = self.partition_stream(spec.name, p)
                state = self.server.partitions.get(name)
                scheduled = len(state.scheduled) if state is not None else 0
                views = [await self._with_lease(self.group_partition(spec, p, g)) for g in groups]
                parts.append(PartitionState(p, self._length(name), views, scheduled))
            out.append(DestinationState(spec, parts))
        return out

    async def dead_letter_count(self, view: GroupPartition) -> int:
        """Dead letters of ``view``'s group on its partition."""
        await self._checkpoint()
        return self._length(view.keys.dlq)

    async def stored_messages(self, spec: DestinationSpec) -> list[Envelope]:
        """Every message stored on ``spec`` (all partitions, each in order), decoded (``DecodeError`` for an
        entry that is not an envelope)."""
        await self._checkpoint()
        out: list[Envelope] = []
        for p in range(spec.partitions):
            stream = self.server.streams.get(self.partition_stream(spec.name, p))
            if stream is not None:
                out += [decode_fields(fields_of(stream.entries[e]), spec.name, spec.kind) for e in stream.ids]
        return out

    def _consumers_seen(self, view: GroupPartition, seen: dict[str, ConsumerSeen], now: int) -> None:
        """Merge the consumers of ``view``'s main and redeliver streams into ``seen`` (by name)."""
        for name in (view.stream, view.keys.redeliver):
            found = self._found(name, view.group)
            if found is None:
                continue
            group = found[1]
            for consumer, at in group.consumers.items():
                idle, held = now - at, group.pending_count(consumer)
                before = seen.get(consumer)
                if before is not None:
                    idle, held = min(idle, before.idle_ms), held + before.pending
                seen[consumer] = ConsumerSeen(consumer, idle, held)

    async def group_usage(self, spec: DestinationSpec, group: str) -> GroupUsage:
        """Everything ``group`` holds on ``spec`` (what unsubscribing would remove)."""
        await self._checkpoint()
        start = self.registry.subscriptions.get((spec.name, group), "earliest")
        seen: dict[str, ConsumerSeen] = {}
        inbox = retries = dead = pending = retained = delivered = unread = 0
        oldest: int | None = None
        now = mono_ms()
        for p in range(spec.partitions):
            view = self.group_partition(spec, p, group)
            self._consumers_seen(view, seen, now)
            length = self._length(view.stream)
            retained += length
            found = self._found(view.stream, group)
            if found is not None:
                pending += len(found[1].pel)
                if spec.is_topic:
                    lag = min(_lag(*found), length)
                    unread += lag
                    delivered += length - lag
            stream = self.server.streams.get(view.stream)
            if stream is not None and stream.ids:
                oldest = stream.ids[0][0] if oldest is None else min(oldest, stream.ids[0][0])
            state = self.server.groups.get((view.stream, group))
            delayed = len(state.delayed) if state is not None else 0
            inbox += (await self.inbox_memory(view)).ids
            retries += delayed + self._length(view.keys.redeliver)
            dead += self._length(view.keys.dlq)
        consumers = sorted(seen.values(), key=lambda c: c.idle_ms)
        return GroupUsage(
            spec, group, start, consumers, inbox, retries, dead, pending, retained, delivered, unread, oldest
        )

    async def destination_usage(self, spec: DestinationSpec) -> DestinationUsage:
        """The groups (registered or present on a stream), stored entries and dead letters of ``spec``."""
        await self._checkpoint()
        groups = {g for d, g in self.registry.subscriptions if d == spec.name}
        entries = dead = 0
        for p in range(spec.partitions):
            stream = self.server.streams.get(self.partition_stream(spec.name, p))
            if stream is not None:
                groups |= set(stream.groups)
                entries += len(stream)
        for group in groups:
            for p in range(spec.partitions):
                dead += self._length(self.group_partition(spec, p, group).keys.dlq)
        return DestinationUsage(sorted(groups), entries, dead)
