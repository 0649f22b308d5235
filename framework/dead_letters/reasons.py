"""Dead letters: the reason recorded with a message that will not be retried.

A dead-letter entry holds the original message's fields plus the ``dlq-*`` fields named in
:mod:`broker.headers`: a one-line reason, the exception type and message, a trimmed traceback,
the attempts made, the handler, the original destination, partition and group, and when the
message first failed and when it died.
"""

from __future__ import annotations

import traceback

from broker import Delivery, now_ms
from broker import headers as h
from framework.service import Handler

__all__ = ["base_reason", "exception_reason", "poison_reason"]

_TRACEBACK_LIMIT = 4000  # characters kept from the end of a traceback
_FIRST_FAILED_AT = h.FIRST_FAILED_AT.encode()


def _trimmed_traceback(exc: BaseException) -> str:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return text if len(text) <= _TRACEBACK_LIMIT else "...\n" + text[-_TRACEBACK_LIMIT:]


def base_reason(
    handler: Handler, d: Delivery, attempts: int, reason: str = "", *, first_failed_ms: int | None = None
) -> dict[str, str]:
    """The fields every dead letter has: where it was consumed, by whom, attempts, and when it failed.

    The first failure time is the one a retried copy carries, else ``first_failed_ms`` (when this
    process saw an earlier attempt fail), else now.
    """
    now = str(now_ms())
    first = d.field(_FIRST_FAILED_AT)  # (a retried copy carries it)
    fields = {
        h.DLQ_ATTEMPTS: str(attempts),
        h.DLQ_HANDLER: handler.label,
        h.DLQ_DESTINATION: d.source.spec.name,
        h.DLQ_PARTITION: str(d.source.partition),
        h.DLQ_GROUP: d.source.group,
        h.DLQ_ENTRY_ID: d.entry_id,
        h.DLQ_FIRST_FAILED_AT: first.decode() if first else str(first_failed_ms or now),
        h.DLQ_DEAD_AT: now,
    }
    if reason:
        fields[h.DLQ_REASON] = reason
    return fields


def exception_reason(
    handler: Handler,
    d: Delivery,
    attempts: int,
    exc: BaseException,
    why: str,
    *,
    first_failed_ms: int | None = None,
) -> dict[str, str]:
    """Reason fields for a handler that raised ``exc`` on its last attempt (or a fatal error)."""
    fields = base_reason(handler, d, attempts, f"{why}: {type(exc).__name__}: {exc}", first_failed_ms=first_failed_ms)
    fields[h.DLQ_ERROR_TYPE] = f"{type(exc).__module__}.{type(exc).__qualname__}"
    fields[h.DLQ_ERROR_MESSAGE] = str(exc)
    fields[h.DLQ_TRACEBACK] = _trimmed_traceback(exc)
    return fields


def poison_reason(handler: Handler, d: Delivery, reason: str, *, attempts: int | None = None) -> dict[str, str]:
    """Reason fields for a message that cannot run at all (undecodable, invalid, crash loop)."""
    fields = base_reason(handler, d, d.attempt if attempts is None else attempts, reason)
    fields[h.DLQ_ERROR_TYPE] = "poison"
    fields[h.DLQ_ERROR_MESSAGE] = reason
    return fields
