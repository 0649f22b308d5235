"""Structured logs (structlog): key/value lines on a terminal, JSON lines elsewhere.

Every record about a message carries ``message_id``, ``service``, ``handler`` and ``attempt``;
every line written while a handler runs (the framework's and the handler's own, through
structlog or stdlib ``logging``) carries ``service``, ``handler``, ``destination``,
``message_id``, ``attempt`` and, with tracing on, ``trace_id``/``span_id``
(:mod:`framework.observability.logcontext`). At ``debug`` a worker logs one line per message
received and one per message settled, with its outcome.
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

__all__ = ["LEVELS", "configure_logging", "debug_enabled", "get_logger", "level_number"]

LEVELS = ("debug", "info", "warning", "error")
_FORMATS = ("console", "json")
_configured_level: int | None = None  # set by configure_logging
_QUIET_LIBRARIES = ("asyncio", "urllib3", "opentelemetry", "py4j", "pyspark", "sqlalchemy", "psycopg")


def get_logger(name: str = "framework") -> structlog.typing.FilteringBoundLogger:
    """A structlog logger bound to ``name=name`` (lazy: configuration applies on first use)."""
    return structlog.get_logger(name=name)  # type: ignore[no-any-return]


def debug_enabled() -> bool:
    """Whether framework debug lines are written (the per-message lines cost nothing otherwise):
    the level :func:`configure_logging` set, else what the application's structlog configuration
    says (unconfigured structlog, which would print everything: no)."""
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


def configure_logging(level: str | None = None, fmt: str | None = None) -> None:
    """Configure structlog for a process run by the CLI; ValueError for an unknown level or format.

    ``level``/``fmt`` win over ``FRAMEWORK_LOG_LEVEL``/``FRAMEWORK_LOG_FORMAT``. Records of
    stdlib ``logging`` go through the same renderer, with the same per-message context.
    """
    global _configured_level
    from framework.observability.logcontext import MessageContextFilter, add_message_context

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
    timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_message_context,
            structlog.processors.add_log_level,
            timestamper,
            *exc,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    _configured_level = numeric
    # stdlib records: the same renderer; the filter adds the message context as record attributes
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(MessageContextFilter())
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[
                structlog.stdlib.add_logger_name,
                structlog.stdlib.ExtraAdder(),
                structlog.processors.add_log_level,
                timestamper,
            ],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *exc, renderer],
        )
    )
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_framework", False)]:
        root.removeHandler(old)  # configured again (tests): one handler, not two
    handler._framework = True  # type: ignore[attr-defined]
    if not any(not getattr(h, "_framework", False) for h in root.handlers):  # like basicConfig: never a second
        root.addHandler(handler)
        # handlers' own stdlib lines at the chosen level; libraries' chatter only from warnings on
        root.setLevel(numeric)
        for name in _QUIET_LIBRARIES:
            logging.getLogger(name).setLevel(max(numeric, logging.WARNING))
