"""The memory broker's scheduling role: messages stored until a due time, then moved to their streams; job ticks.

The same model as ``broker/redis/scheduling.py``: a message whose ``deliver-at`` header lies ahead
is kept beside its partition (message id -> due time and entry fields) until a mover appends it.
Each step here runs without yielding to other tasks, so a message is moved exactly once, and is
either delivered or cancelled, never both. The index of partitions holding scheduled messages is
exact here (no hints), so a due message is never late by the Redis sweep's second.
"""

from __future__ import annotations

from collections.abc import Sequence

from broker.codec import decode_flat, encode_fields
from broker.envelope import Envelope
from broker.memory.core import flatten
from broker.memory.server import PartitionState
from broker.memory.topology import Topology
from broker.scheduling import MoveResult, ScheduledMessage

__all__ = ["Scheduling"]


class Scheduling(Topology):
    """Stores scheduled messages and moves them to their streams when due; fires recurring jobs' ticks."""

    def _schedule(
        self, destination: str, partition: int, env: Envelope, due: int, idem: str, now: int, window: int
    ) -> str | None:
        """schedule_add.lua / schedule_batch.lua: store ``env`` until ``due``; its message id, or None when
        its idempotency key was stored before and has not expired (nothing done). An id scheduled already
        keeps its first schedule."""
        state = self.server.partition(self.partition_stream(destination, partition))
        if idem:
            state.forget_expired(now, 100)
            if state.seen(idem, now):
                return None
        self.registry.scheduled.setdefault((destination, partition), None)
        if env.id in state.scheduled:
            return env.id
        state.scheduled[env.id] = (due, flatten(encode_fields(env)))
        if idem:
            state.remember(idem, now, window)
        return env.id

    def _store_scheduled(self, destination: str, partition: int, env: Envelope, due: int) -> None:
        """Store ``env`` until ``due`` as a state commit does (:class:`~broker.state.ScheduleMessage`): one
        of its id scheduled already is replaced (the Redis commit's ZADD and HSET)."""
        self.registry.scheduled.setdefault((destination, partition), None)
        state = self.server.partition(self.partition_stream(destination, partition))
        state.scheduled[env.id] = (due, flatten(encode_fields(env)))

    def _scheduled_states(self, destination: str | None = None) -> list[tuple[str, int, PartitionState]]:
        """The indexed partitions (of ``destination``, if given) with their state."""
        out = []
        for d, p in self.registry.scheduled:
            if destination is None or d == destination:
                state = self.server.partitions.get(self.partition_stream(d, p))
                if state is not None:
                    out.append((d, p, state))
        return out

    async def move_scheduled(self, now_ms: int, *, limit: int = 1000, sweep: bool = False) -> MoveResult:
        """Append due scheduled messages of the namespace to their partition streams, at most ``limit``
        per partition (earliest due first); ``sweep`` changes nothing here (the index is exact)."""
        await self._checkpoint()
        moved = 0
        more = False
        next_due: int | None = None
        for d, p, state in self._scheduled_states():
            due = sorted((at, mid) for mid, (at, _) in state.scheduled.items() if at <= now_ms)[:limit]
            if due:
                stream = self.server.stream(self.partition_stream(d, p))
                for _, mid in due:
                    _, fields = state.scheduled.pop(mid)
                    stream.add(fields)
                moved += len(due)
                more = more or len(due) >= limit
            if state.scheduled:
                first = min(at for at, _ in state.scheduled.values())
                next_due = first if next_due is None else min(next_due, first)
        return MoveResult(moved=moved, next_due_ms=next_due, more=more)

    async def cancel_scheduled(self, message_ids: Sequence[str], *, destination: str | None = None) -> int:
        """Cancel scheduled messages by id (in every partition, or ``destination``'s); return how many were
        still scheduled (a message already delivered cannot be cancelled)."""
        await self._checkpoint()
        cancelled = 0
        for _, _, state in self._scheduled_states(destination):
            for mid in message_ids:
                if state.scheduled.pop(mid, None) is not None:
                    cancelled += 1
        return cancelled

    async def scheduled_messages(
        self, *, destination: str | None = None, limit: int = 100, message_ids: Sequence[str] = ()
    ) -> list[ScheduledMessage]:
        """Scheduled messages, earliest due first: up to ``limit`` (of ``destination`` if given), or
        those among ``message_ids``."""
        await self._checkpoint()
        out: list[ScheduledMessage] = []
        for d, p, state in self._scheduled_states(destination):
            if message_ids:
                rows = [(mid, state.scheduled[mid]) for mid in message_ids if mid in state.scheduled]
            else:
                rows = sorted(state.scheduled.items(), key=lambda r: (r[1][0], r[0]))[:limit]
            spec = self.registry.destinations.get(d)
            for mid, (due, flat) in rows:
                env: Envelope | None = None
                if spec is not None:
                    try:
                        env = decode_flat(list(flat), d, spec.kind)
                    except Exception:  # shown undecoded rather than hidden
                        env = None
                out.append(ScheduledMessage(mid, d, p, due, env))
        out.sort(key=lambda m: (m.due_ms, m.message_id))
        return out if message_ids else out[:limit]

    async def count_scheduled(self, destination: str | None = None) -> int:
        """How many messages wait for their due time (in ``destination``, or the whole namespace)."""
        await self._checkpoint()
        return sum(len(state.scheduled) for _, _, state in self._scheduled_states(destination))

    async def fire_tick(self, queue: str, tick_ms: int, envelope: Envelope) -> int:
        """Append a recurring job's tick message to ``queue`` (partition 0) unless that tick, or a later
        one, was fired before: 1 fired, 0 fired before, -1 the job's first tick seen (recorded, not fired)."""
        await self._checkpoint()
        stream = self.partition_stream(queue, 0)
        state = self.server.partition(stream)
        last = state.job_last
        if last is not None and last >= tick_ms:
            return 0
        state.job_last = tick_ms
        if last is None:
            return -1
        self.server.stream(stream).add(flatten(encode_fields(envelope)))
        state.job_fired += 1
        return 1
