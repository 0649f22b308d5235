"""The memory broker's publishing role: appends, idempotency keys, scheduled messages and the body size limit."""

from __future__ import annotations

from collections.abc import Sequence

from broker.codec import check_body_size, encode_fields
from broker.envelope import Envelope
from broker.headers import IDEMPOTENCY_KEY
from broker.memory.core import flatten
from broker.memory.scheduling import Scheduling
from broker.memory.streams import wall_ms
from broker.scheduling import due_of
from broker.topology import DestinationSpec

__all__ = ["DEFAULT_DEDUP_WINDOW_MS", "Publishing", "partition_of"]

DEFAULT_DEDUP_WINDOW_MS = 24 * 3600 * 1000
"""How long a producer idempotency key is remembered unless the caller says otherwise: one day."""


def partition_of(spec: DestinationSpec, env: Envelope, idem: str | None) -> int:
    """The envelope's partition: by its key, else by its idempotency key, else by its id (as on Redis)."""
    return spec.partition_for(env.key, idem or env.id)


class Publishing(Scheduling):
    """Appends envelopes to their partition streams (or stores them until due: see scheduling)."""

    async def publish(self, envelopes: Sequence[Envelope], *, dedup_window_ms: int | None = None) -> list[str | None]:
        """Append envelopes in order; return entry ids (None where an idempotency key repeated).

        The same rules as the Redis broker's ``publish``: each destination is routed with :meth:`route`;
        a body over :attr:`max_body_bytes` raises ``MessageTooLarge`` (or a bad ``deliver-at`` header
        ``ValueError``) before anything is stored; an ``idempotency-key`` is stored at most once while
        its window (``dedup_window_ms``, default one day, from the publish that stored it) lasts, checked
        in the partition the message goes to (by its key, else its idempotency key); a message whose
        ``deliver-at`` lies ahead is stored until then (its reply is its message id).
        """
        if not envelopes:
            return []
        limit = self.max_body_bytes
        for env in envelopes:  # before anything is stored: a batch is stored whole or not at all
            check_body_size(env, limit)
        window = dedup_window_ms if dedup_window_ms is not None else DEFAULT_DEDUP_WINDOW_MS
        now = wall_ms()
        plan: list[tuple[DestinationSpec, int, Envelope, str | None, int | None]] = []
        for env in envelopes:
            spec = self._specs.get(env.destination)
            if spec is None or spec.kind != env.kind:
                spec = await self.route(env.destination, env.kind)
            idem = env.headers.get(IDEMPOTENCY_KEY) if env.headers else None
            due = due_of(env) if env.headers else None
            plan.append((spec, partition_of(spec, env, idem), env, idem, due))
        await self._checkpoint()
        out: list[str | None] = []
        for spec, partition, env, idem, due in plan:  # no await below: the batch is stored in one step
            if due is not None and due > now:
                out.append(self._schedule(spec.name, partition, env, due, idem or "", now, window))
                continue
            name = self.partition_stream(spec.name, partition)
            fields = flatten(encode_fields(env))
            if idem:
                state = self.server.partition(name)
                state.forget_expired(now, 100)
                if state.seen(idem, now):
                    out.append(None)
                    continue
                out.append(self.server.stream(name).add(fields))
                state.remember(idem, now, window)
                continue
            out.append(self.server.stream(name).add(fields))
        return out
