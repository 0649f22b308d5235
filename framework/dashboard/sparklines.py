"""Trends on the overview: each group's backlog (lag + pending) and dead letters over the last samples.

A sample is taken server-side whenever the overview is read (at most one every two seconds; the
page refreshes itself every five), kept in memory (the last 60 per group), and drawn as an inline
SVG polyline: no script, nothing fetched.
"""

from __future__ import annotations

import time
from collections import deque

from markupsafe import Markup

__all__ = ["Samples", "sparkline"]

_KEEP = 60
_EVERY = 2.0


class Samples:
    """Successive (backlog, dead letters) values per (destination, group)."""

    def __init__(self) -> None:
        self.series: dict[tuple[str, str], deque[tuple[int, int]]] = {}
        self._last = 0.0

    def add(self, rows: list[tuple[str, str, int, int]]) -> None:
        """Record one sample of (destination, group, backlog, dead letters) rows (skipped if too soon)."""
        now = time.monotonic()
        if now - self._last < _EVERY and self.series:
            return
        self._last = now
        for dest, group, backlog, dead in rows:
            self.series.setdefault((dest, group), deque(maxlen=_KEEP)).append((backlog, dead))

    def values(self, dest: str, group: str, which: int) -> list[int]:
        """The recorded values of one series (0: backlog, 1: dead letters), oldest first."""
        return [v[which] for v in self.series.get((dest, group), ())]


def sparkline(values: list[int], *, width: int = 120, height: int = 24, label: str = "") -> Markup:
    """An inline SVG polyline of ``values`` (a flat line for fewer than two)."""
    if len(values) < 2:
        values = [values[0] if values else 0] * 2
    top = max(max(values), 1)
    step = width / (len(values) - 1)
    points = " ".join(f"{i * step:.1f},{height - 2 - (v / top) * (height - 4):.1f}" for i, v in enumerate(values))
    title = f"{label}: {values[-1]} now, max {max(values)}" if label else ""
    return Markup(
        f'<svg class="spark" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">'
        f"<title>{Markup.escape(title)}</title>"
        f'<polyline fill="none" stroke="currentColor" stroke-width="1.5" points="{points}"/></svg>'
    )
