"""Errors the broker raises; each message says what was wrong and what to do."""

from __future__ import annotations

import re
from collections.abc import Callable

__all__ = [
    "BrokerError",
    "BrokerUnavailable",
    "ConfigurationError",
    "DecodeError",
    "EffectsFailed",
    "LeaseLost",
    "MessageTooLarge",
    "PermissionDenied",
    "connection_errors",
    "is_connection_error",
    "register_transport_errors",
    "transport_errors",
]


class BrokerError(Exception):
    """Base class of broker errors."""


class BrokerUnavailable(BrokerError):
    """The Redis/Valkey server cannot be reached; the message says how to start one."""


class ConfigurationError(BrokerError):
    """A destination, group or name is invalid or conflicts with what the server already holds."""


class LeaseLost(BrokerError):
    """A settle call was refused by the fencing check: the partition's lease has a newer token.

    Another instance acquired the partition (this one's lease expired: a long pause, a lost
    connection); nothing was changed, and the new owner delivers the entry again.
    """


class DecodeError(BrokerError):
    """A stream entry is not a valid envelope (missing or malformed fields)."""


class MessageTooLarge(BrokerError, ValueError):
    """A message body is over the maximum body size; nothing was stored."""

    def __init__(self, destination: str, size: int, limit: int, *, server: str | None = None) -> None:
        self.destination = destination
        self.size = size
        self.limit = limit
        if server is not None:  # refused by the server's own limit, above ours
            super().__init__(
                f"{server} refused the message for {destination!r}: {size:,} bytes, over its max message size of "
                f"{limit:,} bytes; send large data out of band (e.g. object storage) and pass a reference, and "
                "keep FRAMEWORK_MAX_BODY_BYTES below the server's limit"
            )
            return
        super().__init__(
            f"message body for {destination!r} is {size:,} bytes, over the limit of {limit:,} bytes: "
            "send large data out of band (e.g. object storage) and pass a reference, or raise the limit "
            "with FRAMEWORK_MAX_BODY_BYTES (producers and consumers alike)"
        )


_COMMAND = re.compile(r"permissions to run the '([^']+)' command")


class PermissionDenied(BrokerError):
    """The server's ACL refused a command or a key to the broker user.

    Raised for every refusal on connections made by :func:`broker.connect` (on Redis, a subclass
    that is also redis-py's ``NoPermissionError``). The message is one line naming the command
    (when the server says it) and the key pattern the user needs.
    """

    def __init__(self, response: str = "", *args: object, namespace: str = "fw", **kwargs: object) -> None:
        self.response = response
        self.namespace = namespace
        match = _COMMAND.search(response)
        self.command = match.group(1).replace("|", " ").upper() if match else None
        if self.command:
            what = f"may not run {self.command} (keys ~{namespace}:*)"
        elif "script" in response:
            what = f"may not run a command of a framework script (Lua) on keys ~{namespace}:*"
        else:
            what = f"may not access keys ~{namespace}:*"
        super().__init__(f"permission denied: the broker user {what} (ACL); see docs/operations.md#acl-rules")


class EffectsConflict(Exception):
    """A commit's writes were refused by a guard (:class:`broker.state.ExpectField`, ``tx.expect``): a value
    the handler read changed before its commit. Nothing was written, sent or acknowledged; run the handler again
    (it reads the new value). Sagas use it as their optimistic version check.
    """


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


# -- transport client errors, registered by each transport package when it is imported ---------------

_connection: tuple[type[BaseException], ...] = (OSError,)
_closed: list[Callable[[BaseException], bool]] = []
_transport: tuple[type[BaseException], ...] = ()


def register_transport_errors(
    *,
    connection: tuple[type[BaseException], ...] = (),
    closed: Callable[[BaseException], bool] | None = None,
    any_error: tuple[type[BaseException], ...] = (),
) -> None:
    """Called by a transport package on import: its client's exception classes for a lost or
    timed-out connection (``connection``, plus a ``closed`` predicate for errors a class cannot
    tell), and the base classes of every error its client raises (``any_error``)."""
    global _connection, _transport
    _connection = tuple(dict.fromkeys((*_connection, *connection)))
    _transport = tuple(dict.fromkeys((*_transport, *any_error)))
    if closed is not None and closed not in _closed:
        _closed.append(closed)


def is_connection_error(exc: BaseException) -> bool:
    """Whether ``exc`` means a broker connection was lost or timed out (retry it; not a bug)."""
    return isinstance(exc, _connection) or any(test(exc) for test in _closed)


def connection_errors() -> tuple[type[BaseException], ...]:
    """The classes :func:`is_connection_error` accepts (for ``except`` clauses)."""
    return _connection


def transport_errors() -> tuple[type[BaseException], ...]:
    """:class:`BrokerError` and every registered transport client's error base classes."""
    return (BrokerError, *_transport)
