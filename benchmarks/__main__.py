"""``python -m benchmarks``: run the benchmarks, print one table of medians, optionally write JSON.

    python -m benchmarks [--quick] [--repeats N] [--only NAME ...] [--json PATH]
    python -m benchmarks soak [--minutes 20] [--rate R]    (SQL effects under faults; not in the default run)
    python -m benchmarks sql-breakdown [--workers 1]       (a SQL-effects worker's CPU by layer; not in the default run)

Server: ``$REDIS_URL`` if set, else an embedded Valkey (AOF on) started for the run and removed after.
Each benchmark works in a namespace of its own and deletes its keys; nothing is ever flushed.
Throughput and latency trials are interleaved (raw, commands with inbox on and off, events,
latency, then again), so a change in background load hits the framework and its ceiling alike
(:class:`benchmarks.runner.Runner`; this module picks the benchmarks and prints the table).
``observability`` (:mod:`benchmarks.tracing_bench`) runs the commands drain and the latency trial
with tracing off, on at 100% and 1%, and metrics on, in every round; with
``BENCH_BASELINE_PYTHONPATH=<checkout of the code before>`` also against that code.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

import attrs
import orjson
from rich.console import Console

from benchmarks import dashboard_bench, machine, procs
from benchmarks.rows import _table
from benchmarks.runner import FULL, QUICK, Runner, Sizes, progress

__all__ = ["BENCHMARKS", "Sizes", "main"]

BENCHMARKS = (
    "raw",
    "commands",
    "batch",
    "events",
    "latency",
    "peer",
    "observability",
    "memory",
    "outbox",
    "spark",
    "recovery",
    "sql",
    "ownership",
    "cluster",
    "schedule",
    "saga",
    "rabbitmq",
    "workers",
    "reply",
)
_NEEDS_RAW = {"commands", "events", "memory", "peer", "batch"}  # their ratios need the ceiling of the same run


# -- the server and the command line ------------------------------------------------------------------------


@contextlib.contextmanager
def _server() -> Iterator[tuple[str, bool]]:
    url = os.environ.get("REDIS_URL")
    if url:
        yield url, False
        return
    from framework.testing import embedded_server

    progress("starting an embedded Valkey (AOF on) for this run")
    with embedded_server() as url:
        yield url, True


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Run the benchmarks; print one table "
        "of medians next to the raw redis-py ceiling measured in the same run.",
    )
    parser.add_argument(
        "--quick", action="store_true", help="small sizes for a smoke run (default: full sizes, several minutes)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="runs per throughput/latency figure; the median is reported (default 3, 1 with --quick)",
    )
    parser.add_argument(
        "--only", nargs="+", choices=BENCHMARKS, metavar="NAME", help=f"run only these: {', '.join(BENCHMARKS)}"
    )
    parser.add_argument("--json", metavar="PATH", help="also write every number to this JSON file")
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def _on_sigterm(signum: int, _frame: Any) -> NoReturn:
    raise SystemExit(128 + signum)  # unwinds through the context managers, which stop every child


def _soak(argv: Sequence[str]) -> int:
    """``python -m benchmarks soak``: the SQL-effects soak under faults (see :mod:`benchmarks.sql_soak`)."""
    from benchmarks import sql_soak

    options = sql_soak.parse(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        with _server() as (url, _embedded):
            return sql_soak.run(url, options, progress=progress)
    finally:
        procs.stop_all()
        procs.remove_logs(keep=True)


def _breakdown(argv: Sequence[str]) -> int:
    """``python -m benchmarks sql-breakdown``: the SQL handler's CPU by layer (:mod:`benchmarks.sql_breakdown`)."""
    from benchmarks import sql_breakdown

    with _server() as (url, _embedded):
        return sql_breakdown.main(url, argv)


def _inbox_steps(argv: Sequence[str]) -> int:
    """``python -m benchmarks inbox-steps``: the server's time per message by step (:mod:`benchmarks.inbox_steps`)."""
    from benchmarks import inbox_steps

    with _server() as (url, _embedded):
        return inbox_steps.main(url, argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmarks; exit 1 if a runtime benchmark failed (missed targets and absent modules are reported)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["soak"]:
        return _soak(argv[1:])
    if argv[:1] == ["sql-breakdown"]:
        return _breakdown(argv[1:])
    if argv[:1] == ["inbox-steps"]:
        return _inbox_steps(argv[1:])
    if "dashboard" in argv:  # its own runner: the DLQ page with 100,000 dead letters (benchmarks/dashboard_bench.py)
        return dashboard_bench.main(argv)
    args = _parse(argv)
    sizes = QUICK if args.quick else FULL
    repeats = args.repeats or (1 if args.quick else 3)
    selected = list(args.only or BENCHMARKS)
    if _NEEDS_RAW & set(selected) and "raw" not in selected:
        selected.insert(0, "raw")
    if "batch" in selected and "commands" not in selected:  # its row is next to the per-message handler's
        selected.insert(selected.index("batch"), "commands")
    signal.signal(signal.SIGTERM, _on_sigterm)
    started = time.time()
    try:
        with _server() as (url, embedded):
            desc = machine.describe(url, embedded)
            pid = machine.server_pid(url)
            progress(
                f"{desc['cores']} cores ({desc['cpu']}), Python {desc['python']}, {desc['server']}; "
                f"sizes {'quick' if args.quick else 'full'}, {repeats} run(s) per figure"
            )
            runner = Runner(url, sizes, repeats, selected, pid)
            with machine.Conditions(pid) as conditions:
                runner.run()
    finally:
        procs.stop_all()
    cond = conditions.summary()
    rows = runner.rows()
    out = Console(highlight=False, width=max(Console().width, 140))
    out.print(_table(rows, f"benchmarks ({'quick' if args.quick else 'full'} sizes, median of {repeats})"))
    out.print(
        "ratio: the median over rounds of result / raw ceiling measured in the same round (robust to drifting "
        "load); raw ceiling and results are medians over rounds"
    )
    out.print(f"{desc['cores']} cores · {desc['cpu']} · Python {desc['python']} · {desc['server']}")
    out.print(
        f"machine during the run ({cond['minutes']} min): load average {cond['load_first']:.1f} at start, "
        f"median {cond['load_median']:.1f}, max {cond['load_max']:.1f}; CPU busy {cond['cpu_busy_pct']:.0f}%, "
        f"of which other processes {cond['cpu_others_pct']:.0f}%; steal {cond['cpu_steal_pct']:.1f}%"
    )
    loads = runner.load_by_benchmark()
    if loads:
        out.print(
            "load per benchmark (median load average / CPU share of other processes): "
            + ", ".join(f"{k} {v['load']:.1f}/{v['others_pct']:.0f}%" for k, v in loads.items())
        )
    if args.json:
        payload = {
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "args": {"quick": args.quick, "repeats": repeats, "only": selected},
            "sizes": attrs.asdict(sizes),
            "machine": desc,
            "conditions": cond,
            "load_by_benchmark": loads,
            "summary": runner.summary(),
            "errors": runner.errors,
            "trials": runner.trials,
            "table": [attrs.asdict(r) for r in rows],
        }
        with open(args.json, "wb") as f:
            f.write(orjson.dumps(payload, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
        out.print(f"wrote {args.json}")
    own_failures = [
        name
        for name, error in runner.errors.items()
        if name not in ("outbox", "spark") and not (name in ("sql", "peer") and error.startswith("not run"))
    ]
    procs.remove_logs(keep=bool(runner.errors))
    return 1 if own_failures else 0


if __name__ == "__main__":
    sys.exit(main())
