"""Streams in memory: entries under Redis-style ``ms-seq`` ids, consumer groups, their pending entries and consumers."""

from __future__ import annotations

import bisect
import contextlib
import time
from collections.abc import Iterable

import anyio
import attrs

__all__ = [
    "EntryId",
    "Group",
    "Pending",
    "Stream",
    "format_id",
    "mono_ms",
    "parse_id",
    "wall_ms",
]

EntryId = tuple[int, int]
"""An entry id as (milliseconds, sequence): the order of Redis stream ids."""

ZERO: EntryId = (0, 0)


def wall_ms() -> int:
    """Unix time in ms: entry ids, due times, inbox records and idempotency keys (as the Redis server's)."""
    return time.time_ns() // 1_000_000


def mono_ms() -> int:
    """A monotonic clock in ms: idle times of pending entries, consumers' idle times, leases, heartbeats."""
    return time.monotonic_ns() // 1_000_000


def parse_id(text: str) -> EntryId:
    """``"ms-seq"`` (or ``"ms"``) as an :data:`EntryId`; ``ValueError`` for anything else."""
    head, sep, tail = text.partition("-")
    try:
        ms, seq = int(head), int(tail) if sep else 0
    except ValueError:
        raise ValueError(f"invalid stream entry id {text!r}: expected 'ms-seq'") from None
    if ms < 0 or seq < 0:
        raise ValueError(f"invalid stream entry id {text!r}: expected 'ms-seq'")
    return ms, seq


def format_id(entry: EntryId) -> str:
    """An :data:`EntryId` as Redis writes it."""
    return f"{entry[0]}-{entry[1]}"


@attrs.define(slots=True)
class Pending:
    """One entry of a group's pending entries list: who holds it, since when, how often it was delivered."""

    consumer: str
    delivered_at: int  # mono_ms of the last delivery (idle time = now - delivered_at)
    count: int = 1


@attrs.define(slots=True)
class Group:
    """A consumer group of one stream: its cursor, pending entries (in id order) and consumers' last-seen times."""

    last_delivered: EntryId = ZERO
    pel: dict[EntryId, Pending] = attrs.field(factory=dict)  # insertion order is id order (see read_new)
    consumers: dict[str, int] = attrs.field(factory=dict)  # name -> mono_ms last seen

    def seen(self, consumer: str, now: int) -> None:
        """Create ``consumer`` if needed and note it was seen now (as reads and claims do)."""
        self.consumers[consumer] = now

    def pending_count(self, consumer: str) -> int:
        """How many entries ``consumer`` holds."""
        return sum(1 for p in self.pel.values() if p.consumer == consumer)

    def ack(self, ids: Iterable[EntryId]) -> int:
        """Remove ``ids`` from the pending list, whoever holds them; return how many were pending."""
        acked = 0
        for entry in ids:
            if self.pel.pop(entry, None) is not None:
                acked += 1
        return acked


class Stream:
    """An append-only log of field/value entries with increasing ids, its consumer groups and blocked readers."""

    __slots__ = ("entries", "groups", "ids", "last_id", "name", "waiters")

    def __init__(self, name: str) -> None:
        self.name = name
        self.ids: list[EntryId] = []  # live entries, sorted
        self.entries: dict[EntryId, list[bytes]] = {}
        self.last_id: EntryId = ZERO  # the last id generated (kept when entries are deleted)
        self.groups: dict[str, Group] = {}
        self.waiters: set[anyio.Event] = set()  # blocked reads, woken by every append

    def __len__(self) -> int:
        return len(self.ids)

    def add(self, fields: list[bytes]) -> str:
        """Append an entry under a new id (now's ms, or the last id's ms with the next sequence) and wake readers."""
        now = wall_ms()
        last_ms, last_seq = self.last_id
        entry = (now, 0) if now > last_ms else (last_ms, last_seq + 1)
        self.last_id = entry
        self.ids.append(entry)
        self.entries[entry] = fields
        self.wake()
        return format_id(entry)

    def wake(self) -> None:
        """Wake every read blocked on this stream (each checks again and waits again if it finds nothing)."""
        waiters, self.waiters = self.waiters, set()
        for event in waiters:
            with contextlib.suppress(RuntimeError):  # a waiter of an event loop closed without cancelling it
                event.set()

    def delete(self, ids: Iterable[EntryId]) -> int:
        """Delete entries (XDEL); return how many existed."""
        deleted = 0
        for entry in ids:
            if self.entries.pop(entry, None) is not None:
                del self.ids[bisect.bisect_left(self.ids, entry)]
                deleted += 1
        return deleted

    def after(self, start: EntryId, count: int | None = None) -> list[EntryId]:
        """Ids of live entries above ``start``, oldest first, at most ``count``."""
        i = bisect.bisect_right(self.ids, start)
        return self.ids[i : i + count] if count is not None else self.ids[i:]

    def trim_below(self, minid: EntryId) -> int:
        """Delete every entry with an id below ``minid`` (XTRIM MINID, exact); return how many went."""
        i = bisect.bisect_left(self.ids, minid)
        for entry in self.ids[:i]:
            del self.entries[entry]
        del self.ids[:i]
        return i

    def create_group(self, group: str, start: str) -> None:
        """Create ``group`` reading after ``start`` (``"0"``, or ``"$"``: after the last entry); kept if it exists."""
        if group not in self.groups:
            self.groups[group] = Group(last_delivered=self.last_id if start == "$" else parse_id(start))

    def read_new(self, group: Group, consumer: str, count: int, now: int) -> list[EntryId]:
        """Deliver up to ``count`` entries after the group's cursor to ``consumer`` (XREADGROUP ``>``)."""
        group.seen(consumer, now)
        ids = self.after(group.last_delivered, count)
        for entry in ids:
            group.pel[entry] = Pending(consumer, now)  # ids above the cursor: never pending before
        if ids:
            group.last_delivered = ids[-1]
        return ids

    def read_history(
        self, group: Group, consumer: str, start: EntryId, count: int, now: int
    ) -> list[tuple[EntryId, int]]:
        """Deliver again ``consumer``'s own pending entries above ``start`` (XREADGROUP with an id):
        their delivery counts are raised; returns (id, delivery count) pairs, oldest first."""
        group.seen(consumer, now)
        out: list[tuple[EntryId, int]] = []
        for entry, p in group.pel.items():
            if len(out) >= count:
                break
            if entry > start and p.consumer == consumer:
                p.delivered_at = now
                p.count += 1
                out.append((entry, p.count))
        return out

    def autoclaim(
        self, group: Group, consumer: str, min_idle_ms: int, start: EntryId, count: int, now: int
    ) -> tuple[str, list[tuple[EntryId, int]]]:
        """XAUTOCLAIM: scan the pending list from ``start`` (at most ``count * 10`` entries), take those idle
        ``min_idle_ms`` or longer for ``consumer`` (delivery counts raised, entries deleted meanwhile dropped);
        returns the next cursor (``"0-0"``: the scan reached the end) and the claimed (id, count) pairs."""
        group.seen(consumer, now)
        attempts = count * 10
        claimed: list[tuple[EntryId, int]] = []
        gone: list[EntryId] = []
        scan = [entry for entry in group.pel if entry >= start]
        i = 0
        while attempts and len(claimed) < count and i < len(scan):
            attempts -= 1
            entry = scan[i]
            i += 1
            p = group.pel[entry]
            if now - p.delivered_at < min_idle_ms:
                continue
            if entry not in self.entries:
                gone.append(entry)
                continue
            p.consumer, p.delivered_at, p.count = consumer, now, p.count + 1
            claimed.append((entry, p.count))
        for entry in gone:
            del group.pel[entry]
        cursor = format_id(scan[i]) if i < len(scan) else "0-0"
        return cursor, claimed

    def touch(self, group: Group, consumer: str, ids: Iterable[EntryId], idle_ms: int, now: int) -> int:
        """XCLAIM ... JUSTID of pending ``ids`` to ``consumer`` with their idle time set to ``idle_ms``
        (delivery counts unchanged); returns how many were pending."""
        group.seen(consumer, now)
        touched = 0
        for entry in ids:
            p = group.pel.get(entry)
            if p is not None:
                p.consumer, p.delivered_at = consumer, now - idle_ms
                touched += 1
        return touched
