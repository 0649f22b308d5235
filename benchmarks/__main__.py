"""``python -m benchmarks``: run the benchmarks, print one table of medians, optionally write JSON.

    python -m benchmarks [--quick] [--repeats N] [--only NAME ...] [--json PATH]
    python -m benchmarks soak [--minutes 20] [--rate R]    (SQL effects under faults; not in the default run)
    python -m benchmarks sql-breakdown [--workers 1]       (a SQL-effects worker's CPU by layer; not in the default run)

Server: ``$REDIS_URL`` if set, else an embedded Valkey (AOF on) started for the run and removed after.
Each benchmark works in a namespace of its own and deletes its keys; nothing is ever flushed.
Throughput and latency trials are interleaved (raw, commands with inbox on and off, events,
latency, then again), so a change in background load hits the framework and its ceiling alike.
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
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import attrs
import orjson
from rich.console import Console

from benchmarks import batch_bench, faststream_bench, machine, procs, runtime_bench, tracing_bench
from benchmarks.report import Report
from benchmarks.rows import SQL_FRAMEWORK_KINDS, SQL_WORK_MS, SQL_WORKERS, _sql_key, _table

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


@attrs.frozen
class Sizes:
    """How much work each benchmark does."""

    messages: int  # throughput runs (commands, events, raw ceiling)
    memory_backlog: int
    memory_small: int
    latency_seconds: float
    latency_rate: float
    outbox_messages: int
    spark_events: int
    recovery_messages: int = 30_000
    sql_messages: int = 20_000  # backlog drained per SQL-effects trial
    sql_latency_rate: float = 200.0  # msg/s offered in the SQL latency phase (3 workers)
    sql_latency_seconds: float = 10.0


FULL = Sizes(200_000, 1_000_000, 100_000, 10.0, 500.0, 100_000, 1_000_000)
QUICK = Sizes(20_000, 50_000, 5_000, 3.0, 500.0, 5_000, 20_000, 30_000, 3_000, 200.0, 5.0)

err = Console(stderr=True, highlight=False)


def _progress(message: str) -> None:
    err.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {message}")


# -- running ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _server() -> Iterator[tuple[str, bool]]:
    url = os.environ.get("REDIS_URL")
    if url:
        yield url, False
        return
    from framework.testing import embedded_server

    _progress("starting an embedded Valkey (AOF on) for this run")
    with embedded_server() as url:
        yield url, True


class Runner(Report):
    """Runs the selected benchmarks and keeps every trial's numbers, errors and machine conditions."""

    def __init__(self, url: str, sizes: Sizes, repeats: int, selected: Sequence[str], server_pid: int | None) -> None:
        self.url = url
        self.sizes = sizes
        self.repeats = repeats
        self.selected = list(selected)
        self.server_pid = server_pid
        self.trials: dict[str, list[dict[str, Any]]] = {}
        self.errors: dict[str, str] = {}
        self.extra: dict[str, Any] = {}

    def _trial(self, key: str, fn: Callable[[], dict[str, Any]], round_: int | None = None) -> None:
        """Run one trial unless its benchmark already failed; record it with its round and the load meanwhile."""
        group = key.split(":")[0]
        if group in self.errors:
            return
        with machine.Conditions(self.server_pid, interval=1.0) as cond:
            try:
                result = fn()
            except Exception as exc:
                self.errors[group] = f"failed: {type(exc).__name__}: {exc}"
                _progress(f"[red]{group} failed[/red]: {exc}")
                traceback.print_exc(file=sys.stderr)
                return
        result["machine"] = cond.summary()
        result["round"] = round_
        self.trials.setdefault(key, []).append(result)

    def run(self) -> None:
        """Repeat the interleaved throughput and latency trials, then memory, outbox and Spark once each."""
        with contextlib.ExitStack() as stack:
            self._run(self._sql_database(stack) if "sql" in self.selected else None)

    def _sql_database(self, stack: contextlib.ExitStack) -> str | None:
        """A scratch PostgreSQL database for the SQL trials (kept for the whole run), or None with the reason."""
        try:
            from benchmarks import sql_bench

            _progress("sql: preparing a scratch PostgreSQL database ($DATABASE_URL, else embedded)")
            return str(stack.enter_context(sql_bench.database()))
        except Exception as exc:
            self.errors["sql"] = f"not run: {type(exc).__name__}: {exc}"
            _progress(f"[yellow]sql: {self.errors['sql']}[/yellow]")
            return None

    def _sql_round(self, db: str, round_: int) -> None:
        """Framework and plain consumer with 1 and 3 workers; the order alternates by round."""
        from benchmarks import sql_bench

        s = self.sizes
        for work, workers in ((work, w) for work in SQL_WORK_MS for w in SQL_WORKERS):
            kinds = ("plain", *SQL_FRAMEWORK_KINDS)
            if (round_ + workers) % 2 == 0:  # alternate, so drift favours neither
                kinds = kinds[::-1]
            for kind in kinds:
                rate = s.sql_latency_rate if workers == max(SQL_WORKERS) and work else None
                self._trial(
                    f"{_sql_key(work)}:{kind}:{workers}",
                    lambda kind=kind, workers=workers, rate=rate, work=work: sql_bench.drain_trial(
                        self.url,
                        db,
                        kind,
                        workers,
                        s.sql_messages,
                        latency_rate=rate,
                        latency_seconds=s.sql_latency_seconds,
                        work_ms=work,
                        progress=_progress,
                    ),
                    round_,
                )

    def _observability_round(self, round_: int) -> None:
        """The commands drain, then the latency trial, in every observability mode (order rotated by round)."""
        s, p = self.sizes, _progress
        for mode in tracing_bench.round_order(round_):
            self._trial(
                f"observability:{mode}",
                lambda mode=mode: tracing_bench.drain_trial(self.url, s.messages, mode, progress=p),
                round_,
            )
        for mode in tracing_bench.round_order(round_):
            self._trial(
                f"observability-latency:{mode}",
                lambda mode=mode: tracing_bench.latency_trial(
                    self.url, mode, rate=s.latency_rate, seconds=s.latency_seconds, progress=p
                ),
                round_,
            )

    def _run(self, sql_db: str | None) -> None:
        s, url, p = self.sizes, self.url, _progress
        if "peer" in self.selected and (why := faststream_bench.missing()):
            self.errors["peer"] = why  # FastStream is not installed: its rows say so, the run goes on
        for r in range(self.repeats):
            _progress(f"[bold]round {r + 1}/{self.repeats}[/bold]")
            if "raw" in self.selected:
                self._trial("raw:xack", lambda: runtime_bench.raw_ceiling(url, s.messages, progress=p), r)
                self._trial("raw:xdel", lambda: runtime_bench.raw_ceiling(url, s.messages, delete=True, progress=p), r)
            if "commands" in self.selected:
                order = (True, False) if r % 2 == 0 else (False, True)  # alternate, so drift favours neither
                for inbox in order:
                    self._trial(
                        f"commands:{'on' if inbox else 'off'}",
                        lambda inbox=inbox: runtime_bench.commands(url, s.messages, inbox=inbox, progress=p),
                        r,
                    )
            if "batch" in self.selected:  # batch handlers (#35), next to the commands drain of this round
                for key, call in batch_bench.trials(url, s.messages, progress=p):
                    self._trial(key, call, r)
            if "events" in self.selected:
                self._trial("events:3", lambda: runtime_bench.events(url, s.messages, progress=p), r)
            if "latency" in self.selected:
                kw = {"rate": s.latency_rate, "seconds": s.latency_seconds, "progress": p}
                self._trial("latency:raw", lambda kw=kw: runtime_bench.raw_latency(url, **kw), r)
                for inbox in (True, False) if r % 2 == 0 else (False, True):
                    self._trial(
                        "latency:framework" if inbox else "latency:framework-noinbox",
                        lambda kw=kw, inbox=inbox: runtime_bench.latency(url, inbox=inbox, **kw),
                        r,
                    )
            if "peer" in self.selected:  # FastStream, batch and per-message subscribers (issue #33)
                peer = faststream_bench.trials(
                    url, r, messages=s.messages, rate=s.latency_rate, seconds=s.latency_seconds, progress=p
                )
                for key, call in peer:
                    self._trial(key, call, r)
            if "observability" in self.selected:
                self._observability_round(r)
            if "recovery" in self.selected:
                from benchmarks import recovery_bench

                self._trial("recovery", lambda: recovery_bench.run_trial(url, s.recovery_messages, progress=p), r)
            if sql_db is not None:
                self._sql_round(sql_db, r)
        if "memory" in self.selected:
            self._trial("memory:small", lambda: runtime_bench.memory(url, s.memory_small, progress=p))
            self._trial("memory:big", lambda: runtime_bench.memory(url, s.memory_backlog, progress=p))
        if "outbox" in self.selected:
            self._external(
                "outbox",
                "benchmarks.outbox_bench",
                lambda m: m.run(
                    url, os.environ.get("DATABASE_URL") or None, messages=s.outbox_messages, repeats=self.repeats
                ),
            )
        if "spark" in self.selected:
            self._external(
                "spark",
                "benchmarks.spark_bench",
                lambda m: m.run(url, events=s.spark_events, partitions=4, repeats=self.repeats),
            )
        if "ownership" in self.selected:  # partition ownership (#12): 8 partitions, 1, 2 and 4 workers
            self._external(
                "ownership",
                "benchmarks.ownership_bench",
                lambda m: m.run(url, messages=max(s.messages, 200_000), repeats=self.repeats),
            )
        if "cluster" in self.selected:  # Redis Cluster (#12): 8 partitions, 1, 2 and 4 workers, vs one server
            self._external(
                "cluster",
                "benchmarks.cluster_bench",
                lambda m: m.run(url, messages=max(s.messages, 200_000), repeats=self.repeats),
            )
        if "schedule" in self.selected:  # scheduled messages (#13): lateness and the mover's throughput
            self._external(
                "schedule",
                "benchmarks.schedule_bench",
                lambda m: m.run(url, messages=s.messages // 2, repeats=self.repeats),
            )
        if "rabbitmq" in self.selected:  # the RabbitMQ transport (#34) next to raw aio-pika and FastStream
            self._external(
                "rabbitmq",
                "benchmarks.rabbitmq_bench",
                lambda m: {
                    "medians": m.run(
                        os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/"),
                        messages=s.messages // 10,
                        rounds=self.repeats,
                    )
                },
            )
        if "saga" in self.selected:  # sagas (#13): saga steps/s vs plain handlers with the inbox on
            self._external(
                "saga",
                "benchmarks.saga_bench",
                lambda m: m.run(url, messages=s.messages // 4, repeats=self.repeats, sql=True),
            )

        if "workers" in self.selected:  # `framework run --workers 2` vs two separate processes (#36)
            self._external(
                "workers", "benchmarks.workers_bench", lambda m: m.run(url, messages=s.messages, repeats=self.repeats)
            )
        if "reply" in self.selected:  # request/reply (#35): round trips next to a raw redis-py loop, same run
            self._external(
                "reply",
                "benchmarks.reply_bench",
                lambda m: m.run(url, requests=max(500, s.messages // 10), repeats=self.repeats),
            )

    def _external(self, name: str, module_name: str, call: Callable[[Any], dict[str, Any]]) -> None:
        """Run another engineer's benchmark module if it is there; a missing or failing one is reported."""
        import importlib

        _progress(f"[bold]{name}[/bold]: {module_name}.run()")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            reason = f"{module_name} is missing" if exc.name == module_name else f"cannot import {exc.name}"
            self.errors[name] = f"not run: {reason}"
            _progress(f"[yellow]{name}: {self.errors[name]}[/yellow]")
            return
        except Exception as exc:
            self.errors[name] = f"not run: importing {module_name} failed: {type(exc).__name__}: {exc}"
            _progress(f"[yellow]{name}: {self.errors[name]}[/yellow]")
            return
        with machine.Conditions(self.server_pid, interval=1.0) as cond:
            try:
                result = call(module)
            except Exception as exc:
                self.errors[name] = f"not run: {type(exc).__name__}: {exc}"
                _progress(f"[red]{name} failed[/red]: {exc}")
                traceback.print_exc(file=sys.stderr)
                return
        result["machine"] = cond.summary()
        self.trials[name] = [result]


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
            return sql_soak.run(url, options, progress=_progress)
    finally:
        procs.stop_all()
        procs.remove_logs(keep=True)


def _breakdown(argv: Sequence[str]) -> int:
    """``python -m benchmarks sql-breakdown``: the SQL handler's CPU by layer (:mod:`benchmarks.sql_breakdown`)."""
    from benchmarks import sql_breakdown

    with _server() as (url, _embedded):
        return sql_breakdown.main(url, argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmarks; exit 1 if a runtime benchmark failed (missed targets and absent modules are reported)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["soak"]:
        return _soak(argv[1:])
    if argv[:1] == ["sql-breakdown"]:
        return _breakdown(argv[1:])
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
            _progress(
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
