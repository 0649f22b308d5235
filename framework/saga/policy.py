"""What a saga's messages carry and how its failures are retried: SAGA_INPUT, SagaError, SagaRetryPolicy."""

from __future__ import annotations

from datetime import timedelta

import attrs

from broker.errors import EffectsConflict
from framework.retries import Decision, RetryPolicy

__all__ = ["DEFAULT_KEEP_COMPLETED", "MAX_CONFLICTS", "SAGA_INPUT", "SagaError", "SagaRetryPolicy"]

SAGA_INPUT = "saga-input"
"""Header of a message on a saga's queue: which input it is (the source destination, or ``timeout:<type>``)."""

MAX_CONFLICTS = 100
"""Version conflicts retried at once before the saga's retry policy counts them as failures."""

DEFAULT_KEEP_COMPLETED = timedelta(days=1)


class SagaError(Exception):
    """A saga message that cannot be handled (no step for it): dead-lettered, never retried."""

    __module__ = "framework.saga"  # its public home (and the type name its dead letters record)


class SagaRetryPolicy(RetryPolicy):
    """A :class:`RetryPolicy` that retries a version conflict at once, in the lane, without
    letting it dead-letter the message (other failures follow the policy as usual; conflicts do
    raise the attempt number the policy sees)."""

    def decide(self, attempt: int, exc: BaseException) -> Decision:
        """Retry a conflict now (up to :data:`MAX_CONFLICTS`); anything else per the policy."""
        if isinstance(exc, EffectsConflict) and attempt < MAX_CONFLICTS:
            return Decision("retry")
        return super().decide(attempt, exc)


def _saga_policy(policy: RetryPolicy) -> SagaRetryPolicy:
    fields = {a.name: getattr(policy, a.name) for a in attrs.fields(type(policy))}
    fields["fatal"] = (*policy.fatal, SagaError)
    return SagaRetryPolicy(**fields)
