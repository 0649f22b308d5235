"""The broker's settlement role: ack, commit effects, count attempts, dead-letter, retry later, retention.

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
from collections.abc import Mapping, Sequence
from typing import Any

from redis.exceptions import ResponseError

from broker.codec import encode_fields
from broker.envelope import Envelope, now_ms
from broker.errors import EffectsConflict, EffectsFailed, LeaseLost
from broker.headers import (
    DLQ_DEAD_AT,
    DLQ_DESTINATION,
    DLQ_ENTRY_ID,
    DLQ_ERROR_MESSAGE,
    DLQ_ERROR_TYPE,
    DLQ_GROUP,
    DLQ_HANDLER,
    DLQ_PARTITION,
    DLQ_REASON,
    FIRST_FAILED_AT,
    IDEMPOTENCY_KEY,
)
from broker.protocol import Delivery, GroupPartition, GuardedWrite
from broker.redis.core import ScriptCall, text
from broker.redis.keys import inbox_record, inbox_records
from broker.redis.publishing import partition_of
from broker.redis.reading import SCRIPT_CHUNK, lease_lost
from broker.redis.topology import Topology
from broker.redis.wire import Channel
from broker.topology import DestinationSpec

__all__ = ["Settlement"]

# written by commit_effects.lua itself (first-failed-at too, unless the caller gives it)
_SCRIPT_REASON = frozenset((DLQ_REASON, DLQ_ERROR_TYPE, DLQ_ERROR_MESSAGE, DLQ_ENTRY_ID, DLQ_DEAD_AT))
# reason fields sent once per commit_effects.lua call (the same for every message of a source)
_CALL_REASON = frozenset((DLQ_HANDLER, DLQ_DESTINATION, DLQ_PARTITION, DLQ_GROUP))

_WRITE_CHUNK = 250
"""Entries per ack call when some carry guarded writes (each write is a few server calls: the
script blocks the server while it runs)."""

_FENCED = -1  # what a settle script returns when the caller's fencing token is no longer current
_CONFLICT = -2  # what commit_effects.lua returns when a guard (RedisEffects.expect) failed


def _fence(token: int | None) -> str:
    return "" if token is None else str(token)


def _lost(source: GroupPartition) -> LeaseLost:
    return lease_lost(source, "nothing was settled; the new owner delivers the entries again")


class Settlement(Topology):
    """Settles deliveries: success (ack, commit effects), failure (retry later, dead letter), retention."""

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
        fence = _fence(token)
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
        if _FENCED in replies:
            raise _lost(source)
        return sum(replies)

    async def commit_effects(
        self,
        delivery: Delivery,
        commands: Sequence[Sequence[Any]],
        keys: Sequence[str],
        outgoing: Sequence[Envelope] = (),
        *,
        reason: Mapping[str, str] = {},
        token: int | None = None,
    ) -> bool:
        """Apply ``commands``, publish ``outgoing`` (routed with :meth:`route`), mark the inbox and ack, atomically.

        Returns True when applied; False when the message was already processed (then it is only
        acked) or its entry is no longer pending for the group (settled elsewhere, or by an
        earlier failed commit: nothing is done). On a Cluster every key must share the
        delivery's hash tag, and ``outgoing`` must be empty (publish it first).

        Redis cannot roll back, so a command that fails stops the rest (``outgoing`` go after
        ``commands``, so no message is sent) and the commands before it stay applied: running the
        handler again would apply them twice. So the same script call dead-letters the message
        (its fields, ``reason`` - the ``dlq-*`` fields the caller builds, such as the handler and
        the attempts - and ``dlq-entry-id``, ``dlq-dead-at``, ``dlq-first-failed-at`` unless
        ``reason`` gives it (the entry's ``first-failed-at``, else now), ``dlq-reason``,
        ``dlq-error-type``, ``dlq-error-message`` naming the command and the error), acks it,
        releases its inbox lease (a redrive runs the handler again) and drops its attempts
        counter; then :class:`~broker.errors.EffectsFailed` is raised (``applied`` may be 0).
        Server states that refuse every write (OOM, READONLY) raise the redis error instead,
        having changed nothing; the entry stays pending. A ``token`` no longer current raises
        :class:`~broker.errors.LeaseLost`, having changed nothing. A guard command
        (``["__EXPECT__", key, field, value]`` among ``commands``) that does not hold raises
        :class:`~broker.errors.EffectsConflict`, having changed nothing (the entry stays pending).
        """
        source = delivery.source
        calls: list[list[Any]] = [list(c) for c in commands]
        out_keys: list[str] = []
        for env in outgoing:
            spec = await self.route(env.destination, env.kind)
            idem = env.headers.get(IDEMPOTENCY_KEY) if env.headers else None
            stream = self._partition_keys(spec.name, partition_of(spec, env, idem)).stream
            out_keys.append(stream)
            calls.append(["XADD", stream, "*", *encode_fields(env)])
        mid = delivery.message_id
        part: list[Any] = [delivery.entry_id, mid, inbox_record(mid), len(commands), len(outgoing), 0]
        shared: list[str] = []  # (sent once per script call)
        for k, v in reason.items():
            if k in _CALL_REASON:
                shared += (k, v)
            elif k not in _SCRIPT_REASON:
                part += (k, v)
        part[5] = (len(part) - 6) // 2
        for c in calls:
            part += (len(c), *c)
        base_keys = (delivery.stream, source.keys.inbox, source.keys.attempts, source.keys.dlq, source.keys.lease)
        delete = "1" if source.deletes_on_ack(delivery.stream) else "0"
        fence = _fence(token)
        batcher = self._commit_batcher()
        if batcher is None:  # a Cluster: through the client, alone
            args = [source.group, delete, now_ms(), fence, 1, len(shared) // 2, *shared, *part]
            reply = await self.scripts["commit_effects"](self.redis, [*base_keys, *keys, *out_keys], args)
            reply = reply if reply == _FENCED else reply[0]
        else:  # with other tasks' commits of the same source in one script call, one write
            reply = await batcher.call((*base_keys, source.group, delete, fence, *shared), [*keys, *out_keys], part)
        if reply == _FENCED:
            raise _lost(source)
        if reply == _CONFLICT:
            raise EffectsConflict(
                f"message {delivery.message_id}: a guarded value changed since the handler read it; nothing was "
                "written, sent or acknowledged (run the handler again)"
            )
        if isinstance(reply, list):
            if len(reply) == 2:  # ['E', error]: nothing done, the entry stays pending
                raise ResponseError(text(reply[1]))
            dead, error, applied = reply
            raise EffectsFailed(text(dead), text(error), int(applied))
        return bool(reply)

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
            [source.group, delivery.entry_id, delete, delivery.message_id, *flat, _fence(token)],
        )
        if reply == _FENCED:
            raise _lost(source)
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
            [source.group, delivery.entry_id, delete, due_ms, delivery.message_id, *flat, _fence(token)],
        )
        if reply == _FENCED:
            raise _lost(source)
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
