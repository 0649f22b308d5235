"""The memory broker's state role: versioned state per key (the server's hashes) and effects committed with the ack.

The ``state`` capability as ``broker/redis/state.py`` keeps it: a state is a hash named
``<partition stream>:saga:<correlation>`` (the same hashes guarded writes sent with acks write),
and :meth:`StateStorage.commit_effects` applies a run's typed operations (:mod:`broker.state`),
its outgoing messages, the inbox mark and the ack in one step that does not yield to other tasks,
with ``commit_effects.lua``'s outcomes: nothing for an entry no longer pending, only the ack for a
message processed before, nothing at all when a guard fails. Typed operations cannot fail half-way
here, so nothing is ever dead-lettered by a commit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from broker.codec import encode_fields
from broker.envelope import Envelope
from broker.errors import EffectsConflict
from broker.headers import IDEMPOTENCY_KEY
from broker.memory.core import as_bytes, flatten
from broker.memory.publishing import partition_of
from broker.memory.scheduling import Scheduling
from broker.memory.streams import wall_ms
from broker.protocol import Delivery
from broker.state import DeleteKey, Effects, ExpectField, ExpireKey, ScheduleMessage, SetFields

__all__ = ["StateStorage"]


class StateStorage(Scheduling):
    """Reads states and commits effects (typed operations only: there are no Redis commands here)."""

    commits_outgoing = True

    def state_key(self, queue: str, partition: int, correlation: str) -> str:
        """``<ns>:<queue>:<partition>:saga:<correlation>``: beside the partition's log."""
        return f"{self.partition_stream(queue, partition)}:saga:{correlation}"

    async def read_state(self, key: str, fields: Sequence[str]) -> list[bytes | None]:
        """``fields`` of the state at ``key`` (None where absent; all None when there is none)."""
        await self._checkpoint()
        found = self.server.live_hash(key, wall_ms())
        if found is None:
            return [None] * len(fields)
        return [found.get(f.encode()) for f in fields]

    async def read_states(
        self, keys: Sequence[str], fields: Sequence[str], *, channel: Any = None
    ) -> list[list[bytes | None] | None]:
        """:meth:`read_state` of each key, in one step (every key here holds a hash or nothing)."""
        await self._checkpoint()
        now = wall_ms()
        names = [f.encode() for f in fields]
        rows: list[list[bytes | None] | None] = []
        for key in keys:
            found = self.server.live_hash(key, now) or {}
            rows.append([found.get(n) for n in names])
        return rows

    def effects(self) -> Effects:
        """A new recorder of typed operations."""
        return Effects()

    async def commit_effects(
        self,
        delivery: Delivery,
        effects: Effects,
        outgoing: Sequence[Envelope] = (),
        *,
        reason: Mapping[str, str] = {},
        token: int | None = None,
    ) -> bool:
        """Apply ``effects``' operations, append ``outgoing``, mark the inbox and ack, in one step.

        False when the entry is no longer pending (nothing done) or its message was processed before
        (only acked); :class:`~broker.errors.EffectsConflict` when a guard fails and ``LeaseLost`` when
        ``token`` is not current (nothing done either way); ``TypeError`` for an operation that is not
        one of :mod:`broker.state`'s (nothing done). ``reason`` is not needed: nothing fails half-way.
        """
        ops = effects.ops
        scheduled: list[tuple[str, int, ScheduleMessage]] = []  # routed before the step (route may wait)
        for op in ops:
            if type(op) is ScheduleMessage:
                spec = await self.route(op.envelope.destination, op.envelope.kind)
                idem = op.envelope.headers.get(IDEMPOTENCY_KEY) if op.envelope.headers else None
                scheduled.append((spec.name, partition_of(spec, op.envelope, idem), op))
            elif type(op) not in (ExpectField, SetFields, DeleteKey, ExpireKey):
                raise TypeError(f"the {self.transport} transport cannot commit {op!r}: only broker.state operations")
        appends: list[tuple[str, list[bytes]]] = []
        for env in outgoing:
            spec = await self.route(env.destination, env.kind)
            idem = env.headers.get(IDEMPOTENCY_KEY) if env.headers else None
            name = self.partition_stream(spec.name, partition_of(spec, env, idem))
            appends.append((name, flatten(encode_fields(env))))
        await self._checkpoint()
        # one step from here: no await
        source = delivery.source
        self._fence(source, token)
        found = self._pending_in(delivery.stream, source.group, delivery.entry_id)
        if found is None:
            return False
        stream, group, entry = found
        state = self.server.group(source.stream, source.group)
        now = wall_ms()
        mid = delivery.message_id
        applied = not state.inbox.processed(mid, now)
        if applied:
            server = self.server
            for op in ops:
                if type(op) is ExpectField:
                    held = server.live_hash(op.key, now) or {}
                    if held.get(op.field.encode(), b"") != as_bytes(op.value):
                        raise EffectsConflict(
                            f"message {mid}: a guarded value changed since the handler read it; nothing was "
                            "written, sent or acknowledged (run the handler again)"
                        )
            at = 0
            for op in ops:
                if type(op) is SetFields:
                    server.live_hash(op.key, now)
                    target = server.hashes.setdefault(op.key, {})
                    for name, value in op.fields.items():
                        target[name.encode()] = as_bytes(value)
                elif type(op) is DeleteKey:
                    server.delete_hash(op.key)
                elif type(op) is ExpireKey:
                    if server.live_hash(op.key, now) is not None:
                        server.expiries[op.key] = now + op.ms
                elif type(op) is ScheduleMessage:
                    destination, partition, _ = scheduled[at]
                    at += 1
                    self._store_scheduled(destination, partition, op.envelope, op.due_ms)
            for name, fields in appends:
                server.stream(name).add(fields)
            state.inbox.record([mid], now)
        group.ack([entry])
        if source.deletes_on_ack(delivery.stream):
            stream.delete([entry])
        state.attempts.pop(mid, None)
        return applied
