"""The introspection capability on Redis: depth, pending, lag, leases, and what removing a group or destination deletes.

:func:`describe` serves ``framework status``; :func:`group_usage` and :func:`destination_usage` say
what ``framework unsubscribe`` and ``framework delete`` would remove; nothing here changes a key.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import orjson
from redis.exceptions import NoPermissionError, ResponseError

from broker.codec import decode_fields
from broker.envelope import Envelope, now_ms
from broker.introspection import (
    INBOX_BYTES_PER_ID,
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
from broker.protocol import GroupPartition
from broker.redis.keys import INBOX_SLOT_MS, hashed_generations, inbox_slot
from broker.redis.topology import Topology
from broker.topology import DestinationSpec

__all__ = [
    "ConsumerSeen",
    "DestinationState",
    "DestinationUsage",
    "GroupState",
    "GroupUsage",
    "INBOX_BYTES_PER_ID",
    "InboxMemory",
    "LeaseView",
    "PartitionState",
    "dead_letter_count",
    "describe",
    "destination_usage",
    "group_state",
    "group_usage",
    "inbox_memory",
    "stored_messages",
    "Inspection",
]

_LAG_SCAN_LIMIT = 100_000  # when the server cannot tell the lag, count at most this many entries
_UNREAD_SCAN_LIMIT = 1_000_000  # the same, for a report before deleting a group: exactness over speed

_DEFAULT_WINDOW_MS = 7 * 24 * 3600 * 1000
_RATE_SLOTS = 4  # the rate is the busiest of the last complete slots (about an hour)


async def inbox_memory(broker: Topology, view: GroupPartition, *, now: int | None = None) -> InboxMemory:
    """Read what ``view``'s inbox holds (one pipelined round trip of HGETs and a ZCARD; no SCAN),
    ids kept by their time and by their hash alike.

    Counts the slots that ids of the window's time fall in (ids far older, from a replay, are
    remembered all the same but not counted here).
    """
    now = now_ms() if now is None else now
    base = view.keys.inbox
    raw = await broker.redis.hget(f"{base}:info", "window")
    window = int(raw) if raw else _DEFAULT_WINDOW_MS
    first, last = (now - window) // INBOX_SLOT_MS - 1, now // INBOX_SLOT_MS + 1
    pipe = broker.redis.pipeline(transaction=False)
    pipe.zcard(base)
    pipe.hget(f"{base}:h", "g")
    for slot in range(first, last + 1):
        pipe.hget(f"{base}:{inbox_slot(slot * INBOX_SLOT_MS)}", "n")
    zcard, raw_gens, *counts = await pipe.execute()
    per_slot = [int(c or 0) for c in counts]
    current = now // INBOX_SLOT_MS - first  # index of the slot now is in
    recent = per_slot[max(current - _RATE_SLOTS, 0) : current] or [0]
    rate = max(recent) / (INBOX_SLOT_MS / 1000)
    # Ids kept by their hash (inbox_hashed.lua): the generations whose buckets have not expired;
    # their rate is the last complete generation's (the current one's while it is the only one).
    gens = hashed_generations(raw_gens)
    live = [g for i, g in enumerate(gens) if i + 1 == len(gens) or gens[i + 1][0] + window >= now]
    hashed = sum(count for _, _, count in live)
    if len(gens) >= 2:
        (start, _, count), (end, _, _) = gens[-2], gens[-1]
        rate += count / max((end - start) / 1000, 0.001)
    elif gens:
        rate += gens[0][2] / max((now - gens[0][0]) / 1000, 1.0)
    return InboxMemory(int(zcard) + sum(per_slot) + hashed, sum(per_slot) + hashed, rate, window)


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


async def _lag(broker: Topology, stream: str, info: dict[str, Any], limit: int = _LAG_SCAN_LIMIT) -> int:
    lag = info.get("lag")
    if lag is not None:
        return int(lag)
    last = _text(info.get("last-delivered-id", "0-0"))  # the server could not tell (entries were deleted): count
    rows = await broker.redis.execute_command("XRANGE", stream, f"({last}", "+", "COUNT", limit)
    return len(rows)


async def group_state(broker: Topology, view: GroupPartition) -> GroupState:
    """Depth figures of ``view``'s group on its partition (main and redeliver streams)."""
    consumers = pending = lag = delivered = 0
    for stream in (view.stream, view.keys.redeliver):
        for info in await broker.stream_groups(stream):
            if _text(info["name"]) != view.group:
                continue
            if stream == view.stream:
                delivered = int(info.get("entries-read") or 0)
            consumers = max(consumers, int(info.get("consumers") or 0))
            pending += int(info.get("pending") or 0)
            lag += await _lag(broker, stream, info)
    pipe = broker.redis.pipeline(transaction=False)
    pipe.zcard(view.keys.delayed)
    pipe.xlen(view.keys.dlq)
    delayed, dead = await pipe.execute()
    inbox = await inbox_memory(broker, view)
    return GroupState(view.group, consumers, pending, lag, int(delayed), int(dead), inbox, delivered=delivered)


async def _with_lease(broker: Topology, view: GroupPartition) -> GroupState:
    state = await group_state(broker, view)
    if not await broker.redis.hget(view.keys.lease, "token"):  # never owned: every instance reads it
        return state
    lease = await broker.lease_state(view)
    live = lease.live
    view_ = LeaseView(
        owner=lease.owner if live else "",
        token=lease.token,
        age_ms=lease.now_ms - lease.since_ms if live else 0,
        expires_in_ms=lease.until_ms - lease.now_ms,
    )
    return attrs.evolve(state, lease=view_)


async def describe(broker: Topology, names: list[str] | None = None) -> list[DestinationState]:
    """State of every declared destination (or of ``names``), with all groups that subscribed."""
    specs = select_destinations(await broker.list_destinations(), names)
    subs = await broker.list_subscriptions()
    out = []
    for spec in specs:
        groups = sorted({g for d, g in subs if d == spec.name})
        parts = []
        for p in range(spec.partitions):
            pkeys = broker.keyspace.partition(spec.name, p)
            try:
                length = int(await broker.redis.xlen(pkeys.stream))
            except NoPermissionError:  # an ACL refusal is not "no such stream": say it
                raise
            except ResponseError:
                length = 0
            scheduled = int(await broker.redis.zcard(pkeys.scheduled))
            states = [await _with_lease(broker, broker.group_partition(spec, p, g)) for g in groups]
            parts.append(PartitionState(p, length, states, scheduled))
        out.append(DestinationState(spec, parts))
    return out


async def dead_letter_count(broker: Topology, view: GroupPartition) -> int:
    """Dead letters of ``view``'s group on its partition."""
    return int(await broker.redis.xlen(view.keys.dlq))


async def stored_messages(broker: Topology, spec: DestinationSpec) -> list[Envelope]:
    """Every message stored on ``spec`` (all partitions, each in stream order), decoded."""
    out: list[Envelope] = []
    for p in range(spec.partitions):
        stream = broker.keyspace.partition(spec.name, p).stream
        for _, flat in await broker.redis.execute_command("XRANGE", stream, "-", "+"):
            fields = dict(zip(flat[::2], flat[1::2], strict=True))
            out.append(decode_fields(fields, spec.name, spec.kind))
    return out


# -- what removing a group or a destination deletes ------------------------------------------------------


async def _consumers_seen(broker: Topology, view: GroupPartition, seen: dict[str, ConsumerSeen]) -> None:
    """Merge the consumers of ``view``'s main and redeliver streams into ``seen`` (by name)."""
    for stream in (view.stream, view.keys.redeliver):
        try:
            rows = await broker.redis.xinfo_consumers(stream, view.group)
        except ResponseError:  # no stream or no group there
            rows = []
        for row in rows:
            info = {_text(k): v for k, v in row.items()}
            name, idle, held = _text(info["name"]), int(info.get("idle") or 0), int(info.get("pending") or 0)
            before = seen.get(name)
            if before is not None:
                idle, held = min(idle, before.idle_ms), held + before.pending
            seen[name] = ConsumerSeen(name, idle, held)


async def group_usage(broker: Topology, spec: DestinationSpec, group: str) -> GroupUsage:
    """Read everything :class:`GroupUsage` says about ``group`` on ``spec`` (nothing is changed)."""
    raw = await broker.redis.hget(broker.keyspace.subscriptions, f"{spec.name}|{group}")
    start = str(orjson.loads(raw).get("start", "earliest")) if raw else "earliest"
    seen: dict[str, ConsumerSeen] = {}
    inbox = retries = dead = pending = retained = delivered = unread = 0
    oldest: int | None = None
    for p in range(spec.partitions):
        view = broker.group_partition(spec, p, group)
        await _consumers_seen(broker, view, seen)
        length = int(await broker.redis.xlen(view.stream))
        retained += length
        for info in await broker.stream_groups(view.stream):
            if _text(info["name"]) == group:
                pending += int(info.get("pending") or 0)
                if spec.is_topic:
                    lag = min(await _lag(broker, view.stream, info, _UNREAD_SCAN_LIMIT), length)
                    unread += lag
                    delivered += length - lag
        if length:
            first = await broker.redis.execute_command("XRANGE", view.stream, "-", "+", "COUNT", 1)
            if first:
                ms = int(_text(first[0][0]).split("-")[0])
                oldest = ms if oldest is None else min(oldest, ms)
        pipe = broker.redis.pipeline(transaction=False)
        pipe.zcard(view.keys.delayed)
        pipe.xlen(view.keys.redeliver)
        pipe.xlen(view.keys.dlq)
        delayed, redeliver, dlq = await pipe.execute()
        processed = (await inbox_memory(broker, view)).ids  # ids and running leases; HGET/ZCARD: a small ACL
        inbox, retries, dead = inbox + int(processed), retries + int(delayed) + int(redeliver), dead + int(dlq)
    consumers = sorted(seen.values(), key=lambda c: c.idle_ms)
    return GroupUsage(spec, group, start, consumers, inbox, retries, dead, pending, retained, delivered, unread, oldest)


async def destination_usage(broker: Topology, spec: DestinationSpec) -> DestinationUsage:
    """Read the groups, stored entries and dead letters of ``spec`` (nothing is changed)."""
    groups = {g for d, g in await broker.list_subscriptions() if d == spec.name}
    entries = dead = 0
    for p in range(spec.partitions):
        stream = broker.keyspace.partition(spec.name, p).stream
        groups |= {_text(info["name"]) for info in await broker.stream_groups(stream)}
        entries += int(await broker.redis.xlen(stream))
    for group in groups:
        for p in range(spec.partitions):
            dead += await dead_letter_count(broker, broker.group_partition(spec, p, group))
    return DestinationUsage(sorted(groups), entries, dead)


class Inspection(Topology):
    """The ``introspection`` capability of :class:`~broker.redis.RedisBroker` (the functions above as methods)."""

    async def describe(self, names: Sequence[str] | None = None) -> list[DestinationState]:
        """State of every declared destination (or of ``names``), with all groups that subscribed."""
        return await describe(self, list(names) if names else None)

    async def group_state(self, view: GroupPartition) -> GroupState:
        """Depth figures of ``view``'s group on its partition (main and redeliver streams)."""
        return await group_state(self, view)

    async def dead_letter_count(self, view: GroupPartition) -> int:
        """Dead letters of ``view``'s group on its partition."""
        return await dead_letter_count(self, view)

    async def inbox_memory(self, view: GroupPartition, *, now: int | None = None) -> InboxMemory:
        """What ``view``'s inbox holds, and the memory it will need over its window."""
        return await inbox_memory(self, view, now=now)

    async def group_usage(self, spec: DestinationSpec, group: str) -> GroupUsage:
        """Everything ``group`` holds on ``spec``."""
        return await group_usage(self, spec, group)

    async def destination_usage(self, spec: DestinationSpec) -> DestinationUsage:
        """The groups, stored entries and dead letters of ``spec``."""
        return await destination_usage(self, spec)

    async def stored_messages(self, spec: DestinationSpec) -> list[Envelope]:
        """Every message stored on ``spec``, decoded."""
        return await stored_messages(self, spec)

    async def read_entries(
        self, spec: DestinationSpec, partition: int, start: str = "-", count: int = 100
    ) -> list[tuple[str, dict[bytes, bytes]]]:
        """Up to ``count`` entries of one partition's stream from ``start`` on (XRANGE; read-only)."""
        stream = self.keyspace.partition(spec.name, partition).stream
        rows = await self.redis.execute_command("XRANGE", stream, start, "+", "COUNT", count)
        return [(_text(entry_id), dict(zip(flat[::2], flat[1::2], strict=True))) for entry_id, flat in rows]
