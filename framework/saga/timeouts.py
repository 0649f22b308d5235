"""A saga's timeouts: scheduled messages to its own queue, stored by the step's commit with its state
(:class:`broker.state.ScheduleMessage`; with ``sql=``, outbox rows with a due time)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from broker import COMMAND
from broker.headers import CAUSATION_ID, CORRELATION_ID, DELIVER_AT
from broker.state import Effects, ScheduleMessage
from framework._messages import Outgoing, build_envelope
from framework._payloads import type_name
from framework.saga.policy import SAGA_INPUT
from framework.saga.steps import StepDeclarations

if TYPE_CHECKING:
    from framework.context import Context
    from framework.saga.step_context import SagaContext

__all__ = ["TimeoutWrites"]

S = TypeVar("S")


class TimeoutWrites(StepDeclarations[S]):
    """The part of :class:`~framework.saga.Saga` that writes the timeouts its steps request."""

    def _stage_timeouts(self, tx: Effects, ctx: Context, sctx: SagaContext[S]) -> None:
        """Record the requested timeouts in the step's commit ``tx``: scheduled messages to this saga's
        queue keyed by the instance (so to this very partition), stored only if the state is saved."""
        for timeout_id, payload, due in sctx._timeouts:
            env, _ = self._timeout_envelope(ctx, sctx, timeout_id, payload, due)
            tx.add(ScheduleMessage(env, due))

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
