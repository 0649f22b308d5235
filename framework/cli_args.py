"""Argument types shared by the ``framework`` sub-commands: a bad value gets a one-line explanation."""

from __future__ import annotations

import argparse

__all__ = ["duration", "positive_duration", "positive_int", "positive_rate"]

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


def duration(text: str) -> float:
    """Seconds, with an optional unit: 30, 2.5s, 10m, 24h, 7d (zero allowed)."""
    try:
        value = float(text[:-1]) * _UNITS[text[-1]] if text and text[-1] in _UNITS else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds like 30, 2.5s, 10m, 24h or 7d, got {text!r}") from None
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
    """A number above zero (per second)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number per second, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than zero, got {text!r}")
    return value
