"""Read-only views of destinations, partitions and groups: depth, pending, lag, and what removing them deletes.

:func:`describe` serves ``framework status``; :func:`group_usage` and :func:`destination_usage` say
what ``framework unsubscribe`` and ``framework delete`` would remove; nothing here changes a key.
"""

from __future__ import annotations

from typing import Any

import attrs
import orjson
from redis.exceptions import NoPermissionError, ResponseError

from broker.codec import decode_fields
from broker.envelope import Envelope, now_ms
from broker.protocol import GroupPartition
from broker.redis.broker import RedisBroker
from broker.redis.keys import INBOX_SLOT_MS, inbox_slot
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
]

_LAG_SCAN_LIMIT = 100_000  # when the server cannot tell the lag, count at most this many entries
_UNREAD_SCAN_LIMIT = 1_000_000  # the same, for a report before deleting a group: exactness over speed

INBOX_BYTES_PER_ID = 24
"""Server bytes one processed id costs in the inbox's buckets (measured by ``python -m benchmarks
--only memory``: about 20; rounded up for buckets of slots the rate does not fill)."""
_ZSET_BYTES_PER_ID = 110  # an id kept in the zset (not a UUIDv7/v8, or recorded before the buckets)
_DEFAULT_WINDOW_MS = 7 * 24 * 3600 * 1000
_RATE_SLOTS = 4  # the rate is the busiest of the last complete slots (about an hour)


@attrs.frozen
class InboxMemory:
    """What a group's inbox holds on one or more partitions, and what it will hold at its rate.

    ``ids`` are remembered now (buckets and zset); ``ids_per_s`` is the busiest of the last
    complete 17.5-minute slots (ids recorded, by the ids' own time); ``window_ms`` is the dedup
    window the group's workers store (a week until one runs). ``bytes`` is the server memory the
    inbox needs at that rate over the whole window (or now, if more): the sizing rule
    ``bytes per id x rate x window``.
    """

    ids: int = 0
    bucket_ids: int = 0
    ids_per_s: float = 0.0
    window_ms: int = 0

    @property
    def bytes(self) -> int:
        """Projected server memory over the whole window, in bytes."""
        at_rate = self.ids_per_s * self.window_ms / 1000
        zset = self.ids - self.bucket_ids
        return int(max(self.bucket_ids, at_rate) * INBOX_BYTES_PER_ID + zset * _ZSET_BYTES_PER_ID)

    def __add__(self, other: InboxMemory) -> InboxMemory:
        return InboxMemory(
            self.ids + other.ids,
            self.bucket_ids + other.bucket_ids,
            self.ids_per_s + other.ids_per_s,
            max(self.window_ms, other.window_ms),
        )


async def inbox_memory(broker: RedisBroker, view: GroupPartition, *, now: int | None = None) -> InboxMemory:
    """Read what ``view``'s inbox holds (one pipelined round trip of HGETs and a ZCARD; no SCAN).

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
    for slot in range(first, last + 1):
        pipe.hget(f"{base}:{inbox_slot(slot * INBOX_SLOT_MS)}", "n")
    zcard, *counts = await pipe.execute()
    per_slot = [int(c or 0) for c in counts]
    current = now // INBOX_SLOT_MS - first  # index of the slot now is in
    recent = per_slot[max(current - _RATE_SLOTS, 0) : current] or [0]
    rate = max(recent) / (INBOX_SLOT_MS / 1000)
    return InboxMemory(int(zcard) + sum(per_slot), sum(per_slot), rate, window)


@attrs.frozen
class LeaseView:
    """Who owns a group's partition (partition ownership): ``owner`` '' when nobody holds it now.

    ``token`` is the fencing token of the latest acquisition; ``age_ms`` how long the owner has held
    it; ``expires_in_ms`` how long until it lapses without a heartbeat (negative: lapsed).
    """

    owner: str
    token: int
    age_ms: int
    expires_in_ms: int


@attrs.frozen
class GroupState:
    """A consumer group on one partition.

    ``lag`` counts entries not yet delivered to the group (including its redeliver stream);
    ``pending`` counts delivered, unacknowledged ones; ``delayed`` waits in the retry path;
    ``lease`` is the partition's owner in the group (None unless the partition is owned: see
    ``framework.runtime.ownership``; filled by :func:`describe`).
    """

    group: str
    consumers: int
    pending: int
    lag: int
    delayed: int
    dead_letters: int
    inbox: InboxMemory = InboxMemory()
    lease: LeaseView | None = None

    @property
    def idle(self) -> bool:
        """Nothing left to deliver or settle (delayed retries aside)."""
        return self.pending == 0 and self.lag == 0


@attrs.frozen
class PartitionState:
    """One partition stream: its length, its groups, and the messages scheduled for it (not yet due)."""

    partition: int
    length: int
    groups: list[GroupState]
    scheduled: int = 0


@attrs.frozen
class DestinationState:
    """A destination and all its partitions."""

    spec: DestinationSpec
    partitions: list[PartitionState]

    @property
    def depth(self) -> int:
        """Entries stored over all partitions (for topics: retained, not only unread)."""
        return sum(p.length for p in self.partitions)

    @property
    def scheduled(self) -> int:
        """Messages scheduled for the destination and not yet due (``send(..., delay=...)``)."""
        return sum(p.scheduled for p in self.partitions)

    def to_json(self) -> dict[str, Any]:
        """Plain data for ``framework status --json``."""
        return {
            "name": self.spec.name,
            "kind": self.spec.kind,
            "partitions": self.spec.partitions,
            "retention_ms": self.spec.retention_ms,
            "max_length": self.spec.max_length,
            "depth": self.depth,
            "scheduled": self.scheduled,
            "groups": _group_totals(self),
            "per_partition": [attrs.asdict(p) for p in self.partitions],
        }


def _group_totals(state: DestinationState) -> list[dict[str, Any]]:
    totals: dict[str, dict[str, Any]] = {}
    for p in state.partitions:
        for g in p.groups:
            t = totals.setdefault(
                g.group, {"group": g.group, "consumers": 0, "pending": 0, "lag": 0, "delayed": 0, "dead_letters": 0}
            )
            t["consumers"] = max(t["consumers"], g.consumers)
            for k in ("pending", "lag", "delayed", "dead_letters"):
                t[k] += getattr(g, k)
            t["_inbox"] = t.get("_inbox", InboxMemory()) + g.inbox
    for t in totals.values():
        inbox = t.pop("_inbox", InboxMemory())
        t["inbox_ids"] = inbox.ids
        t["inbox_ids_per_s"] = round(inbox.ids_per_s, 3)
        t["inbox_window_s"] = inbox.window_ms / 1000
        t["inbox_bytes"] = inbox.bytes  # projected over the whole window at the recent rate
    return sorted(totals.values(), key=lambda t: t["group"])


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


async def _lag(broker: RedisBroker, stream: str, info: dict[str, Any], limit: int = _LAG_SCAN_LIMIT) -> int:
    lag = info.get("lag")
    if lag is not None:
        return int(lag)
    last = _text(info.get("last-delivered-id", "0-0"))  # the server could not tell (entries were deleted): count
    rows = await broker.redis.execute_command("XRANGE", stream, f"({last}", "+", "COUNT", limit)
    return len(rows)


async def group_state(broker: RedisBroker, view: GroupPartition) -> GroupState:
    """Depth figures of ``view``'s group on its partition (main and redeliver streams)."""
    consumers = pending = lag = 0
    for stream in (view.stream, view.keys.redeliver):
        for info in await broker.stream_groups(stream):
            if _text(info["name"]) != view.group:
                continue
            consumers = max(consumers, int(info.get("consumers") or 0))
            pending += int(info.get("pending") or 0)
            lag += await _lag(broker, stream, info)
    pipe = broker.redis.pipeline(transaction=False)
    pipe.zcard(view.keys.delayed)
    pipe.xlen(view.keys.dlq)
    delayed, dead = await pipe.execute()
    inbox = await inbox_memory(broker, view)
    return GroupState(view.group, consumers, pending, lag, int(delayed), int(dead), inbox)


async def _with_lease(broker: RedisBroker, view: GroupPartition) -> GroupState:
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


async def describe(broker: RedisBroker, names: list[str] | None = None) -> list[DestinationState]:
    """State of every declared destination (or of ``names``), with all groups that subscribed."""
    specs = await broker.list_destinations()
    if names:
        wanted = set(names)
        unknown = wanted - {s.name for s in specs}
        if unknown:
            raise ValueError(f"unknown destination(s): {', '.join(sorted(unknown))}")
        specs = [s for s in specs if s.name in wanted]
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


async def dead_letter_count(broker: RedisBroker, view: GroupPartition) -> int:
    """Dead letters of ``view``'s group on its partition."""
    return int(await broker.redis.xlen(view.keys.dlq))


async def stored_messages(broker: RedisBroker, spec: DestinationSpec) -> list[Envelope]:
    """Every message stored on ``spec`` (all partitions, each in stream order), decoded."""
    out: list[Envelope] = []
    for p in range(spec.partitions):
        stream = broker.keyspace.partition(spec.name, p).stream
        for _, flat in await broker.redis.execute_command("XRANGE", stream, "-", "+"):
            fields = dict(zip(flat[::2], flat[1::2], strict=True))
            out.append(decode_fields(fields, spec.name, spec.kind))
    return out


# -- what removing a group or a destination deletes ------------------------------------------------------


@attrs.frozen
class ConsumerSeen:
    """A consumer of a group: how long since the server last saw it read, and how many entries it holds."""

    name: str
    idle_ms: int
    pending: int


@attrs.frozen
class GroupUsage:
    """Everything ``group`` holds on ``spec``, summed over its partitions.

    ``start`` is where the group began when it subscribed (``earliest`` or ``latest``);
    ``consumers`` are all consumers the server knows, most recently seen first.
    """

    spec: DestinationSpec
    group: str
    start: str
    consumers: list[ConsumerSeen]
    inbox: int  # message ids remembered for deduplication (processed, or leased to a running handler)
    retries: int  # waiting in the group's retry path (redeliver stream and delayed set)
    dead: int
    pending: int  # delivered to the group and not acknowledged
    retained: int  # entries in the partition streams
    delivered: int  # of those, already delivered to the group (topics only)
    unread: int  # of those, not yet delivered to the group (topics only)
    oldest_ms: int | None  # time of the oldest retained entry


async def _consumers_seen(broker: RedisBroker, view: GroupPartition, seen: dict[str, ConsumerSeen]) -> None:
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


async def group_usage(broker: RedisBroker, spec: DestinationSpec, group: str) -> GroupUsage:
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


@attrs.frozen
class DestinationUsage:
    """What a destination holds: its groups (registered or present on a stream), stored entries, dead letters."""

    groups: list[str]
    entries: int
    dead: int


async def destination_usage(broker: RedisBroker, spec: DestinationSpec) -> DestinationUsage:
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
