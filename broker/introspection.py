"""What a transport reports about its destinations and groups: depth, pending, lag, leases, inbox memory.

The view types here are shared by every transport that offers the ``introspection`` capability
(:class:`Introspection`); ``framework status``, ``framework unsubscribe``/``delete`` reports, the
dead-letter counts and the test harness's "run until idle" read them. Nothing here changes state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from broker.envelope import Envelope
from broker.protocol import GroupPartition
from broker.topology import DestinationSpec

__all__ = [
    "INBOX_BYTES_PER_ID",
    "ConsumerSeen",
    "DestinationState",
    "DestinationUsage",
    "GroupState",
    "GroupUsage",
    "InboxMemory",
    "Introspection",
    "LeaseView",
    "MessageLog",
    "PartitionState",
    "select_destinations",
]

INBOX_BYTES_PER_ID = 24
"""Server bytes one processed id costs in the inbox's buckets (measured by ``python -m benchmarks
--only memory``: about 20; rounded up for buckets of slots the rate does not fill)."""
_ZSET_BYTES_PER_ID = 110  # an id kept in the zset (not a UUIDv7/v8, or recorded before the buckets)


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

    @property
    def bytes_per_id(self) -> float:
        """What one remembered id costs the server as reckoned here (compact records, and the sorted
        set's leases and older records at their own size)."""
        if self.ids <= 0:
            return float(INBOX_BYTES_PER_ID)
        zset = self.ids - self.bucket_ids
        return (self.bucket_ids * INBOX_BYTES_PER_ID + zset * _ZSET_BYTES_PER_ID) / self.ids

    def __add__(self, other: InboxMemory) -> InboxMemory:
        return InboxMemory(
            self.ids + other.ids,
            self.bucket_ids + other.bucket_ids,
            self.ids_per_s + other.ids_per_s,
            max(self.window_ms, other.window_ms),
        )


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
    ``framework.runtime.ownership``; filled by :func:`describe`); ``delivered`` counts entries of
    the partition delivered to the group so far (Redis's ``entries-read``; 0 where the transport
    cannot tell), whose growth between two reads is the group's throughput.
    """

    group: str
    consumers: int
    pending: int
    lag: int
    delayed: int
    dead_letters: int
    inbox: InboxMemory = InboxMemory()
    lease: LeaseView | None = None
    delivered: int = 0

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
                g.group,
                {
                    "group": g.group,
                    "consumers": 0,
                    "pending": 0,
                    "lag": 0,
                    "delayed": 0,
                    "dead_letters": 0,
                    "delivered": 0,
                },
            )
            t["consumers"] = max(t["consumers"], g.consumers)
            for k in ("pending", "lag", "delayed", "dead_letters", "delivered"):
                t[k] += getattr(g, k)
            t["_inbox"] = t.get("_inbox", InboxMemory()) + g.inbox
    for t in totals.values():
        inbox = t.pop("_inbox", InboxMemory())
        t["inbox_ids"] = inbox.ids
        t["inbox_ids_per_s"] = round(inbox.ids_per_s, 3)
        t["inbox_window_s"] = inbox.window_ms / 1000
        t["inbox_bytes"] = inbox.bytes  # projected over the whole window at the recent rate
        t["inbox_bytes_per_id"] = round(inbox.bytes_per_id, 1)
    return sorted(totals.values(), key=lambda t: t["group"])


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


@attrs.frozen
class DestinationUsage:
    """What a destination holds: its groups (registered or present on a stream), stored entries, dead letters."""

    groups: list[str]
    entries: int
    dead: int


def select_destinations(specs: list[DestinationSpec], names: Sequence[str] | None) -> list[DestinationSpec]:
    """``specs`` narrowed to ``names`` (all when None or empty); ``ValueError`` naming unknown ones."""
    if not names:
        return specs
    wanted = set(names)
    unknown = wanted - {s.name for s in specs}
    if unknown:
        raise ValueError(f"unknown destination(s): {', '.join(sorted(unknown))}")
    return [s for s in specs if s.name in wanted]


@runtime_checkable
class Introspection(Protocol):
    """Read-only views of a transport's destinations and groups (the ``introspection`` capability)."""

    async def describe(self, names: Sequence[str] | None = None) -> list[DestinationState]:
        """State of every declared destination (or of ``names``), with all groups that subscribed."""
        ...

    async def group_state(self, view: GroupPartition) -> GroupState:
        """Depth figures of ``view``'s group on its partition (its retry path included)."""
        ...

    async def dead_letter_count(self, view: GroupPartition) -> int:
        """Dead letters of ``view``'s group on its partition."""
        ...

    async def inbox_memory(self, view: GroupPartition, *, now: int | None = None) -> InboxMemory:
        """What ``view``'s inbox holds, and the memory it will need over its window."""
        ...

    async def group_usage(self, spec: DestinationSpec, group: str) -> GroupUsage:
        """Everything ``group`` holds on ``spec`` (what unsubscribing would remove)."""
        ...

    async def destination_usage(self, spec: DestinationSpec) -> DestinationUsage:
        """The groups, stored entries and dead letters of ``spec`` (what deleting it would remove)."""
        ...

    async def stored_messages(self, spec: DestinationSpec) -> list[Envelope]:
        """Every message stored on ``spec`` (all partitions, each in order), decoded."""
        ...


@runtime_checkable
class MessageLog(Protocol):
    """A transport that keeps what was published as a log readable without consuming it (Redis
    streams, the memory transport); RabbitMQ has none: a message leaves its queue when consumed."""

    async def read_entries(
        self, spec: DestinationSpec, partition: int, start: str = "-", count: int = 100
    ) -> list[tuple[str, dict[bytes, bytes]]]:
        """Up to ``count`` stored entries of one partition from entry id ``start`` on (inclusive;
        ``-`` the oldest; ``MS`` or ``MS-SEQ``), in order, as ``(entry id, raw fields)``; read-only."""
        ...
