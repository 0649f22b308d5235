"""Batch handlers (issue #35): one worker draining commands into a batch handler, in the same round as
the per-message handler (``commands:on``) and the raw redis-py ceiling (``raw:xack``).

The batch handler (``benchmarks.bench_services:commands_batch``, ``BatchPolicy(max_size=500,
max_wait=0.05)``, inbox on) only counts what it receives, like the per-message one, so the
figure is the framework's own loop: fetch, inbox check, decode, one call per batch, per-message
settlement (acks batched). Ratios are paired by round.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from benchmarks import framework_bench

__all__ = ["rows", "summary", "trials"]

KEY = "batch:on"


def trials(url: str, n: int, *, progress: Callable[[str], None]) -> Iterator[tuple[str, Callable[[], dict[str, Any]]]]:
    """One round's trial as (key, call): ``n`` commands drained by one worker's batch handler."""
    yield (
        KEY,
        functools.partial(
            framework_bench.commands,
            url,
            n,
            inbox=True,
            label="commands (batch handler, inbox on)",
            target="commands_batch",
            progress=progress,
        ),
    )


def _stats(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": list(values)}


def _paired(trials_: Mapping[str, list[dict[str, Any]]], key: str, base: str, base_field: str) -> Any:
    bases = {t["round"]: t[base_field] for t in trials_.get(base, []) if t.get("round") is not None}
    ratios = [t["msgs_per_s"] / bases[t["round"]] for t in trials_.get(key, []) if t.get("round") in bases]
    return _stats(ratios) if ratios else None


def summary(trials_: Mapping[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The batch drain's msg/s, paired by round to the raw ceiling and to the per-message handler."""
    runs = trials_.get(KEY)
    if not runs:
        return {}
    fig: dict[str, Any] = {"msgs_per_s": _stats([t["msgs_per_s"] for t in runs])}
    if pr := _paired(trials_, KEY, "raw:xack", "drain_msgs_per_s"):
        fig["ratio_to_raw"] = pr
    if pr := _paired(trials_, KEY, "commands:on", "msgs_per_s"):
        fig["ratio_to_per_message"] = pr
    return {KEY: fig}


def rows(sm: Mapping[str, dict[str, Any]], errors: Mapping[str, str]) -> list[dict[str, Any]]:
    """Table rows (fields of ``benchmarks.rows.Row``): the batch drain against the ceiling and the per-message one."""
    if "batch" in errors:
        return [{"benchmark": "commands → batch handler", "result": f"[yellow]{errors['batch']}[/yellow]"}]
    if not (fig := sm.get(KEY)):
        return []
    raw = sm.get("raw:xack", {}).get("drain_msgs_per_s")
    per = sm.get("commands:on", {}).get("msgs_per_s")
    rate = fig["msgs_per_s"]
    spread = f"\n[dim]{rate['min']:,.0f}-{rate['max']:,.0f}[/dim]" if len(rate["runs"]) > 1 else ""
    pr, pm = fig.get("ratio_to_raw"), fig.get("ratio_to_per_message")
    ratio = f"{pr['median']:.0%}" if pr else "—"
    if pm:
        ratio += f"\n[dim]{pm['median']:.2f}x per-message ({per['median']:,.0f} msg/s)[/dim]" if per else ""
    return [
        {
            "benchmark": "commands → one worker, batch handler (max_size 500), inbox on",
            "result": f"{rate['median']:,.0f} msg/s{spread}",
            "ceiling": f"{raw['median']:,.0f} msg/s" if raw else "—",
            "ratio": ratio,
            "target": "reported, next to the per-message handler",
        }
    ]
