"""Scheduled messages and recurring jobs' ticks of a transport that keeps none itself (RabbitMQ), in the
Redis beside it: :class:`RedisSchedule` (the ``SideSchedule`` of :mod:`broker.rabbitmq.scheduling`).

It shares the Redis inbox's connection (:class:`~broker.redis.side_inbox.RedisInbox`) and keeps
everything under the keys the Redis transport uses for the same destinations: a message due later is
stored by the Redis transport's own publish (``schedule_add.lua``: the partition's scheduled zset and
envelopes hash, the namespace's index), so listing, counting and cancelling are the Redis transport's
calls, and a tick is fired by its ``job_tick.lua``. What the Redis transport appends to a partition
stream (a due message moved by ``schedule_move.lua``, a fired tick) is a hand-off here: the
partition's Redis stream is read by the ``_forward`` group, each entry published to the other
transport (confirmed) and only then acknowledged and deleted. A mover that dies between the publish
and the ack leaves the entry pending; the next sweep (once a second) takes over entries pending
longer than :data:`STALE_MS` and publishes them again: a duplicate with the same message id, which
the consumers' inbox drops. So a scheduled message or a tick is never lost and never delivered twice
to a handler; it may be published twice.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from broker.codec import decode_flat
from broker.envelope import Envelope
from broker.redis.broker import RedisBroker
from broker.redis.core import text
from broker.redis.side_inbox import RedisInbox
from broker.scheduling import MoveResult, ScheduledMessage
from broker.topology import DestinationSpec

__all__ = ["STALE_MS", "RedisSchedule"]

STALE_MS = 30_000
"""A hand-off entry pending this long (its mover died before acknowledging it) is published again."""

_GROUP = "_forward"

Forward = Callable[[Sequence[Envelope]], Awaitable[None]]
"""Publishes envelopes to the other transport, confirmed (raises when it could not)."""


def _member(destination: str, partition: int) -> str:
    return f"{destination}|{partition}"


class RedisSchedule:
    """Scheduled messages and ticks in the Redis of ``inbox`` (see the module's docstring)."""

    def __init__(self, inbox: RedisInbox) -> None:
        self.inbox = inbox
        self.consumer = f"forward-{uuid.uuid4().hex[:12]}"
        self.stale_ms = STALE_MS
        self._declared: set[DestinationSpec] = set()
        self._groups: set[str] = set()

    def describe(self) -> str:
        """Where the schedule lives (no password)."""
        return self.inbox.describe()

    async def _broker(self, specs: Sequence[DestinationSpec] = ()) -> RedisBroker:
        broker = await self.inbox.redis_broker()
        for spec in specs:
            if spec not in self._declared:
                await broker.declare(spec)  # same partitions here as on the other transport
                self._declared.add(spec)
        return broker

    async def store(
        self, spec: DestinationSpec, envelopes: Sequence[Envelope], dedup_window_ms: int | None
    ) -> list[str | None]:
        """Store ``envelopes`` of ``spec`` (their ``deliver-at`` ahead) until due, idempotency keys honoured
        as on Redis (None for a repeated one); one due meanwhile goes to the hand-off stream and is
        forwarded by the next move."""
        broker = await self._broker([spec])
        return await broker.publish(envelopes, dedup_window_ms=dedup_window_ms)

    async def move(self, now_ms: int, limit: int, sweep: bool, forward: Forward) -> MoveResult:
        """Move due messages to the hand-off streams (the Redis transport's atomic move), then forward
        what the hand-off streams hold (``sweep``: entries a dead mover left pending too)."""
        broker = await self._broker()
        result = await broker.move_scheduled(now_ms, limit=limit, sweep=sweep)
        forwarded, more = await self._forward(broker, forward, limit, stale=sweep)
        return MoveResult(moved=result.moved + forwarded, next_due_ms=result.next_due_ms, more=result.more or more)

    async def fire_tick(self, spec: DestinationSpec, tick_ms: int, envelope: Envelope, forward: Forward) -> int:
        """The Redis transport's ``fire_tick`` (once per tick across processes), then its message forwarded."""
        broker = await self._broker([spec])
        # index the job queue's partition (never due itself) so sweeps find a tick whose forwarder died
        await broker.redis.zadd(broker.keyspace.scheduled_index, {_member(spec.name, 0): float("inf")}, nx=True)
        outcome = await broker.fire_tick(spec.name, tick_ms, envelope)
        if outcome == 1:
            await self._forward(broker, forward, 100, stale=False, only=[(spec.name, 0)])
        return outcome

    async def _forward(
        self,
        broker: RedisBroker,
        forward: Forward,
        limit: int,
        *,
        stale: bool,
        only: Sequence[tuple[str, int]] | None = None,
    ) -> tuple[int, bool]:
        """Publish what the hand-off streams hold, then acknowledge and delete it; returns (forwarded,
        whether a stream had more than ``limit``)."""
        parts = list(only) if only is not None else await broker._scheduled_partitions()
        if not parts:
            return 0, False
        streams = {broker._partition_keys(d, p).stream: d for d, p in parts}
        await self._ensure_groups(broker, list(streams))
        redis = broker.redis
        entries: list[tuple[str, str, list[Any]]] = []  # stream, entry id, fields
        reply = await redis.xreadgroup(_GROUP, self.consumer, dict.fromkeys(streams, ">"), count=limit)
        for stream, rows in reply or []:
            entries += [(text(stream), text(eid), fields) for eid, fields in rows if fields]
        if stale:
            for stream in streams:
                claimed = await redis.xautoclaim(stream, _GROUP, self.consumer, self.stale_ms, "0-0", count=limit)
                entries += [(stream, text(eid), fields) for eid, fields in claimed[1] if fields]
        if not entries:
            return 0, False
        envelopes: list[Envelope] = []
        for stream, _, fields in entries:
            destination = streams[stream]
            spec = await broker.get_destination(destination)
            flat = [v for pair in fields.items() for v in pair] if isinstance(fields, dict) else list(fields)
            envelopes.append(decode_flat(flat, destination, spec.kind if spec else "command"))
        await forward(envelopes)
        pipe = redis.pipeline(transaction=False)
        for stream, eid, _ in entries:
            pipe.xack(stream, _GROUP, eid)
            pipe.xdel(stream, eid)
        await pipe.execute()
        return len(entries), len(entries) >= limit

    async def _ensure_groups(self, broker: RedisBroker, streams: Sequence[str]) -> None:
        for stream in streams:
            if stream in self._groups:
                continue
            try:
                await broker.redis.xgroup_create(stream, _GROUP, id="0", mkstream=True)
            except Exception as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
            self._groups.add(stream)

    async def cancel(self, message_ids: Sequence[str], destination: str | None) -> int:
        """Cancel scheduled messages by id (the Redis transport's atomic cancel)."""
        return await (await self._broker()).cancel_scheduled(message_ids, destination=destination)

    async def messages(self, destination: str | None, limit: int, message_ids: Sequence[str]) -> list[ScheduledMessage]:
        """Scheduled messages, earliest due first."""
        broker = await self._broker()
        return await broker.scheduled_messages(destination=destination, limit=limit, message_ids=message_ids)

    async def count(self, destination: str | None) -> int:
        """How many messages wait for their due time."""
        return await (await self._broker()).count_scheduled(destination)

    async def counts(self, destination: str) -> dict[int, int]:
        """How many messages of ``destination`` wait, per partition holding some."""
        broker = await self._broker()
        parts = await broker._scheduled_partitions(destination)
        if not parts:
            return {}
        pipe = broker.redis.pipeline(transaction=False)
        for d, p in parts:
            pipe.zcard(broker._partition_keys(d, p).scheduled)
        return {p: int(n) for (_, p), n in zip(parts, await pipe.execute(), strict=True)}
