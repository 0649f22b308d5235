"""The latency trial's rows of ``make bench``: publish -> handler start at a fixed rate against the
raw consumer's, the inbox's added p50, and what each consumer's process (and the server) spends
per message at that rate.

CPU per message at a low rate is the cost of the path most services run on (small reads, one
message per read and per ack); the drains measure the other end (full reads of 500).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from benchmarks.rows import Row, _ms

__all__ = ["LATENCY_P50_INBOX_MS", "LATENCY_P99_TARGET_MS", "rows"]

LATENCY_P99_TARGET_MS = 1.0
LATENCY_P50_INBOX_MS = 0.15  # p50 with the inbox on at most this much above inbox off (issue #33)

_CPU = ("cpu_us_per_msg", "server_cpu_us_per_msg")


def _cpu(fig: Mapping[str, Any]) -> str:
    """``consumer + server`` µs per message (medians), or the consumer's alone."""
    parts = [f"{fig[f]['median']:,.0f}" for f in _CPU if f in fig]
    return " + ".join(parts) if parts else "—"


def rows(sm: Mapping[str, dict[str, Any]], rate: float) -> list[Row]:
    """The latency rows from the summary ``sm`` (``latency:*`` and ``peer:latency-batch``)."""
    fw, raw = sm.get("latency:framework"), sm.get("latency:raw")
    if not fw:
        return []
    at = f"{rate:,.0f}/s"
    raw_text = f"p50 {raw['p50_ms']['median']:.2f}\np99 {raw['p99_ms']['median']:.2f}" if raw else "—"
    out = [
        Row(
            f"latency publish → handler start @ {at}, p50 / p99 ms",
            f"p50 {_ms(fw['p50_ms'])}\np99 {_ms(fw['p99_ms'])}\n[dim]p90 {fw['p90_ms']['median']:.2f}, "
            f"max {fw['max_ms']['median']:.2f}[/dim]",
            raw_text,
            f"p99 {fw['p99_ms']['median'] / raw['p99_ms']['median']:.1f}x" if raw else "—",
            f"p99 < {LATENCY_P99_TARGET_MS:g} ms",
            fw["p99_ms"]["median"] < LATENCY_P99_TARGET_MS,
        )
    ]
    fo = sm.get("latency:framework-noinbox")
    if fo:
        out.append(
            Row(
                f"latency publish → handler start @ {at}, inbox off, p50 / p99 ms",
                f"p50 {_ms(fo['p50_ms'])}\np99 {_ms(fo['p99_ms'])}\n[dim]p90 {fo['p90_ms']['median']:.2f}, "
                f"max {fo['max_ms']['median']:.2f}[/dim]",
                raw_text,
                f"p99 {fo['p99_ms']['median'] / raw['p99_ms']['median']:.1f}x" if raw else "—",
                "reported",
            )
        )
    if added := sm.get("latency_inbox_p50_added_ms", {}).get("paired"):
        out.append(
            Row(
                "latency: p50 inbox on - inbox off, paired by round",
                f"{added['median']:+.2f} ms"
                + (f" [dim]({added['min']:+.2f}-{added['max']:+.2f})[/dim]" if len(added["runs"]) > 1 else ""),
                target=f"≤ {LATENCY_P50_INBOX_MS:g} ms (#33)",
                ok=added["median"] <= LATENCY_P50_INBOX_MS,
            )
        )
    if "cpu_us_per_msg" in fw:
        lines = [f"inbox on {_cpu(fw)}"]
        if fo and "cpu_us_per_msg" in fo:
            lines.append(f"inbox off {_cpu(fo)}")
        if (fs := sm.get("peer:latency-batch")) and "cpu_us_per_msg" in fs:
            lines.append(f"[dim]FastStream batch {_cpu(fs)}[/dim]")
        ratios = [
            f"{r['median']:.1f}x"
            for k in ("latency:framework", "latency:framework-noinbox")
            if (r := sm.get(k, {}).get("cpu_ratio_to_raw"))
        ]
        out.append(
            Row(
                f"CPU per message @ {at} (the latency trials), consumer + server µs",
                "\n".join(lines),
                f"raw consumer\n{_cpu(raw)}" if raw and "cpu_us_per_msg" in raw else "—",
                " / ".join(ratios) + " [dim](on / off, consumer)[/dim]" if ratios else "—",
                "reported",
            )
        )
    return out
