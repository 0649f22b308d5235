"""Structured logs (structlog): key/value lines on a terminal, JSON lines elsewhere.

Every record about a message carries ``message_id``, ``service``, ``handler`` and ``attempt``.
``FRAMEWORK_LOG_LEVEL`` (default ``info``) and ``FRAMEWORK_LOG_FORMAT`` (``console`` or ``json``)
choose the level and format; :func:`configure_logging` is called by the CLI, not on import, so
applications embedding the framework keep their own structlog configuration.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

__all__ = ["configure_logging", "get_logger"]


def get_logger(name: str = "framework") -> structlog.typing.FilteringBoundLogger:
    """A structlog logger bound to ``name=name`` (lazy: configuration applies on first use)."""
    return structlog.get_logger(name=name)  # type: ignore[no-any-return]


def configure_logging(level: str | None = None, fmt: str | None = None) -> None:
    """Configure structlog for a process run by the CLI."""
    level_name = (level or os.environ.get("FRAMEWORK_LOG_LEVEL") or "info").upper()
    numeric = logging.getLevelName(level_name)
    if not isinstance(numeric, int):
        numeric = logging.INFO
    fmt = fmt or os.environ.get("FRAMEWORK_LOG_FORMAT") or ("console" if sys.stderr.isatty() else "json")
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
