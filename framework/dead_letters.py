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

__all__ = ["exception_reason", "poison_reason"]

_TRACEBACK_LIMIT = 4000  # characters kept from the end of a traceback


def _trimmed_traceback(exc: BaseException) -> str:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return text if len(text) <= _TRACEBACK_LIMIT else "...\n" + text[-_TRACEBACK_LIMIT:]


def _base(handler: Handler, d: Delivery, attempts: int, reason: str) -> dict[str, str]:
    now = str(now_ms())
    first = d.fields.get(h.FIRST_FAILED_AT.encode())
    return {
        h.DLQ_REASON: reason,
        h.DLQ_ATTEMPTS: str(attempts),
        h.DLQ_HANDLER: handler.label,
        h.DLQ_DESTINATION: d.source.spec.name,
        h.DLQ_PARTITION: str(d.source.partition),
        h.DLQ_GROUP: d.source.group,
        h.DLQ_ENTRY_ID: d.entry_id,
        h.DLQ_FIRST_FAILED_AT: first.decode() if first else now,
        h.DLQ_DEAD_AT: now,
    }


def exception_reason(handler: Handler, d: Delivery, attempts: int, exc: BaseException, why: str) -> dict[str, str]:
    """Reason fields for a handler that raised ``exc`` on its last attempt (or a fatal error)."""
    fields = _base(handler, d, attempts, f"{why}: {type(exc).__name__}: {exc}")
    fields[h.DLQ_ERROR_TYPE] = f"{type(exc).__module__}.{type(exc).__qualname__}"
    fields[h.DLQ_ERROR_MESSAGE] = str(exc)
    fields[h.DLQ_TRACEBACK] = _trimmed_traceback(exc)
    return fields


def poison_reason(handler: Handler, d: Delivery, reason: str, *, attempts: int | None = None) -> dict[str, str]:
    """Reason fields for a message that cannot run at all (undecodable, invalid, crash loop)."""
    fields = _base(handler, d, d.attempt if attempts is None else attempts, reason)
    fields[h.DLQ_ERROR_TYPE] = "poison"
    fields[h.DLQ_ERROR_MESSAGE] = reason
    return fields
