"""Argument types and inputs shared by the ``framework`` sub-commands: a bad value gets one line.

Durations and rates must be finite numbers (``nan`` and ``inf`` are refused: a worker with a
``nan`` visibility timeout crashes every task in a loop). JSON arguments accept ``-`` (stdin) and
``@FILE`` for bodies too large for a command line.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from framework.logs import LEVELS

__all__ = [
    "duration",
    "json_argument",
    "log_level",
    "metrics_address",
    "metrics_options",
    "port",
    "positive_duration",
    "positive_int",
    "positive_rate",
]

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def positive_int(text: str) -> int:
    """A whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def port(text: str) -> int:
    """A TCP port number, 1 to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number (1-65535), got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port number is 1 to 65535, got {value}")
    return value


def metrics_options(p: argparse.ArgumentParser) -> None:
    """Add ``--metrics-port`` and ``--metrics-host`` (the Prometheus endpoint; see :func:`metrics_address`)."""
    p.add_argument(
        "--metrics-port",
        type=port,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (default: $FRAMEWORK_METRICS_PORT, else none)",
    )
    p.add_argument(
        "--metrics-host",
        default=None,
        metavar="HOST",
        help="address the metrics endpoint listens on (default: $FRAMEWORK_METRICS_HOST, else 127.0.0.1)",
    )


def metrics_address(args: argparse.Namespace) -> tuple[int | None, str]:
    """(port or None, host) of the Prometheus endpoint: the options, else ``FRAMEWORK_METRICS_PORT``
    and ``FRAMEWORK_METRICS_HOST``; ValueError in one line for a bad port in the environment."""
    value = args.metrics_port
    if value is None and os.environ.get("FRAMEWORK_METRICS_PORT", "").strip():
        try:
            value = port(os.environ["FRAMEWORK_METRICS_PORT"].strip())
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"FRAMEWORK_METRICS_PORT: {exc}") from None
    host = args.metrics_host or os.environ.get("FRAMEWORK_METRICS_HOST", "").strip() or "127.0.0.1"
    return value, host


def duration(text: str) -> float:
    """Seconds, with an optional unit: 30, 2.5s, 10m, 24h, 7d (zero allowed; nan and inf refused)."""
    try:
        value = float(text[:-1]) * _UNITS[text[-1]] if text and text[-1] in _UNITS else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds like 30, 2.5s, 10m, 24h or 7d, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds like 30, 10m or 7d, got {text!r}")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {text!r}")
    return value


def positive_duration(text: str) -> float:
    """A :func:`duration` above zero."""
    value = duration(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than zero, got {text!r}")
    return value


def positive_rate(text: str) -> float:
    """A finite number above zero (per second); to set no cap, leave the option out."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number per second, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number per second (omit it for no cap), got {text!r}")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than zero, got {text!r}")
    return value


def log_level(text: str) -> str:
    """A level name of :data:`framework.logs.LEVELS`, in any case."""
    level = text.strip().lower()
    if level not in LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(LEVELS)}, got {text!r}")
    return level


def json_argument(text: str, stdin: BinaryIO | None = None) -> Any:
    """Parse a JSON argument: the JSON itself, ``-`` (read stdin) or ``@FILE`` (read that file).

    Raises ValueError with a one-line explanation (missing file, invalid JSON). No JSON text
    starts with ``-`` alone or ``@``, so the forms cannot be confused.
    """
    if text == "-":
        source, raw = "stdin", (stdin or sys.stdin.buffer).read()
    elif text.startswith("@"):
        path = Path(text[1:]).expanduser()
        source = f"file {str(path)!r}"
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise ValueError(f"payload file {str(path)!r} does not exist") from None
        except OSError as exc:
            raise ValueError(f"cannot read payload file {str(path)!r}: {exc.strerror or exc}") from None
    else:
        source, raw = "", text.encode()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if source:
            raise ValueError(f"payload from {source} is not valid JSON ({exc})") from None
        raise ValueError(f"payload is not valid JSON ({exc}): {text[:80]!r}") from None
