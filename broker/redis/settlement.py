"""The broker's settlement role: ack, count attempts, dead-letter, retry later, retention (effects: ``state.py``).

Every step that settles a delivery is one script call that does nothing when the entry is no
longer pending (another consumer settled it), so settling twice is harmless.

Fencing: each settle call takes the caller's ``token`` for the partition's lease (partition
ownership, :mod:`broker.redis.leases`); the script compares it with the lease's current token
(one HGET) and, when another instance acquired the partition since, changes nothing and the
call raises :class:`~broker.errors.LeaseLost`. ``token=None`` (the partition is not owned) skips
the check.
"""

from __future__ import annotations

import struct
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from broker.envelope import now_ms
from broker.errors import LeaseLost
from broker.headers import FIRST_FAILED_AT
from broker.protocol import Delivery, GroupPartition, GuardedWrite
from broker.redis.core import ScriptCall, text
from broker.redis.keys import inbox_records
from broker.redis.reading import SCRIPT_CHUNK, lease_lost
from broker.redis.topology import Topology
from broker.redis.wire import Channel
from broker.topology import DestinationSpec

__all__ = ["FENCED", "Settlement", "fence_arg", "lost"]

_WRITE_CHUNK = 250
"""Entries per ack call when some carry guarded writes (each write is a few server calls: the
script blocks the server while it runs)."""

FENCED = -1
"""What a settle script returns when the caller's fencing token is no longer current."""


def fence_arg(token: int | None) -> str:
    """A fencing token as the settle scripts take it ('' for none: no check)."""
    return "" if token is None else str(token)


def lost(source: GroupPartition) -> LeaseLost:
    """The error of a settle call the fencing check refused."""
    return lease_lost(source, "nothing was settled; the new owner delivers the entries again")


class Settlement(Topology):
    """Settles deliveries: success (ack; with effects: :mod:`broker.redis.state`), failure (retry later,
    dead letter), and retention."""

    async def ack(
        self,
        source: GroupPartition,
        deliveries: Sequence[Delivery],
        *,
        inbox: bool = False,
        channel: Channel | None = None,
        token: int | None = None,
    ) -> int:
        """Acknowledge deliveries in one round trip; with ``inbox`` also record their message ids.

        A delivery's ``settle_write`` (:class:`~broker.protocol.GuardedWrite`) is applied in the same
        script call, its ``outcome`` set; a delivery whose write was not applied for its guard or a
        refusal stays pending (not acknowledged, not recorded in the inbox).
        Raises :class:`~broker.errors.LeaseLost` when ``token`` is no longer current (nothing acked)."""
        if not deliveries:
            return 0
        by_stream: dict[str, list[Delivery]] = defaultdict(list)
        writing = False
        for d in deliveries:
            by_stream[d.stream].append(d)
            if d.settle_write is not None:
                writing = True
        now = now_ms()
        calls: list[ScriptCall] = []
        keys = source.keys
        script_keys = [keys.inbox, keys.attempts, keys.lease]
        fence = fence_arg(token)
        chunk_size = _WRITE_CHUNK if writing else SCRIPT_CHUNK
        written: list[list[GuardedWrite]] = []  # per call, its writes in order
        for stream, items in by_stream.items():
            delete = "1" if source.deletes_on_ack(stream) else "0"
            for i in range(0, len(items), chunk_size):
                chunk = items[i : i + chunk_size]
                marks = [d.envelope.id for d in chunk if d.envelope is not None] if inbox else []
                counters = [d.envelope.id for d in chunk if d.delivery_count > 1 and d.envelope is not None]
                args: list[Any] = [
                    source.group,
                    delete,
                    now,
                    len(chunk),
                    len(marks),
                    len(counters),
                    *(d.entry_id for d in chunk),
                    *marks,
                    inbox_records(marks),
                    *counters,
                ]
                call_keys = [stream, *script_keys]
                writes: list[GuardedWrite] = []
                if writing:  # the writes' part of ARGV (see ack.lua)
                    shapes: dict[tuple[str, tuple[str, ...]], int] = {}  # (guard, names) -> its number
                    meta: list[int] = []  # per write: its entry's index, its inbox id's (0: none), its shape
                    values: list[Any] = []  # per write: the expected value, then the values
                    mark = 0
                    for index, d in enumerate(chunk, 1):
                        if inbox and d.envelope is not None:
                            mark += 1
                            marked = mark
                        else:
                            marked = 0
                        w = d.settle_write
                        if w is not None:
                            writes.append(w)
                            call_keys.append(w.key)
                            shape = (w.guard, w.names)
                            number = shapes.get(shape)
                            if number is None:
                                number = shapes[shape] = len(shapes) + 1
                            meta += (index, marked, number)
                            values.append(w.expected)
                            values += w.values
                    args += (len(writes), struct.pack(f">{len(meta)}H", *meta), len(shapes))
                    for guard, names in shapes:
                        args += (len(names), guard, *names)
                    args += values
                else:
                    args.append(0)
                args.append(fence)
                written.append(writes)
                calls.append(("ack", call_keys, args))
        raw = await (self._run_on(channel, calls) if channel is not None else self._run_pipeline(calls))
        replies: list[int] = []
        for reply, writes in zip(raw, written, strict=True):
            if isinstance(reply, list):
                replies.append(int(reply[0]))
                for w, out in zip(writes, reply[1:], strict=True):
                    if type(out) is int:
                        w.outcome = out
                    elif isinstance(out, list):
                        w.outcome, w.error = GuardedWrite.FAILED, text(out[0])
                    else:
                        w.outcome = int(out)
            else:
                replies.append(int(reply))
        if FENCED in replies:
            raise lost(source)
        return sum(replies)

    async def count_attempt(self, delivery: Delivery) -> int:
        """Record that a redelivered message is about to run; return how many such runs it had.

        First deliveries are not counted (that would cost a write per message): a message whose
        handler kills its process is recognised on its redeliveries.
        """
        return int(await self.redis.hincrby(delivery.source.keys.attempts, delivery.message_id, 1))

    async def count_first_redeliveries(self, deliveries: Sequence[Delivery]) -> list[bool]:
        """Count the first redelivered run of each message that has had none; one round trip.

        Per delivery: True when it had no counted redelivered run (its counter is now 1: this
        run), False when an earlier redelivered run started and did not complete (its counter is
        left as it is, for :meth:`count_attempt` to raise just before it runs again).
        """
        if not deliveries:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for d in deliveries:
            pipe.hsetnx(d.source.keys.attempts, d.message_id, 1)
        return [bool(int(r)) for r in await pipe.execute()]

    async def dead_letter(self, delivery: Delivery, reason: dict[str, str], *, token: int | None = None) -> str | None:
        """Write the delivery's fields plus ``reason`` to the group's DLQ and ack it, atomically.

        Raises :class:`~broker.errors.LeaseLost` when ``token`` is no longer current (nothing done)."""
        source = delivery.source
        flat: list[Any] = []
        for k, v in delivery.fields.items():
            flat += (k, v)
        for name, value in reason.items():
            flat += (name, value)
        if not flat:
            flat = ["dlq-empty", "1"]  # the entry was deleted: keep a record all the same
        delete = "1" if source.deletes_on_ack(delivery.stream) else "0"
        reply = await self.scripts["dead_letter"](
            self.redis,
            [delivery.stream, source.keys.dlq, source.keys.inbox, source.keys.attempts, source.keys.lease],
            [source.group, delivery.entry_id, delete, delivery.message_id, *flat, fence_arg(token)],
        )
        if reply == FENCED:
            raise lost(source)
        return None if reply is None else text(reply)

    async def retry_later(
        self, delivery: Delivery, due_ms: int, *, attempt: int | None = None, token: int | None = None
    ) -> bool:
        """Park the delivery until ``due_ms`` for its group only, atomically with its ack.

        The parked copy carries ``attempt + 1`` (default: the delivery's attempt) and the time of
        its first failure (field ``first-failed-at``), which dead letters report. Raises
        :class:`~broker.errors.LeaseLost` when ``token`` is no longer current (nothing done).
        """
        if delivery.envelope is None:
            raise ValueError("an undecodable delivery cannot be retried; dead-letter it")
        source = delivery.source
        fields = {k: v for k, v in delivery.fields.items() if k != b"attempt"}
        fields[b"attempt"] = str((attempt if attempt is not None else delivery.attempt) + 1).encode()
        fields.setdefault(FIRST_FAILED_AT.encode(), str(now_ms()).encode())
        flat: list[Any] = []
        for k, v in fields.items():
            flat += (k, v)
        delete = "1" if source.deletes_on_ack(delivery.stream) else "0"
        reply = await self.scripts["retry_later"](
            self.redis,
            [delivery.stream, source.keys.delayed, source.keys.inbox, source.keys.attempts, source.keys.lease],
            [source.group, delivery.entry_id, delete, due_ms, delivery.message_id, *flat, fence_arg(token)],
        )
        if reply == FENCED:
            raise lost(source)
        return bool(reply)

    async def move_due(self, source: GroupPartition, now_ms: int, limit: int = 500) -> int:
        """Move due delayed retries of the group to its redeliver stream."""
        keys = [source.keys.delayed, source.keys.redeliver]
        return int(await self.scripts["move_due"](self.redis, keys, [now_ms, limit]))

    # -- retention -----------------------------------------------------------------------------

    async def trim(self, spec: DestinationSpec, partition: int, now_ms: int, *, max_removed: int = 10_000) -> int:
        """Trim a topic partition by its retention, never below an unacknowledged entry.

        Queues are not trimmed (their entries are deleted on ack). Also drops producer
        idempotency keys whose dedup window ended (score = expiry <= ``now_ms``; publishing removes
        them too, see ``publish_once.lua``). Returns the number of stream entries removed.
        """
        pkeys = self.keyspace.partition(spec.name, partition)
        await self.redis.zremrangebyscore(pkeys.published, "-inf", now_ms)
        if not spec.is_topic or (spec.retention_ms is None and spec.max_length is None):
            return 0
        cutoff = f"{max(now_ms - spec.retention_ms, 0)}-0" if spec.retention_ms is not None else "0"
        return int(await self.scripts["trim"](self.redis, [pkeys.stream], [cutoff, spec.max_length or 0, max_removed]))

    async def trim_inbox(self, source: GroupPartition, older_than_ms: int) -> int:
        """Forget processed ids the zset recorded before ``older_than_ms`` (the dedup window's end: ids
        that are not UUIDv7/v8, and records from before the buckets) and leases that expired (their
        handlers died; a redelivery takes the message over). The buckets expire by themselves."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.zremrangebyscore(source.keys.inbox, 0, older_than_ms)
        pipe.zremrangebyscore(source.keys.inbox, f"({-now_ms()}", "(0")
        return sum(int(x) for x in await pipe.execute())

    async def inbox_ready(self) -> None:
        """Nothing to check: the inbox lives on this broker's own server, connected already."""
