"""Trends on the overview: each group's throughput and failure rate, from successive samples.

A sample (entries delivered to the group so far, dead letters now) is taken server-side whenever
the overview is read (at most one every two seconds; the page refreshes itself every five) and
kept in memory, the last 60 per group. Rates are the growth between two samples over the time
between them (messages per second delivered; dead letters per second added), drawn as an inline
SVG polyline: no script, nothing fetched.
"""

from __future__ import annotations

import itertools
import time
from collections import deque

from markupsafe import Markup

__all__ = ["Samples", "sparkline"]

_KEEP = 60
_EVERY = 2.0


class Samples:
    """Successive (time, delivered, dead letters) samples per (destination, group)."""

    def __init__(self) -> None:
        self.series: dict[tuple[str, str], deque[tuple[float, int, int]]] = {}
        self._last = 0.0

    def add(self, rows: list[tuple[str, str, int, int]]) -> None:
        """Record one sample of (destination, group, delivered so far, dead letters) rows (skipped if too soon)."""
        now = time.monotonic()
        if now - self._last < _EVERY and self.series:
            return
        self._last = now
        for dest, group, delivered, dead in rows:
            self.series.setdefault((dest, group), deque(maxlen=_KEEP)).append((now, delivered, dead))

    def rates(self, dest: str, group: str, which: int) -> list[float]:
        """Per-second growth between successive samples (1: delivered, 2: dead letters), oldest first."""
        s = list(self.series.get((dest, group), ()))
        return [max((b[which] - a[which]) / max(b[0] - a[0], 1e-3), 0.0) for a, b in itertools.pairwise(s)]


def sparkline(values: list[float], *, label: str, width: int = 120, height: int = 24) -> Markup:
    """An inline SVG polyline of ``values`` (a flat line for fewer than two), titled with the last value."""
    if len(values) < 2:
        values = [values[0] if values else 0.0] * 2
    top = max(max(values), 1e-9)
    step = width / (len(values) - 1)
    points = " ".join(f"{i * step:.1f},{height - 2 - (v / top) * (height - 4):.1f}" for i, v in enumerate(values))
    title = f"{label}: {values[-1]:.1f}/s now, max {max(values):.1f}/s"
    return Markup(
        f'<svg class="spark" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">'
        f"<title>{Markup.escape(title)}</title>"
        f'<polyline fill="none" stroke="currentColor" stroke-width="1.5" points="{points}"/></svg>'
        f'<span class="rate">{values[-1]:.1f}/s</span>'
    )
