"""Errors the broker raises; each message says what was wrong and what to do."""

from __future__ import annotations

__all__ = ["BrokerError", "BrokerUnavailable", "ConfigurationError", "DecodeError", "EffectsFailed"]


class BrokerError(Exception):
    """Base class of broker errors."""


class BrokerUnavailable(BrokerError):
    """The Redis/Valkey server cannot be reached; the message says how to start one."""


class ConfigurationError(BrokerError):
    """A destination, group or name is invalid or conflicts with what the server already holds."""


class DecodeError(BrokerError):
    """A stream entry is not a valid envelope (missing or malformed fields)."""


class EffectsFailed(Exception):
    """A handler's Redis writes failed in ``RedisBroker.commit_effects``.

    Redis has no rollback: the first ``applied`` commands (maybe none) stayed written and
    ``error`` (the server's error) stopped the rest. Running the handler again would apply those
    commands twice, so the failing script call already dead-lettered the message (entry
    ``dlq_entry`` of its group's DLQ), acked it and released its inbox lease: do not retry or
    dead-letter it again. Fix the data or the handler, then redrive it (the handler runs again).
    """

    def __init__(self, dlq_entry: str, error: str, applied: int) -> None:
        self.dlq_entry = dlq_entry
        self.error = error
        self.applied = applied
        super().__init__(
            f"Redis effects failed after {applied} command(s) were applied (not rolled back): {error}; "
            f"the message was dead-lettered as {dlq_entry}"
        )
