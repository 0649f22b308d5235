"""The memory broker's settlement role: ack (with guarded writes), attempts, dead letter, retry later, retention.

Each settling call runs without yielding to other tasks once it starts, so it is one atomic step, and
does nothing for an entry no longer pending (another consumer settled it): settling twice is harmless.
Fencing as on Redis: a ``token`` that is not the partition lease's current one raises ``LeaseLost``
before anything changes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from broker.envelope import now_ms as wall_now
from broker.headers import FIRST_FAILED_AT
from broker.memory.core import as_bytes
from broker.memory.streams import EntryId, parse_id, wall_ms
from broker.memory.topology import Topology
from broker.protocol import Delivery, GroupPartition, GuardedWrite
from broker.topology import DestinationSpec

__all__ = ["Settlement"]


class Settlement(Topology):
    """Settles deliveries: success (ack), failure (retry later, dead letter), and retention."""

    async def ack(
        self,
        source: GroupPartition,
        deliveries: Sequence[Delivery],
        *,
        inbox: bool = False,
        channel: Any = None,
        token: int | None = None,
    ) -> int:
        """Acknowledge deliveries; with ``inbox`` also record their message ids as processed.

        As ``ack.lua``: a delivery's ``settle_write`` is applied first (``outcome`` set: 1 written; 0 skipped,
        the entry no longer pending or its message processed before; -2 its guard failed, then the entry
        stays pending and its id is not recorded). Inbox ids are recorded and redelivered messages' attempt
        counters dropped whether or not their entry was still pending. Returns how many entries were
        pending (acknowledged now); ``LeaseLost`` when ``token`` is not current (nothing done).
        """
        if not deliveries:
            return 0
        await self._checkpoint()
        self._fence(source, token)
        by_stream: dict[str, list[Delivery]] = defaultdict(list)
        for d in deliveries:
            by_stream[d.stream].append(d)
        state = self.server.group(source.stream, source.group)
        now = wall_ms()
        acked = 0
        for name, items in by_stream.items():
            stream = self.server.streams.get(name)
            group = stream.groups.get(source.group) if stream is not None else None
            held = self._guarded_writes(items, group.pel if group is not None else {}, inbox, token, now)
            entries = [parse_id(d.entry_id) for d in items if id(d) not in held]
            if group is not None:
                acked += group.ack(entries)
            if stream is not None and source.deletes_on_ack(name):
                stream.delete(entries)
            if inbox:
                state.inbox.record([d.message_id for d in items if d.envelope is not None and id(d) not in held], now)
            for d in items:
                if d.delivery_count > 1 and d.envelope is not None:
                    state.attempts.pop(d.message_id, None)
        return acked

    def _guarded_writes(
        self, items: list[Delivery], pel: dict[EntryId, Any], inbox: bool, token: int | None, now: int
    ) -> set[int]:
        """Apply the deliveries' guarded writes (ack.lua's first part); return the ``id()`` of deliveries
        whose write was refused by its guard (left pending, not recorded)."""
        writes = [d for d in items if d.settle_write is not None]
        if not writes:
            return set()
        box = self.server.group(items[0].source.stream, items[0].source.group).inbox
        seen = {d.message_id: box.processed(d.message_id, now) for d in writes if inbox and d.envelope is not None}
        done: set[str] = set()
        held: set[int] = set()
        for d in writes:
            w = d.settle_write
            assert w is not None
            mid = d.message_id if inbox and d.envelope is not None else None
            if (token is None or mid is None) and parse_id(d.entry_id) not in pel:
                w.outcome = GuardedWrite.SKIPPED  # settled already
            elif mid is not None and (seen[mid] or mid in done):
                w.outcome = GuardedWrite.SKIPPED  # processed before: a duplicate
            else:
                self.server.live_hash(w.key, now)  # (an expired one is gone)
                target = self.server.hashes.setdefault(w.key, {})
                if target.get(w.guard.encode(), b"") != as_bytes(w.expected):
                    w.outcome = GuardedWrite.CONFLICT
                    held.add(id(d))
                else:
                    for field, value in zip(w.names, w.values, strict=True):
                        target[field.encode()] = as_bytes(value)
                    w.outcome = GuardedWrite.APPLIED
                    if mid is not None:
                        done.add(mid)
                if not target:
                    self.server.delete_hash(w.key)
        return held

    async def count_attempt(self, delivery: Delivery) -> int:
        """Record that a redelivered message is about to run; return how many such runs it had."""
        await self._checkpoint()
        attempts = self.server.group(delivery.source.stream, delivery.source.group).attempts
        attempts[delivery.message_id] = attempts.get(delivery.message_id, 0) + 1
        return attempts[delivery.message_id]

    async def count_first_redeliveries(self, deliveries: Sequence[Delivery]) -> list[bool]:
        """Count the first redelivered run of each message that has had none: True when it had none (its
        counter is now 1), False when an earlier redelivered run started and did not complete."""
        await self._checkpoint()
        out: list[bool] = []
        for d in deliveries:
            attempts = self.server.group(d.source.stream, d.source.group).attempts
            first = d.message_id not in attempts
            if first:
                attempts[d.message_id] = 1
            out.append(first)
        return out

    def _settle_one(self, delivery: Delivery, token: int | None) -> bool:
        """The common part of dead_letter.lua and retry_later.lua, after the caller wrote the entry's copy:
        the fencing check was made; ack (and delete) the entry, release its lease, drop its counter."""
        source = delivery.source
        found = self._pending_in(delivery.stream, source.group, delivery.entry_id)
        if found is None:
            return False
        stream, group, entry = found
        group.ack([entry])
        if source.deletes_on_ack(delivery.stream):
            stream.delete([entry])
        if delivery.message_id:
            state = self.server.group(source.stream, source.group)
            state.inbox.release(delivery.message_id)
            state.attempts.pop(delivery.message_id, None)
        return True

    async def dead_letter(self, delivery: Delivery, reason: dict[str, str], *, token: int | None = None) -> str | None:
        """Write the delivery's fields plus ``reason`` to the group's DLQ and ack it, atomically; the dead
        letter's id, or None when the entry was no longer pending (nothing written). ``LeaseLost`` when
        ``token`` is not current (nothing done)."""
        await self._checkpoint()
        source = delivery.source
        self._fence(source, token)
        if self._pending_in(delivery.stream, source.group, delivery.entry_id) is None:
            return None
        flat: list[bytes] = []
        for k, v in delivery.fields.items():
            flat += (k, v)
        for name, value in reason.items():
            flat += (as_bytes(name), as_bytes(value))
        if not flat:
            flat = [b"dlq-empty", b"1"]  # the entry was deleted: keep a record all the same
        dead = self.server.stream(source.keys.dlq).add(flat)
        self._settle_one(delivery, token)
        return dead

    async def retry_later(
        self, delivery: Delivery, due_ms: int, *, attempt: int | None = None, token: int | None = None
    ) -> bool:
        """Park the delivery until ``due_ms`` for its group only, atomically with its ack; the copy carries
        ``attempt + 1`` (default: the delivery's attempt) and its first failure's time. False when the entry
        was no longer pending; ``ValueError`` for an undecodable delivery; ``LeaseLost`` as :meth:`ack`."""
        if delivery.envelope is None:
            raise ValueError("an undecodable delivery cannot be retried; dead-letter it")
        await self._checkpoint()
        source = delivery.source
        self._fence(source, token)
        fields = {k: v for k, v in delivery.fields.items() if k != b"attempt"}
        fields[b"attempt"] = str((attempt if attempt is not None else delivery.attempt) + 1).encode()
        fields.setdefault(FIRST_FAILED_AT.encode(), str(wall_now()).encode())
        if self._pending_in(delivery.stream, source.group, delivery.entry_id) is None:
            return False
        flat = tuple(x for kv in fields.items() for x in kv)
        self.server.group(source.stream, source.group).delayed[flat] = due_ms
        return self._settle_one(delivery, token)

    async def move_due(self, source: GroupPartition, now_ms: int, limit: int = 500) -> int:
        """Append the group's delayed retries due at ``now_ms`` (earliest first, at most ``limit``) to its
        redeliver stream; each moves exactly once."""
        await self._checkpoint()
        state = self.server.groups.get((source.stream, source.group))
        if state is None or not state.delayed:
            return 0
        due = sorted((at, flat) for flat, at in state.delayed.items() if at <= now_ms)[:limit]
        stream = self.server.stream(source.keys.redeliver)
        for _, flat in due:
            del state.delayed[flat]
            stream.add(list(flat))
        return len(due)

    # -- retention -----------------------------------------------------------------------------

    async def trim(self, spec: DestinationSpec, partition: int, now_ms: int, *, max_removed: int = 10_000) -> int:
        """Trim a topic partition by its retention, never below an entry some group has not acknowledged or
        not been delivered (``trim.lua``); queues are not trimmed. Also drops producer idempotency keys whose
        window ended by ``now_ms``. Returns the number of entries removed."""
        await self._checkpoint()
        name = self.partition_stream(spec.name, partition)
        state = self.server.partitions.get(name)
        if state is not None:
            state.forget_expired(now_ms)
        stream = self.server.streams.get(name)
        if not spec.is_topic or (spec.retention_ms is None and spec.max_length is None) or stream is None:
            return 0
        cutoff: EntryId | None = (max(now_ms - spec.retention_ms, 0), 0) if spec.retention_ms is not None else None
        if spec.max_length:
            excess = min(len(stream) - spec.max_length, max_removed)
            if excess > 0:
                head = stream.ids[excess]  # the first entry kept by length
                if cutoff is None or cutoff < head:
                    cutoff = head
        if cutoff is None:
            return 0
        for group in stream.groups.values():
            after_last = (group.last_delivered[0], group.last_delivered[1] + 1)
            cutoff = min(cutoff, after_last)
            if group.pel:
                cutoff = min(cutoff, next(iter(group.pel)))
        return stream.trim_below(cutoff)

    async def trim_inbox(self, source: GroupPartition, older_than_ms: int) -> int:
        """Forget processed ids the zset recorded at or before ``older_than_ms`` (ids that are not UUIDv7/v8)
        and leases that expired; UUIDv7/v8 records expire a dedup window after their ack by themselves."""
        await self._checkpoint()
        state = self.server.groups.get((source.stream, source.group))
        return state.inbox.trim(older_than_ms, wall_ms()) if state is not None else 0

    async def inbox_ready(self) -> None:
        """Nothing to check: the inbox lives in this process's server."""
