"""Structured logs (structlog): key/value lines on a terminal, JSON lines elsewhere.

Every record about a message carries ``message_id``, ``service``, ``handler`` and ``attempt``.
``FRAMEWORK_LOG_LEVEL`` (default ``info``) and ``FRAMEWORK_LOG_FORMAT`` (``console`` or ``json``)
choose the level and format; :func:`configure_logging` is called by the CLI, not on import, so
applications embedding the framework keep their own structlog configuration. An unknown level or
format is refused with a ValueError naming the valid ones (a typo must not silently log at info).

Internal: the environment variables above are the interface.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

__all__ = ["LEVELS", "configure_logging", "get_logger", "level_number"]

LEVELS = ("debug", "info", "warning", "error")
_FORMATS = ("console", "json")


def get_logger(name: str = "framework") -> structlog.typing.FilteringBoundLogger:
    """A structlog logger bound to ``name=name`` (lazy: configuration applies on first use)."""
    return structlog.get_logger(name=name)  # type: ignore[no-any-return]


def level_number(name: str, *, source: str = "log level") -> int:
    """The ``logging`` number of a level name in :data:`LEVELS` (any case); ValueError otherwise."""
    if name.strip().lower() not in LEVELS:
        raise ValueError(f"unknown {source} {name!r}: use one of {', '.join(LEVELS)}")
    return int(getattr(logging, name.strip().upper()))


def configure_logging(level: str | None = None, fmt: str | None = None) -> None:
    """Configure structlog for a process run by the CLI; ValueError for an unknown level or format.

    ``level``/``fmt`` win over ``FRAMEWORK_LOG_LEVEL``/``FRAMEWORK_LOG_FORMAT``.
    """
    if level:
        numeric = level_number(level)
    else:
        numeric = level_number(os.environ.get("FRAMEWORK_LOG_LEVEL") or "info", source="FRAMEWORK_LOG_LEVEL")
    if not fmt and os.environ.get("FRAMEWORK_LOG_FORMAT"):
        fmt = os.environ["FRAMEWORK_LOG_FORMAT"].strip().lower()
        if fmt not in _FORMATS:
            raise ValueError(f"unknown FRAMEWORK_LOG_FORMAT {fmt!r}: use one of {', '.join(_FORMATS)}")
    fmt = fmt or ("console" if sys.stderr.isatty() else "json")
    renderer: structlog.typing.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
        # no local variables in tracebacks: they would copy message bodies (personal data,
        # secrets) into the logs on every failed attempt
        exc = [
            structlog.processors.ExceptionRenderer(
                structlog.tracebacks.ExceptionDictTransformer(show_locals=False, max_frames=20)
            )
        ]
    else:
        # plain tracebacks: rich's (structlog's default) costs ~100 ms per failure on the hot path
        renderer = structlog.dev.ConsoleRenderer(
            colors=sys.stderr.isatty(), exception_formatter=structlog.dev.plain_traceback
        )
        exc = []
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *exc,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=max(numeric, logging.WARNING), stream=sys.stderr)
