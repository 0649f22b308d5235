"""A saga's timeouts: scheduled messages to its own queue, stored by the step's commit with its state."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from broker import COMMAND
from broker.codec import encode_fields
from broker.headers import CAUSATION_ID, CORRELATION_ID, DELIVER_AT
from framework._messages import Outgoing, build_envelope
from framework._payloads import type_name
from framework.saga.policy import SAGA_INPUT
from framework.saga.steps import StepDeclarations

if TYPE_CHECKING:
    from framework.context import Context
    from framework.saga.step_context import SagaContext

__all__ = ["TimeoutWrites"]

S = TypeVar("S")


def _msgpack_strings(items: list[bytes]) -> bytes:
    """cmsgpack's encoding of a Lua array of strings (what ``schedule_add.lua`` stores, packed here
    so a timeout can be written by plain commands inside the step's commit)."""
    n = len(items)
    out = bytearray()
    if n < 16:
        out.append(0x90 | n)
    elif n < 1 << 16:
        out += b"\xdc" + n.to_bytes(2, "big")
    else:
        out += b"\xdd" + n.to_bytes(4, "big")
    for b in items:
        size = len(b)
        if size < 32:
            out.append(0xA0 | size)
        elif size < 1 << 8:
            out += b"\xd9" + size.to_bytes(1, "big")
        elif size < 1 << 16:
            out += b"\xda" + size.to_bytes(2, "big")
        else:
            out += b"\xdb" + size.to_bytes(4, "big")
        out += b
    return bytes(out)


def _as_bytes(value: bytes | str | int) -> bytes:
    if isinstance(value, bytes):
        return value
    return str(value).encode()


class TimeoutWrites(StepDeclarations[S]):
    """The part of :class:`~framework.saga.Saga` that writes the timeouts its steps request."""

    async def _stage_timeouts(self, ctx: Context, sctx: SagaContext[S]) -> None:
        """Write the requested timeouts into the step's commit: scheduled messages of this very
        partition (the same hash tag as the state), stored only if the state is saved."""
        keyspace = ctx._broker.keyspace
        pkeys = keyspace.partition(self.queue.name, ctx.partition)
        tx = ctx.redis_transaction()
        earliest = min(due for _, _, due in sctx._timeouts)
        # The namespace index first (another slot, outside the commit): a commit that then fails
        # leaves a stale hint, never a stored timeout no mover looks at (as publish does).
        await ctx.redis.zadd(keyspace.scheduled_index, {f"{self.queue.name}|{ctx.partition}": earliest}, lt=True)
        for timeout_id, payload, due in sctx._timeouts:
            env, _ = self._timeout_envelope(ctx, sctx, timeout_id, payload, due)
            fields = _msgpack_strings([_as_bytes(f) for f in encode_fields(env)])
            tx.call("ZADD", pkeys.scheduled, due, timeout_id)
            tx.call("HSET", pkeys.scheduled_envelopes, timeout_id, fields)

    def _timeout_envelope(
        self, ctx: Context, sctx: SagaContext[S], timeout_id: str, payload: Any, due: int, *, spec: bool = False
    ) -> Outgoing:
        """The scheduled message a timeout is: to this saga's queue, keyed by the instance, due at ``due``."""
        headers = {
            SAGA_INPUT: f"timeout:{type_name(payload)}",
            CORRELATION_ID: ctx.correlation_id,
            CAUSATION_ID: ctx.message_id,
            DELIVER_AT: str(due),
        }
        destination = self.queue if spec else self.queue.name  # (the outbox relay declares the queue from it)
        return build_envelope(
            destination, COMMAND, payload, key=sctx.correlation, headers=headers, message_id=timeout_id
        )
