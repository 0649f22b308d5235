"""The broker's state role: versioned state per key (hashes under a partition's hash tag) and effects
committed with the ack (``commit_effects.lua``): the ``state`` capability and the commit behind ``redis``'s.

A state lives in the hash ``<partition stream>:saga:<correlation>`` (see :mod:`broker.redis.keys`),
so it shares the hash tag of the partition whose deliveries write it, and one script call applies a
step's writes, its outgoing messages, the inbox mark and the ack (on a Cluster too). Reads go
through the shared-write batcher (:meth:`~broker.redis.core.RedisCore.read_shared`: ``HMGET``) or
``read_hashes.lua`` for a batch's states at once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from redis.exceptions import ResponseError

from broker.codec import encode_fields
from broker.envelope import Envelope, now_ms
from broker.errors import EffectsConflict, EffectsFailed
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
    IDEMPOTENCY_KEY,
)
from broker.protocol import Delivery
from broker.redis.batching import ReadBatcher
from broker.redis.core import text
from broker.redis.effects import RedisEffects, as_bytes, msgpack_strings, state_command
from broker.redis.keys import inbox_record
from broker.redis.publishing import partition_of
from broker.redis.scheduling import Scheduling
from broker.redis.settlement import FENCED, fence_arg, lost
from broker.redis.wire import Channel
from broker.state import Effects, ScheduleMessage

__all__ = ["StateStorage"]

# written by commit_effects.lua itself (first-failed-at too, unless the caller gives it)
_SCRIPT_REASON = frozenset((DLQ_REASON, DLQ_ERROR_TYPE, DLQ_ERROR_MESSAGE, DLQ_ENTRY_ID, DLQ_DEAD_AT))
# reason fields sent once per commit_effects.lua call (the same for every message of a source)
_CALL_REASON = frozenset((DLQ_HANDLER, DLQ_DESTINATION, DLQ_PARTITION, DLQ_GROUP))

_CONFLICT = -2  # what commit_effects.lua returns when a guard (ExpectField) failed


class StateStorage(Scheduling):
    """Reads states and commits effects: a handler's Redis commands and typed state operations."""

    @property
    def commits_outgoing(self) -> bool:
        """Whether a commit writes its outgoing messages itself (not on a Cluster: other hash tags)."""
        return not self.cluster

    def state_key(self, queue: str, partition: int, correlation: str) -> str:
        """``<ns>:{<queue>:<partition>}:saga:<correlation>``: the partition's hash tag, no server call."""
        return self._partition_keys(queue, partition).stream + ":saga:" + correlation

    async def read_state(self, key: str, fields: Sequence[str]) -> list[bytes | None]:
        """``HMGET key *fields``, sent in one write with other tasks' reads (:meth:`read_shared`, inlined:
        a step's read is on the hot path); WRONGTYPE raised."""
        row: list[bytes | None]
        if self.cluster:
            row = await self.redis.execute_command("HMGET", key, *fields)
            return row
        if self._reads is None:
            self._reads = ReadBatcher(self._channels())
        row = await self._reads.call("HMGET", key, *fields)
        return row

    async def read_states(
        self, keys: Sequence[str], fields: Sequence[str], *, channel: Channel | None = None
    ) -> list[list[bytes | None] | None]:
        """The same ``fields`` of each hash in ``keys`` in one ``read_hashes.lua`` call (on ``channel``,
        a fetcher's, if given); None for the row of a key that is not a hash."""
        return await self.read_hashes(keys, fields, channel=channel)

    def effects(self) -> RedisEffects:
        """A new :class:`~broker.redis.effects.RedisEffects` (Redis commands and typed operations)."""
        return RedisEffects()

    async def commit_effects(
        self,
        delivery: Delivery,
        effects: Effects,
        outgoing: Sequence[Envelope] = (),
        *,
        reason: Mapping[str, str] = {},
        token: int | None = None,
    ) -> bool:
        """Apply ``effects`` (in the order recorded), publish ``outgoing`` (routed with :meth:`route`), mark
        the inbox and ack, atomically.

        Returns True when applied; False when the message was already processed (then it is only
        acked) or its entry is no longer pending for the group (settled elsewhere, or by an
        earlier failed commit: nothing is done). On a Cluster every key must share the
        delivery's hash tag, and ``outgoing`` must be empty (publish it first). A
        :class:`~broker.state.ScheduleMessage` lowers the namespace's scheduled index hint first
        (another slot, outside the commit: a commit that then fails leaves a stale hint, never a
        stored message no mover looks at, as publish does).

        Redis cannot roll back, so a command that fails stops the rest (``outgoing`` go after
        the commands, so no message is sent) and the commands before it stay applied: running the
        handler again would apply them twice. So the same script call dead-letters the message
        (its fields, ``reason`` - the ``dlq-*`` fields the caller builds, such as the handler and
        the attempts - and ``dlq-entry-id``, ``dlq-dead-at``, ``dlq-first-failed-at`` unless
        ``reason`` gives it (the entry's ``first-failed-at``, else now), ``dlq-reason``,
        ``dlq-error-type``, ``dlq-error-message`` naming the command and the error), acks it,
        releases its inbox lease (a redrive runs the handler again) and drops its attempts
        counter; then :class:`~broker.errors.EffectsFailed` is raised (``applied`` may be 0).
        Server states that refuse every write (OOM, READONLY) raise the redis error instead,
        having changed nothing; the entry stays pending. A ``token`` no longer current raises
        :class:`~broker.errors.LeaseLost`, having changed nothing. A guard
        (:class:`~broker.state.ExpectField`) that does not hold raises
        :class:`~broker.errors.EffectsConflict`, having changed nothing (the entry stays pending).
        """
        source = delivery.source
        mid = delivery.message_id
        keys: list[str] = list(effects.keys) if isinstance(effects, RedisEffects) else []
        ops = effects.ops
        part: list[Any] = [delivery.entry_id, mid, inbox_record(mid), len(ops), len(outgoing), 0]
        shared: list[str] = []  # (sent once per script call)
        for k, v in reason.items():
            if k in _CALL_REASON:
                shared += (k, v)
            elif k not in _SCRIPT_REASON:
                part += (k, v)
        part[5] = (len(part) - 6) // 2
        hints: dict[tuple[str, int], int] | None = None
        for op in ops:
            if type(op) is tuple:  # a Redis command, as recorded
                command: Sequence[Any] = op
            elif type(op) is ScheduleMessage:
                env, due = op
                spec = await self.route(env.destination, env.kind)
                partition = partition_of(spec, env, env.headers.get(IDEMPOTENCY_KEY) if env.headers else None)
                pkeys = self._partition_keys(spec.name, partition)
                hints = hints if hints is not None else {}
                hints[(spec.name, partition)] = min(due, hints.get((spec.name, partition), due))
                keys += (pkeys.scheduled, pkeys.scheduled_envelopes)
                fields = msgpack_strings([as_bytes(f) for f in encode_fields(env)])
                part += (4, "ZADD", pkeys.scheduled, due, env.id)  # (two commands for one operation)
                part[3] += 1
                command = ("HSET", pkeys.scheduled_envelopes, env.id, fields)
            else:
                found = state_command(op)
                if found is None:
                    raise TypeError(f"the Redis transport cannot commit {op!r}")
                command = found
                keys.append(command[1])
            part.append(len(command))
            part += command
        out_keys: list[str] = []
        for env in outgoing:
            spec = await self.route(env.destination, env.kind)
            idem = env.headers.get(IDEMPOTENCY_KEY) if env.headers else None
            stream = self._partition_keys(spec.name, partition_of(spec, env, idem)).stream
            out_keys.append(stream)
            command = ["XADD", stream, "*", *encode_fields(env)]
            part.append(len(command))
            part += command
        if hints:
            await self._index_scheduled(hints)
        base_keys = (delivery.stream, source.keys.inbox, source.keys.attempts, source.keys.dlq, source.keys.lease)
        delete = "1" if source.deletes_on_ack(delivery.stream) else "0"
        fence = fence_arg(token)
        batcher = self._commit_batcher()
        if batcher is None:  # a Cluster: through the client, alone
            args = [source.group, delete, now_ms(), fence, 1, len(shared) // 2, *shared, *part]
            reply = await self.scripts["commit_effects"](self.redis, [*base_keys, *keys, *out_keys], args)
            reply = reply if reply == FENCED else reply[0]
        else:  # with other tasks' commits of the same source in one script call, one write
            reply = await batcher.call((*base_keys, source.group, delete, fence, *shared), [*keys, *out_keys], part)
        if reply == FENCED:
            raise lost(source)
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
