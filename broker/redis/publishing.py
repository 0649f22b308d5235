"""The broker's publishing role: batched appends, idempotency keys and the body size limit."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from broker.codec import check_body_size, encode_fields
from broker.envelope import Envelope, now_ms
from broker.headers import IDEMPOTENCY_KEY
from broker.redis.core import ScriptCall, text
from broker.redis.scheduling import Scheduling, due_of
from broker.topology import DestinationSpec

__all__ = ["DEFAULT_DEDUP_WINDOW_MS", "Publishing", "partition_of"]

DEFAULT_DEDUP_WINDOW_MS = 24 * 3600 * 1000
"""How long a producer idempotency key is remembered unless the caller says otherwise: one day."""

_BATCH_ARGS = 20_000  # arguments per publish_batch call: keeps each call (and Lua's unpack) modest


def partition_of(spec: DestinationSpec, env: Envelope, idem: str | None) -> int:
    """The envelope's partition: by its key, else by its idempotency key, else by its id.

    Routing by the idempotency key keeps repeats of one key in one partition, where
    ``publish_once.lua`` checks it.
    """
    return spec.partition_for(env.key, idem or env.id)


class Publishing(Scheduling):
    """Appends envelopes to their partition streams (or stores them until due: see scheduling)."""

    async def publish(self, envelopes: Sequence[Envelope], *, dedup_window_ms: int | None = None) -> list[str | None]:
        """Append envelopes in one round trip; return entry ids (None where an idempotency key repeated).

        Each destination is routed with :meth:`route` (declared with defaults on first use).
        Entries for one partition stream go in one script call (one reply for the lot), in order.
        An envelope carrying the ``idempotency-key`` header is stored at most once while that key's
        dedup window lasts: ``dedup_window_ms`` (default: one day) from the publish that stored it;
        a dropped repeat does not extend it. The key is checked in the partition the message goes
        to, chosen by the message's key, else by its idempotency key (not by its random id), so
        repeats without a message key land in one partition and are caught there. Repeats that
        carry different message keys may land in different partitions and are then not caught.
        A body over :attr:`max_body_bytes` raises :class:`~broker.errors.MessageTooLarge` and
        nothing of the call is stored. An envelope whose ``deliver-at`` header
        (:data:`~broker.headers.DELIVER_AT`, Unix ms) lies in the future is stored until then
        (:mod:`broker.redis.scheduling`; its reply is its message id); a past one is appended now.
        """
        if not envelopes:
            return []
        limit = self.max_body_bytes
        for env in envelopes:  # before anything is sent: a batch is stored whole or not at all
            check_body_size(env, limit)
        window = dedup_window_ms if dedup_window_ms is not None else DEFAULT_DEDUP_WINDOW_MS
        calls: list[ScriptCall] = []
        batches: dict[str, tuple[int, list[int], list[Any]]] = {}  # stream -> (call index, positions, args)
        slots: list[tuple[int, int]] = []  # per envelope: (call index, position in that call's reply; -1: whole)
        scheduled: dict[tuple[str, int], int] = {}  # (destination, partition) -> earliest due ms
        now = now_ms()
        for env in envelopes:
            spec = self._specs.get(env.destination)
            if spec is None or spec.kind != env.kind:  # the cache inline: this loop may run 10k times a call
                spec = await self.route(env.destination, env.kind)
            idem = env.headers.get(IDEMPOTENCY_KEY) if env.headers else None
            pkeys = self._partition_keys(spec.name, partition_of(spec, env, idem))
            due = due_of(env) if env.headers else None
            if due is not None and due > now:
                where = (spec.name, pkeys.partition)
                scheduled[where] = min(due, scheduled.get(where, due))
                if idem:  # checked and recorded in the partition, like publish_once
                    slots.append((len(calls), -1))
                    calls.append(self._schedule_call(pkeys, env, due, now, window))
                    continue
                batch = batches.get(pkeys.scheduled)
                if batch is None or len(batch[2]) > _BATCH_ARGS:
                    batch = batches[pkeys.scheduled] = (len(calls), [], [])
                    calls.append(("schedule_batch", [pkeys.scheduled, pkeys.scheduled_envelopes], batch[2]))
                fields = encode_fields(env)
                slots.append((batch[0], len(batch[1])))
                batch[1].append(1)
                batch[2].extend((env.id, due, len(fields), *fields))
                continue
            fields = encode_fields(env)
            if idem:
                batches.pop(pkeys.stream, None)  # later entries of this stream go after it: order kept
                slots.append((len(calls), -1))
                calls.append(("publish_once", [pkeys.stream, pkeys.published], [idem, now_ms(), window, *fields]))
                continue
            batch = batches.get(pkeys.stream)
            if batch is None or len(batch[2]) > _BATCH_ARGS:
                batch = batches[pkeys.stream] = (len(calls), [], [])
                calls.append(("publish_batch", [pkeys.stream], batch[2]))
            slots.append((batch[0], len(batch[1])))
            batch[1].append(1)
            batch[2].append(len(fields))
            batch[2].extend(fields)
        if scheduled:  # the index first: a crash before the store leaves a stale hint, not a lost message
            await self._index_scheduled(scheduled)
        replies = await self._run_quick(calls)
        out: list[str | None] = []
        for call, position in slots:
            reply = replies[call] if position < 0 else replies[call][position]
            out.append(None if reply is None else text(reply))
        return out
