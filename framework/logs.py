"""Structured logs (structlog): key/value lines on a terminal, JSON lines elsewhere.

Every record about a message carries ``message_id``, ``service``, ``handler`` and ``attempt``;
every line written while a handler runs (the framework's and the handler's own, through
structlog or stdlib ``logging``) carries ``service``, ``handler``, ``destination``,
``message_id``, ``attempt`` and, with tracing on, ``trace_id``/``span_id``
(:mod:`framework.observability.logcontext`). At ``debug`` a worker logs one line per message
received and one per message settled, with its outcome.
``FRAMEWORK_LOG_LEVEL`` (default ``info``) and ``FRAMEWORK_LOG_FORMAT`` (``console`` or ``json``)
choose the level and format; :func:`framework.logconfig.configure_logging` is called by the CLI,
not on import, so applications embedding the framework keep their own structlog configuration. An
unknown level or format is refused with a ValueError naming the valid ones (a typo must not
silently log at info).

Internal: the environment variables above are the interface.
"""

from __future__ import annotations

import logging

import structlog

__all__ = ["LEVELS", "debug_enabled", "get_logger", "level_number", "set_configured_level"]

LEVELS = ("debug", "info", "warning", "error")
_configured_level: int | None = None  # set by configure_logging (set_configured_level)


def get_logger(name: str = "framework") -> structlog.typing.FilteringBoundLogger:
    """A structlog logger bound to ``name=name`` (lazy: configuration applies on first use)."""
    return structlog.get_logger(name=name)  # type: ignore[no-any-return]


def debug_enabled() -> bool:
    """Whether framework debug lines are written (the per-message lines cost nothing otherwise):
    the level :func:`~framework.logconfig.configure_logging` set, else what the application's
    structlog configuration says (unconfigured structlog, which would print everything: no)."""
    if _configured_level is not None:
        return _configured_level <= logging.DEBUG
    if not structlog.is_configured():
        return False
    try:
        return bool(get_logger().is_enabled_for(logging.DEBUG))
    except Exception:  # a structlog configuration without levels
        return False


def level_number(name: str, *, source: str = "log level") -> int:
    """The ``logging`` number of a level name in :data:`LEVELS` (any case); ValueError otherwise."""
    if name.strip().lower() not in LEVELS:
        raise ValueError(f"unknown {source} {name!r}: use one of {', '.join(LEVELS)}")
    return int(getattr(logging, name.strip().upper()))


def set_configured_level(level: int) -> None:
    """Record the ``logging`` level :func:`framework.logconfig.configure_logging` configured."""
    global _configured_level
    _configured_level = level
