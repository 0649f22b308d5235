"""The broker's scheduling role: messages stored until a due time, then moved to their streams.

A message whose ``deliver-at`` header (:data:`broker.headers.DELIVER_AT`, Unix ms) lies in the
future is not appended by :meth:`~broker.redis.publishing.Publishing.publish`: it is stored in its
partition's scheduled zset (member = message id, score = due ms) and envelopes hash, both under the
partition's hash tag and written by one script (``schedule_add.lua``). A mover
(:meth:`Scheduling.move_scheduled`, run by every runtime of the namespace) appends due messages to
their partition streams with ``schedule_move.lua``: the XADD and the removal happen in one script,
so movers racing on several processes never deliver a message twice, and a message is either
delivered or cancelled (``schedule_cancel.lua``), never both.

Which partitions hold scheduled messages is kept in one namespace-wide index zset
(``<ns>:scheduled``, member ``"<dest>|<p>"``, score = a hint of the earliest due ms). A producer
lowers the hint (ZADD LT) *before* it stores the message, so a crash between the two leaves at
most a stale index member, never a message no mover looks at. A mover raises the hint to the next
due time after a move; a producer racing with it may see its lower hint overwritten, so the mover
also sweeps every indexed partition once a second (:meth:`move_scheduled` with ``sweep=True``):
such a message is at most about a second late. Index members are never removed (one per
destination partition ever scheduled to, a small set).

The key layout is in :mod:`broker.redis.keys`; each script documents its keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from broker.codec import decode_flat, encode_fields
from broker.envelope import Envelope
from broker.headers import IDEMPOTENCY_KEY
from broker.redis.core import ScriptCall, text
from broker.redis.keys import PartitionKeys
from broker.redis.topology import Topology
from broker.scheduling import MoveResult, ScheduledMessage, due_of

__all__ = ["MoveResult", "ScheduledMessage", "Scheduling", "due_of"]

_INF = float("inf")


def _member(destination: str, partition: int) -> str:
    return f"{destination}|{partition}"


def _parse_member(member: Any) -> tuple[str, int]:
    destination, _, partition = text(member).rpartition("|")
    return destination, int(partition)


class Scheduling(Topology):
    """Stores scheduled messages and moves them to their streams when due."""

    def _schedule_call(self, pkeys: PartitionKeys, env: Envelope, due: int, now: int, window: int) -> ScriptCall:
        """The ``schedule_add`` call of one envelope (publish queues it with its other calls)."""
        idem = env.headers.get(IDEMPOTENCY_KEY, "") if env.headers else ""
        keys = [pkeys.scheduled, pkeys.scheduled_envelopes, pkeys.published]
        return ("schedule_add", keys, [env.id, due, idem, now, window, *encode_fields(env)])

    async def _index_scheduled(self, partitions: dict[tuple[str, int], int]) -> None:
        """Lower the index hints of partitions about to receive scheduled messages (before storing them)."""
        index = self.keyspace.scheduled_index
        mapping = {_member(d, p): due for (d, p), due in partitions.items()}
        await self.redis.zadd(index, mapping, lt=True)  # LT: also adds new members

    async def _scheduled_partitions(self, destination: str | None = None) -> list[tuple[str, int]]:
        members = await self.redis.zrange(self.keyspace.scheduled_index, 0, -1)
        parts = [_parse_member(m) for m in members]
        return [p for p in parts if destination is None or p[0] == destination]

    async def move_scheduled(self, now_ms: int, *, limit: int = 1000, sweep: bool = False) -> MoveResult:
        """Append due scheduled messages of the namespace to their partition streams.

        Looks at the partitions whose index hint is due (``sweep``: at every indexed partition),
        moves up to ``limit`` messages from each in one atomic script call per partition (all in one
        round trip), then sets each partition's hint to its next due time.
        """
        index = self.keyspace.scheduled_index
        if sweep:
            members = await self.redis.zrange(index, 0, -1)
        else:
            members = await self.redis.zrange(index, "-inf", now_ms, byscore=True, offset=0, num=256)
        moved = 0
        more = False
        if members:
            parts = [_parse_member(m) for m in members]
            calls: list[ScriptCall] = []
            for destination, partition in parts:
                pkeys = self._partition_keys(destination, partition)
                calls.append(
                    ("schedule_move", [pkeys.scheduled, pkeys.scheduled_envelopes, pkeys.stream], [now_ms, limit])
                )
            replies = await self._run_pipeline(calls)
            hints: dict[str, float] = {}
            for (destination, partition), reply in zip(parts, replies, strict=True):
                n, nxt = int(reply[0]), int(float(text(reply[1])))
                moved += n
                more = more or n >= limit
                hints[_member(destination, partition)] = _INF if nxt < 0 else nxt
            # Raise each hint to its partition's next due time (a producer's lower hint written since is
            # overwritten here: the sweep finds its message within a second, see the module docstring).
            await self.redis.zadd(index, hints, xx=True)
        first = await self.redis.zrange(index, 0, 0, withscores=True)
        next_due = None
        if first and first[0][1] != _INF:
            next_due = int(first[0][1])
        return MoveResult(moved=moved, next_due_ms=next_due, more=more)

    async def cancel_scheduled(self, message_ids: Sequence[str], *, destination: str | None = None) -> int:
        """Cancel scheduled messages by id (looked for in every indexed partition, or ``destination``'s).

        Returns how many were still scheduled; a message already delivered cannot be cancelled.
        """
        if not message_ids:
            return 0
        parts = await self._scheduled_partitions(destination)
        if not parts:
            return 0
        calls: list[ScriptCall] = []
        for d, p in parts:
            pkeys = self._partition_keys(d, p)
            calls.append(("schedule_cancel", [pkeys.scheduled, pkeys.scheduled_envelopes], list(message_ids)))
        return sum(int(r) for r in await self._run_pipeline(calls))

    async def scheduled_messages(
        self, *, destination: str | None = None, limit: int = 100, message_ids: Sequence[str] = ()
    ) -> list[ScheduledMessage]:
        """Scheduled messages, earliest due first: up to ``limit`` (of ``destination`` if given), or
        those among ``message_ids``."""
        parts = await self._scheduled_partitions(destination)
        if not parts:
            return []
        calls: list[ScriptCall] = []
        for d, p in parts:
            pkeys = self._partition_keys(d, p)
            calls.append(("schedule_read", [pkeys.scheduled, pkeys.scheduled_envelopes], [limit, *message_ids]))
        out: list[ScheduledMessage] = []
        for (d, p), rows in zip(parts, await self._run_pipeline(calls), strict=True):
            spec = await self.get_destination(d)
            for row in rows:
                message_id, due, flat = text(row[0]), int(float(text(row[1]))), list(row[2:])
                env: Envelope | None = None
                if spec is not None:
                    try:
                        env = decode_flat(flat, d, spec.kind)
                    except Exception:  # shown undecoded rather than hidden
                        env = None
                out.append(ScheduledMessage(message_id, d, p, due, env))
        out.sort(key=lambda m: (m.due_ms, m.message_id))
        return out if message_ids else out[:limit]

    async def count_scheduled(self, destination: str | None = None) -> int:
        """How many messages wait for their due time (in ``destination``, or the whole namespace)."""
        parts = await self._scheduled_partitions(destination)
        if not parts:
            return 0
        pipe = self.redis.pipeline(transaction=False)
        for d, p in parts:
            pipe.zcard(self._partition_keys(d, p).scheduled)
        return sum(int(n) for n in await pipe.execute())

    async def fire_tick(self, queue: str, tick_ms: int, envelope: Envelope) -> int:
        """Append a recurring job's tick message to ``queue`` (partition 0) unless that tick, or a
        later one, was fired before. Returns 1 (fired), 0 (fired before) or -1 (the job's first tick
        seen: recorded as its baseline, not fired). See ``job_tick.lua``."""
        pkeys = self._partition_keys(queue, 0)
        return int(
            await self.scripts["job_tick"](self.redis, [pkeys.stream, pkeys.job], [tick_ms, *encode_fields(envelope)])
        )
