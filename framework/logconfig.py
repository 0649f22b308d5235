"""Configuring structlog and stdlib ``logging`` for a process the CLI runs: level, format, message context.

The level and format come from ``FRAMEWORK_LOG_LEVEL`` and ``FRAMEWORK_LOG_FORMAT`` (see
:mod:`framework.logs`); every line carries the per-message context of
:mod:`framework.observability.logcontext`. Not called on import: applications embedding the
framework keep their own structlog configuration.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO, cast

import structlog

from framework.logs import level_number, set_configured_level
from framework.observability.logcontext import MessageContextFilter, add_message_context

__all__ = ["configure_logging"]

_FORMATS = ("console", "json")
_QUIET_LIBRARIES = ("asyncio", "urllib3", "opentelemetry", "py4j", "pyspark", "sqlalchemy", "psycopg")


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is when a line is written, not when logging was configured (a
    caller that redirected stderr meanwhile, e.g. pytest's capture, may have closed the old one)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


_STDERR = _CurrentStderr()


def configure_logging(level: str | None = None, fmt: str | None = None) -> None:
    """Configure structlog for a process run by the CLI; ValueError for an unknown level or format.

    ``level``/``fmt`` win over ``FRAMEWORK_LOG_LEVEL``/``FRAMEWORK_LOG_FORMAT``. Records of
    stdlib ``logging`` go through the same renderer, with the same per-message context.
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
    timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True)
    # The processors go into the list structlog already holds: loggers cached before a second call
    # in one process (a CLI command run in-process) keep that list, so they follow the new
    # configuration (and structlog.testing.capture_logs, which swaps the list's contents, sees them).
    processors: list[structlog.typing.Processor] = structlog.get_config()["processors"]
    processors[:] = [
        structlog.contextvars.merge_contextvars,
        add_message_context,
        structlog.processors.add_log_level,
        timestamper,
        *exc,
        renderer,
    ]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # one write per line, its newline included: the processes of `--workers N` share stderr, and a
        # line written in two parts (print's text, then its newline) can end up inside another's
        logger_factory=structlog.WriteLoggerFactory(file=cast(TextIO, _STDERR)),
        cache_logger_on_first_use=True,
    )
    set_configured_level(numeric)
    # stdlib records: the same renderer; the filter adds the message context as record attributes
    handler = logging.StreamHandler(_STDERR)
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
