"""The trial runner of ``python -m benchmarks``: the sizes, and :class:`Runner`, which interleaves the
selected benchmarks' trials round by round and keeps every trial's numbers, errors and machine conditions.

Throughput and latency trials are interleaved (raw, commands with inbox on and off, events,
latency, then again), so a change in background load hits the framework and its ceiling alike;
memory, outbox, Spark and the other external benchmarks run once each after the rounds.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import attrs
from rich.console import Console

from benchmarks import batch_bench, faststream_bench, machine, runtime_bench, tracing_bench
from benchmarks.report import Report
from benchmarks.rows import SQL_WORK_MS, SQL_WORKERS, _sql_key, sql_kinds

__all__ = ["FULL", "QUICK", "Runner", "Sizes", "progress"]


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


def progress(message: str) -> None:
    """Print ``message`` to stderr with the time of day."""
    err.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {message}")


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
                progress(f"[red]{group} failed[/red]: {exc}")
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

            progress("sql: preparing a scratch PostgreSQL database ($DATABASE_URL, else embedded)")
            return str(stack.enter_context(sql_bench.database()))
        except Exception as exc:
            self.errors["sql"] = f"not run: {type(exc).__name__}: {exc}"
            progress(f"[yellow]sql: {self.errors['sql']}[/yellow]")
            return None

    def _sql_round(self, db: str, round_: int) -> None:
        """Framework and plain consumer with 1 and 3 workers; the order alternates by round."""
        from benchmarks import sql_bench

        s = self.sizes
        for work, workers in ((work, w) for work in SQL_WORK_MS for w in SQL_WORKERS):
            kinds = ("plain", *sql_kinds(work))
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
                        progress=progress,
                    ),
                    round_,
                )

    def _observability_round(self, round_: int) -> None:
        """The commands drain, then the latency trial, in every observability mode (order rotated by round)."""
        s, p = self.sizes, progress
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
        s, url, p = self.sizes, self.url, progress
        if "peer" in self.selected and (why := faststream_bench.missing()):
            self.errors["peer"] = why  # FastStream is not installed: its rows say so, the run goes on
        for r in range(self.repeats):
            progress(f"[bold]round {r + 1}/{self.repeats}[/bold]")
            if "raw" in self.selected:
                self._trial("raw:xack", lambda: runtime_bench.raw_ceiling(url, s.messages, progress=p), r)
                self._trial("raw:xdel", lambda: runtime_bench.raw_ceiling(url, s.messages, delete=True, progress=p), r)
            if "commands" in self.selected:
                order = (True, False) if r % 2 == 0 else (False, True)  # alternate, so drift favours neither
                for inbox in order:
                    self._trial(
                        f"commands:{'on' if inbox else 'off'}",
                        lambda inbox=inbox: runtime_bench.commands(
                            url, s.messages, inbox=inbox, progress=p, profile=True, server_pid=self.server_pid
                        ),
                        r,
                    )
            if "batch" in self.selected:  # batch handlers (#35), next to the commands drain of this round
                for key, call in batch_bench.trials(url, s.messages, progress=p):
                    self._trial(key, call, r)
            if "events" in self.selected:
                self._trial("events:3", lambda: runtime_bench.events(url, s.messages, progress=p), r)
            if "latency" in self.selected:
                kw = {"rate": s.latency_rate, "seconds": s.latency_seconds, "progress": p}
                kw["server_pid"] = self.server_pid
                self._trial("latency:raw", lambda kw=kw: runtime_bench.raw_latency(url, **kw), r)
                for inbox in (True, False) if r % 2 == 0 else (False, True):
                    self._trial(
                        "latency:framework" if inbox else "latency:framework-noinbox",
                        lambda kw=kw, inbox=inbox: runtime_bench.latency(url, inbox=inbox, **kw),
                        r,
                    )
            if "peer" in self.selected:  # FastStream, batch and per-message subscribers (issue #33)
                peer = faststream_bench.trials(
                    url,
                    r,
                    messages=s.messages,
                    rate=s.latency_rate,
                    seconds=s.latency_seconds,
                    progress=p,
                    server_pid=self.server_pid,
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

        progress(f"[bold]{name}[/bold]: {module_name}.run()")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            reason = f"{module_name} is missing" if exc.name == module_name else f"cannot import {exc.name}"
            self.errors[name] = f"not run: {reason}"
            progress(f"[yellow]{name}: {self.errors[name]}[/yellow]")
            return
        except Exception as exc:
            self.errors[name] = f"not run: importing {module_name} failed: {type(exc).__name__}: {exc}"
            progress(f"[yellow]{name}: {self.errors[name]}[/yellow]")
            return
        with machine.Conditions(self.server_pid, interval=1.0) as cond:
            try:
                result = call(module)
            except Exception as exc:
                self.errors[name] = f"not run: {type(exc).__name__}: {exc}"
                progress(f"[red]{name} failed[/red]: {exc}")
                traceback.print_exc(file=sys.stderr)
                return
        result["machine"] = cond.summary()
        self.trials[name] = [result]
