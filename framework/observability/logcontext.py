"""Per-message context on log lines: which service, handler and message a line was written for.

Every line logged while a handler runs, by the framework or the user, through structlog or
stdlib ``logging``, carries ``service``, ``handler``, ``destination``, ``message_id`` and
``attempt``, plus ``trace_id`` and ``span_id`` (32 and 16 hex digits) of the current span when
tracing is on. Cheaply: nothing is bound per message. A lane sets one context variable per batch
it runs (:func:`enter`), pointing at the lane's slot, which the runtime already updates per run
(the delivery and attempt it runs); :func:`add_message_context` (a structlog processor) and
:class:`MessageContextFilter` (a ``logging.Filter``) read it only when a line is written.
A sync handler's worker thread inherits the variable, so its lines carry the context too.

``framework.logconfig.configure_logging`` (the CLI) installs both; an application with its own
logging configuration adds ``add_message_context`` to its structlog processors and the filter
to its handlers.

Bodies are never logged, except by the ``--log-level debug`` line for a received message when
``FRAMEWORK_LOG_BODIES=1``, with the fields named in ``FRAMEWORK_LOG_REDACT`` (comma-separated,
default ``password,secret,token,card_number``, any depth, any case) replaced by ``"[redacted]"``.
"""

from __future__ import annotations

import contextvars
import logging
import os
from collections.abc import MutableMapping
from typing import Any

import orjson

from framework.observability import hooks

__all__ = [
    "DEFAULT_REDACT",
    "MessageContextFilter",
    "add_message_context",
    "body_logging",
    "current_fields",
    "enter",
    "leave",
    "loggable_body",
    "redact_names",
    "redacted_json",
]

DEFAULT_REDACT = ("password", "secret", "token", "card_number")
_BODY_LIMIT = 4096  # characters of a logged body

_current: contextvars.ContextVar[tuple[Any, Any] | None] = contextvars.ContextVar("framework_message", default=None)


def enter(slot: Any, handler: Any) -> contextvars.Token[tuple[Any, Any] | None]:
    """A lane starts running ``handler``'s messages in ``slot``: lines written meanwhile describe
    the slot's current run. Give the token back to :func:`leave`."""
    return _current.set((slot, handler))


def leave(token: contextvars.Token[tuple[Any, Any] | None]) -> None:
    """The lane is done with the batch :func:`enter` announced."""
    _current.reset(token)


def current_fields() -> dict[str, Any]:
    """The context of the line being written now (empty outside a handler with tracing off)."""
    out: dict[str, Any] = {}
    scope = _current.get()
    if scope is not None:
        slot, handler = scope
        d = slot.delivery
        if d is not None:
            out["service"] = handler.service
            out["handler"] = handler.name
            out["destination"] = handler.destination.name
            out["message_id"] = d.message_id
            out["attempt"] = slot.attempt
    if hooks.TRACING:
        from framework.observability import tracing

        ids = tracing.current_ids()
        if ids is not None:
            out["trace_id"], out["span_id"] = ids
    return out


def add_message_context(logger: Any, method_name: str, event_dict: MutableMapping[str, Any]) -> Any:
    """structlog processor: add the current message's context (fields given explicitly win)."""
    scope = _current.get()
    if scope is None and not hooks.TRACING:  # the common case outside handlers: one read
        return event_dict
    for key, value in current_fields().items():
        event_dict.setdefault(key, value)
    return event_dict


class MessageContextFilter(logging.Filter):
    """``logging.Filter`` that adds the current message's context as attributes of each record
    (``record.message_id`` and so on; attributes already set are kept). It never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Add the context; always True."""
        if _current.get() is None and not hooks.TRACING:
            return True
        for key, value in current_fields().items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


# -- bodies ----------------------------------------------------------------------------------------------


def body_logging() -> frozenset[str] | None:
    """The (lower-cased) field names to redact when ``FRAMEWORK_LOG_BODIES`` asks for bodies in
    debug lines, or None when bodies are not logged (the default)."""
    if os.environ.get("FRAMEWORK_LOG_BODIES", "").strip().lower() not in ("1", "true", "yes", "on"):
        return None
    return redact_names()


def redact_names() -> frozenset[str]:
    """The (lower-cased) secret field names every view of a body redacts: ``FRAMEWORK_LOG_REDACT``
    (comma-separated), else :data:`DEFAULT_REDACT`."""
    raw = os.environ.get("FRAMEWORK_LOG_REDACT")
    names = DEFAULT_REDACT if raw is None else tuple(n for n in raw.split(","))
    return frozenset(n.strip().lower() for n in names if n.strip())


def _redacted(value: Any, names: frozenset[str]) -> Any:
    if isinstance(value, dict):
        return {k: "[redacted]" if str(k).lower() in names else _redacted(v, names) for k, v in value.items()}
    if isinstance(value, list):
        return [_redacted(v, names) for v in value]
    return value


def redacted_json(body: bytes, redact: frozenset[str] | None = None) -> str | None:
    """``body``'s JSON with the secret fields (``redact``, default :func:`redact_names`) replaced by
    ``"[redacted]"`` at any depth; None when the body is not JSON."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return orjson.dumps(_redacted(value, redact_names() if redact is None else redact)).decode()


def loggable_body(body: bytes, redact: frozenset[str]) -> str:
    """``body`` as a log field: its JSON with the ``redact`` fields replaced, cut at 4 KiB; a body
    that is not JSON is described, never shown."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return f"<{len(body)} bytes, not JSON>"
    text = orjson.dumps(_redacted(value, redact)).decode()
    return text if len(text) <= _BODY_LIMIT else text[:_BODY_LIMIT] + "...(cut)"
