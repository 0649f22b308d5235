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
import functools
import os
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import attrs
import orjson
from rich.console import Console
from rich.table import Table

from benchmarks import faststream_bench, machine, procs, runtime_bench, tracing_bench

__all__ = ["BENCHMARKS", "Sizes", "main"]

SQL_FRAMEWORK_KINDS = {  # the framework kinds the sql benchmark runs, and how their rows name them
    "framework": "Redis + SQL inbox (default)",
    "framework-sqlinbox": 'inbox="sql"',
}
BENCHMARKS = (
    "raw",
    "commands",
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
)
_NEEDS_RAW = {"commands", "events", "memory", "peer"}  # their ratios need the ceiling of the same run

THROUGHPUT_TARGET = 0.25  # of the raw ceiling, one worker process
LATENCY_P99_TARGET_MS = 1.0
LATENCY_P50_INBOX_MS = 0.15  # p50 with the inbox on at most this much above inbox off (issue #33)
INBOX_COST_TARGET = 0.30
MEMORY_FLAT_TARGET = 1.10  # peak RSS, big backlog over small backlog
INBOX_BYTES_TARGET = 32  # server bytes per remembered inbox id (issue #15)
OUTBOX_TARGET = 20_000
SPARK_RATIO_TARGET = 0.50  # broker -> Parquet rows/s over the in-memory Python source's
SQL_RATIO_TARGET = 2.0  # framework msg/s over the plain redis-py + psycopg consumer's, same worker count (#33)
SQL_CPU_TARGET_MS = 0.3  # client CPU per message, framework workers
SQL_CPU0_RATIO_TARGET = 1.0  # 0 ms of work: framework client CPU per message over the plain consumer's (#33)
SQL_WORKERS = (1, 3)
SQL_WORK_MS = (2.0, 0.0)  # work per message; the trials at 0 ms are keyed "sql:0ms:<kind>:<workers>"


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


# -- statistics and formatting ------------------------------------------------------------------------------


def stats(values: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and every value."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": list(values)}


def _rate(s: dict[str, Any], unit: str = "msg/s") -> str:
    spread = f"\n[dim]{s['min']:,.0f}-{s['max']:,.0f}[/dim]" if len(s["runs"]) > 1 else ""
    return f"{s['median']:,.0f} {unit}{spread}"


def _ms(s: dict[str, Any]) -> str:
    return f"{s['median']:.2f}" + (f" [dim]({s['min']:.2f}-{s['max']:.2f})[/dim]" if len(s["runs"]) > 1 else "")


def _sql_key(work_ms: float) -> str:
    """The trial keys' prefix of the sql benchmark at ``work_ms`` of work: ``sql`` (2 ms), ``sql:0ms`` (0 ms)."""
    return "sql" if work_ms == 2.0 else f"sql:{work_ms:g}ms"


def _verdict(ok: bool | None) -> str:
    return "" if ok is None else ("[green]pass[/green]" if ok else "[red]FAIL[/red]")


@attrs.define
class Row:
    """One line of the results table."""

    benchmark: str
    result: str
    ceiling: str = "—"
    ratio: str = "—"
    target: str = "—"
    ok: bool | None = None


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


class Runner:
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
        if "saga" in self.selected:  # sagas (#13): saga steps/s vs plain handlers with the inbox on
            self._external(
                "saga",
                "benchmarks.saga_bench",
                lambda m: m.run(url, messages=s.messages // 4, repeats=self.repeats, sql=True),
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

    # -- summarising --------------------------------------------------------------------------------------

    def _stats(self, key: str, field: str) -> dict[str, Any] | None:
        runs = [t[field] for t in self.trials.get(key, []) if t.get(field) is not None]
        return stats(runs) if runs else None

    def paired(
        self,
        key: str,
        field: str,
        base: str = "raw:xack",
        base_field: str = "drain_msgs_per_s",
    ) -> dict[str, Any] | None:
        """Per-round ratios of ``key``'s ``field`` to ``base``'s, measured back to back in one round."""
        bases = {t["round"]: t[base_field] for t in self.trials.get(base, []) if t.get("round") is not None}
        ratios = [t[field] / bases[t["round"]] for t in self.trials.get(key, []) if t.get("round") in bases]
        return stats(ratios) if ratios else None

    def summary(self) -> dict[str, dict[str, Any]]:
        """Medians (with min, max and runs) of every figure, by benchmark; ``ratio_to_raw`` is paired by round."""
        out: dict[str, dict[str, Any]] = {}
        fields = {
            "raw:xack": ("drain_msgs_per_s", "fill_msgs_per_s"),
            "raw:xdel": ("drain_msgs_per_s",),
            "commands:on": ("msgs_per_s", "publish_msgs_per_s", "peak_rss_mib"),
            "commands:off": ("msgs_per_s", "publish_msgs_per_s", "peak_rss_mib"),
            "events:3": ("events_per_s", "deliveries_per_s", "publish_msgs_per_s"),
            "latency:raw": ("p50_ms", "p90_ms", "p99_ms", "max_ms", "achieved_rate"),
            "latency:framework": ("p50_ms", "p90_ms", "p99_ms", "max_ms", "achieved_rate"),
            "latency:framework-noinbox": ("p50_ms", "p90_ms", "p99_ms", "max_ms", "achieved_rate"),
            "memory:small": ("peak_rss_mib", "msgs_per_s", "server_inbox_mib", "inbox_bytes_per_id"),
            "recovery": (
                "normal_msgs_per_s",
                "restart_msgs_per_s",
                "claim_msgs_per_s",
                "restart_ratio",
                "claim_ratio",
            ),
            "memory:big": (
                "peak_rss_mib",
                "first_half_rss_mib",
                "second_half_rss_mib",
                "msgs_per_s",
                "server_inbox_mib",
                "inbox_bytes_per_id",
            ),
        }
        for t, kind, w in (
            (t, k, w) for t in SQL_WORK_MS for k in (*SQL_FRAMEWORK_KINDS, "plain") for w in SQL_WORKERS
        ):
            fields[f"{_sql_key(t)}:{kind}:{w}"] = (
                "msgs_per_s",
                "cpu_ms_per_msg",
                "p50_ms",
                "p90_ms",
                "p99_ms",
                "max_ms",
                "achieved_rate",
            )
        for key, names in fields.items():
            figures = {n: st for n in names if (st := self._stats(key, n)) is not None}
            if figures:
                out[key] = figures
        for key, field in (
            ("raw:xdel", "drain_msgs_per_s"),
            ("commands:on", "msgs_per_s"),
            ("commands:off", "msgs_per_s"),
            ("events:3", "deliveries_per_s"),
        ):
            if key in out and (pr := self.paired(key, field)) is not None:
                out[key]["ratio_to_raw"] = pr
        for p, w, kind in ((_sql_key(t), w, k) for t in SQL_WORK_MS for w in SQL_WORKERS for k in SQL_FRAMEWORK_KINDS):
            key, plain = f"{p}:{kind}:{w}", f"{p}:plain:{w}"
            if key in out and (pr := self.paired(key, "msgs_per_s", plain, "msgs_per_s")) is not None:
                out[key]["ratio_to_plain"] = pr
            if key in out and (pr := self.paired(key, "cpu_ms_per_msg", plain, "cpu_ms_per_msg")) is not None:
                out[key]["cpu_ratio_to_plain"] = pr
        on, off = self.trials.get("commands:on", []), {t["round"]: t for t in self.trials.get("commands:off", [])}
        costs = [1 - t["msgs_per_s"] / off[t["round"]]["msgs_per_s"] for t in on if t.get("round") in off]
        if costs:
            out["inbox_cost"] = {"paired": stats(costs)}
        lat_off = {t["round"]: t for t in self.trials.get("latency:framework-noinbox", [])}
        lat_on = self.trials.get("latency:framework", [])
        added = [t["p50_ms"] - lat_off[t["round"]]["p50_ms"] for t in lat_on if t.get("round") in lat_off]
        if added:
            out["latency_inbox_p50_added_ms"] = {"paired": stats(added)}
        out.update(tracing_bench.summary(self.trials))
        out.update(faststream_bench.summary(self.trials))
        return out

    def rows(self) -> list[Row]:
        """The table: result, raw ceiling, ratio and target per benchmark."""
        sm = self.summary()
        rows: list[Row] = []
        ceiling = sm.get("raw:xack", {}).get("drain_msgs_per_s")
        ceil_text = f"{ceiling['median']:,.0f} msg/s" if ceiling else "—"

        def ratio(value: float, key: str | None = None) -> tuple[str, float | None]:
            """Paired by round when ``key`` has per-round ratios, else the ratio of the medians."""
            paired = sm.get(key, {}).get("ratio_to_raw") if key else None
            if paired:
                r = paired["median"]
                spread = f"\n[dim]{paired['min']:.0%}-{paired['max']:.0%}[/dim]" if len(paired["runs"]) > 1 else ""
                return f"{r:.0%}{spread}", r
            if not ceiling:
                return "—", None
            r = value / ceiling["median"]
            return f"{r:.0%}", r

        def not_run(name: str, label: str) -> bool:
            if name in self.errors:
                rows.append(Row(label, f"[yellow]{self.errors[name]}[/yellow]"))
                return True
            return name not in self.selected

        if not not_run("raw", "raw redis-py ceiling") and ceiling:
            rows.append(Row("raw redis-py: XREADGROUP 500 + XACK per batch (the ceiling)", _rate(ceiling)))
            if xdel := sm.get("raw:xdel", {}).get("drain_msgs_per_s"):
                rows.append(
                    Row(
                        "raw redis-py: XREADGROUP 500 + XACK + XDEL per batch",
                        _rate(xdel),
                        ceil_text,
                        ratio(xdel["median"], "raw:xdel")[0],
                    )
                )
        if not not_run("commands", "commands, one worker"):
            for key, label in (
                ("commands:on", "commands → one worker, inbox on (default)"),
                ("commands:off", "commands → one worker, inbox off"),
            ):
                if st := sm.get(key, {}).get("msgs_per_s"):
                    text, r = ratio(st["median"], key)
                    rows.append(
                        Row(
                            label,
                            _rate(st),
                            ceil_text,
                            text,
                            f"≥ {THROUGHPUT_TARGET:.0%} of raw",
                            None if r is None else r >= THROUGHPUT_TARGET,
                        )
                    )
            if cost := sm.get("inbox_cost", {}).get("paired"):
                spread = f"\n[dim]{cost['min']:.0%}-{cost['max']:.0%}[/dim]" if len(cost["runs"]) > 1 else ""
                rows.append(
                    Row(
                        "inbox cost: 1 - (inbox on / inbox off), paired by round",
                        f"{cost['median']:.0%} of throughput{spread}",
                        target=f"< {INBOX_COST_TARGET:.0%}",
                        ok=cost["median"] < INBOX_COST_TARGET,
                    )
                )
            if pub := sm.get("commands:on", {}).get("publish_msgs_per_s"):
                fill = sm.get("raw:xack", {}).get("fill_msgs_per_s")
                rows.append(
                    Row(
                        "publish: Client.send_many, 5,000 per call",
                        _rate(pub),
                        f"{fill['median']:,.0f} msg/s\n[dim]pipelined XADD[/dim]" if fill else "—",
                        f"{pub['median'] / fill['median']:.0%}" if fill else "—",
                    )
                )
        if not not_run("events", "events, three groups") and (ev := sm.get("events:3")):
            text, r = ratio(ev["deliveries_per_s"]["median"], "events:3")
            rows.append(
                Row(
                    "events → 3 groups (3 services), one worker",
                    f"{_rate(ev['events_per_s'], 'events/s')}\n= {ev['deliveries_per_s']['median']:,.0f} deliveries/s",
                    ceil_text,
                    text + " [dim](deliveries)[/dim]",
                    f"≥ {THROUGHPUT_TARGET:.0%} of raw",
                    None if r is None else r >= THROUGHPUT_TARGET,
                )
            )
        if not not_run("latency", "latency") and (fw := sm.get("latency:framework")):
            raw = sm.get("latency:raw")
            rate = f"{self.sizes.latency_rate:,.0f}/s"
            rows.append(
                Row(
                    f"latency publish → handler start @ {rate}, p50 / p99 ms",
                    f"p50 {_ms(fw['p50_ms'])}\np99 {_ms(fw['p99_ms'])}\n[dim]p90 {fw['p90_ms']['median']:.2f}, "
                    f"max {fw['max_ms']['median']:.2f}[/dim]",
                    f"p50 {raw['p50_ms']['median']:.2f}\np99 {raw['p99_ms']['median']:.2f}" if raw else "—",
                    f"p99 {fw['p99_ms']['median'] / raw['p99_ms']['median']:.1f}x" if raw else "—",
                    f"p99 < {LATENCY_P99_TARGET_MS:g} ms",
                    fw["p99_ms"]["median"] < LATENCY_P99_TARGET_MS,
                )
            )
            if fo := sm.get("latency:framework-noinbox"):
                rows.append(
                    Row(
                        f"latency publish → handler start @ {rate}, inbox off, p50 / p99 ms",
                        f"p50 {_ms(fo['p50_ms'])}\np99 {_ms(fo['p99_ms'])}\n[dim]p90 {fo['p90_ms']['median']:.2f}, "
                        f"max {fo['max_ms']['median']:.2f}[/dim]",
                        f"p50 {raw['p50_ms']['median']:.2f}\np99 {raw['p99_ms']['median']:.2f}" if raw else "—",
                        f"p99 {fo['p99_ms']['median'] / raw['p99_ms']['median']:.1f}x" if raw else "—",
                        "reported",
                    )
                )
            if added := sm.get("latency_inbox_p50_added_ms", {}).get("paired"):
                rows.append(
                    Row(
                        "latency: p50 inbox on - inbox off, paired by round",
                        f"{added['median']:+.2f} ms"
                        + (f" [dim]({added['min']:+.2f}-{added['max']:+.2f})[/dim]" if len(added["runs"]) > 1 else ""),
                        target=f"≤ {LATENCY_P50_INBOX_MS:g} ms (#33)",
                        ok=added["median"] <= LATENCY_P50_INBOX_MS,
                    )
                )
        if "peer" in self.selected:
            rows += [Row(**row) for row in faststream_bench.rows(sm, self.errors, self.sizes.latency_rate)]
        if "observability" in self.selected:
            rows += [Row(**row) for row in tracing_bench.rows(sm, self.errors, self.sizes.latency_rate)]
        if not not_run("memory", "memory") and (big := sm.get("memory:big")) and (small := sm.get("memory:small")):
            growth = big["peak_rss_mib"]["median"] / small["peak_rss_mib"]["median"]
            rows.append(
                Row(
                    f"worker peak RSS, {self.sizes.memory_backlog:,} vs {self.sizes.memory_small:,} backlog",
                    f"{big['peak_rss_mib']['median']:.1f} MiB vs {small['peak_rss_mib']['median']:.1f} MiB",
                    "—",
                    f"{growth:.2f}x",
                    f"flat (≤ {MEMORY_FLAT_TARGET:.2f}x)",
                    growth <= MEMORY_FLAT_TARGET,
                )
            )
            first, second = big["first_half_rss_mib"]["median"], big["second_half_rss_mib"]["median"]
            rows.append(
                Row(
                    f"worker peak RSS over the {self.sizes.memory_backlog:,} drain, second half vs first half",
                    f"{second:.1f} MiB vs {first:.1f} MiB",
                    "—",
                    f"{second / first:.2f}x" if first else "—",
                    f"flat (≤ {MEMORY_FLAT_TARGET:.2f}x)",
                    bool(first) and second / first <= MEMORY_FLAT_TARGET,
                )
            )
            if "inbox_bytes_per_id" in big:
                per_id = big["inbox_bytes_per_id"]["median"]
                rows.append(
                    Row(
                        f"inbox server memory per remembered id, {self.sizes.memory_backlog:,} ids",
                        f"{per_id:.1f} B ({big['server_inbox_mib']['median']:.1f} MiB)",
                        "—",
                        "—",
                        f"≤ {INBOX_BYTES_TARGET} B",
                        per_id <= INBOX_BYTES_TARGET,
                    )
                )
            text, _ = ratio(big["msgs_per_s"]["median"])
            rows.append(
                Row(
                    f"commands → one worker, {self.sizes.memory_backlog:,} backlog (single run)",
                    _rate(big["msgs_per_s"]),
                    ceil_text,
                    text,
                )
            )
        if not not_run("recovery", "recovery after SIGKILL") and (rc := sm.get("recovery")):
            for which, label in (
                ("restart", "recovery after SIGKILL: restarted worker re-reads its own pending"),
                ("claim", "recovery after SIGKILL: another worker claims the killed one's entries"),
            ):
                rt = rc[f"{which}_ratio"]
                spread = f"\n[dim]{rt['min']:.0%}-{rt['max']:.0%}[/dim]" if len(rt["runs"]) > 1 else ""
                rows.append(
                    Row(
                        label,
                        _rate(rc[f"{which}_msgs_per_s"]),
                        f"{rc['normal_msgs_per_s']['median']:,.0f} msg/s\n[dim]normal drain, same run[/dim]",
                        f"{rt['median']:.0%}{spread}",
                    )
                )
        if not not_run("sql", "SQL effects"):
            rows += self._sql_rows(sm)
        if not not_run("outbox", "outbox relay") and (ob := self.trials.get("outbox")):
            rows.append(self._external_row("outbox relay", ob[0], self._outbox_row))
        if not not_run("spark", "spark bridge") and (sp := self.trials.get("spark")):
            rows.append(self._external_row("spark bridge", sp[0], self._spark_row))
        if not not_run("ownership", "partition ownership") and (ow := self.trials.get("ownership")):
            for w in sorted(int(k) for k in ow[0].get("cost", {})):
                rows.append(self._external_row("partition ownership", ow[0], functools.partial(_ownership_row, w)))
        if not not_run("cluster", "redis cluster") and (cl := self.trials.get("cluster")):
            for w in sorted(int(k) for k in cl[0].get("ratio", {})):
                rows.append(self._external_row("redis cluster", cl[0], functools.partial(_cluster_row, w)))
        if not not_run("schedule", "scheduled messages") and (sc := self.trials.get("schedule")):
            rows.append(self._external_row("scheduled messages", sc[0], _schedule_row))
        if not not_run("saga", "sagas") and (sg := self.trials.get("saga")):
            rows.append(self._external_row("sagas", sg[0], _saga_row))
            if "saga_sql" in sg[0].get("medians", {}):
                rows.append(self._external_row("sagas", sg[0], _saga_sql_row))
        return rows

    def _sql_rows(self, sm: dict[str, dict[str, Any]]) -> list[Row]:
        """Framework vs plain consumer at 2 and 0 ms of work: drain rate and client CPU per message (paired
        ratios), latency."""
        rows: list[Row] = []
        for work, w in ((work, w) for work in SQL_WORK_MS for w in SQL_WORKERS):
            for kind in SQL_FRAMEWORK_KINDS:
                fw, plain = sm.get(f"{_sql_key(work)}:{kind}:{w}", {}), sm.get(f"{_sql_key(work)}:plain:{w}", {})
                if "msgs_per_s" in fw and "msgs_per_s" in plain:
                    rows += self._sql_pair_rows(fw, plain, work, w, SQL_FRAMEWORK_KINDS[kind])
        w = max(SQL_WORKERS)
        fw, plain = sm.get(f"sql:framework:{w}", {}), sm.get(f"sql:plain:{w}", {})
        if "p99_ms" in fw and "p99_ms" in plain:
            added = fw["p99_ms"]["median"] - plain["p99_ms"]["median"]
            rows.append(
                Row(
                    f"SQL effects: publish → commit @ {self.sizes.sql_latency_rate:g}/s, {w} workers, "
                    "p50 / p99 ms (incl. 2 ms work)",
                    f"p50 {_ms(fw['p50_ms'])}\np99 {_ms(fw['p99_ms'])}\n[dim]offered "
                    f"{fw['achieved_rate']['median']:,.0f}/s[/dim]",
                    f"p50 {plain['p50_ms']['median']:.2f}\np99 {plain['p99_ms']['median']:.2f}"
                    "\n[dim]plain consumer[/dim]",
                    f"p99 {added:+.1f} ms",
                    "p99 added: stated",
                )
            )
        return rows

    def _sql_pair_rows(self, fw: dict[str, Any], plain: dict[str, Any], work: float, w: int, inbox: str) -> list[Row]:
        """Drain rate and client CPU per message of one framework kind against the plain consumer."""
        label = "worker" if w == 1 else "workers"
        ratios = []
        for field, paired in (("msgs_per_s", "ratio_to_plain"), ("cpu_ms_per_msg", "cpu_ratio_to_plain")):
            pr = fw.get(paired)
            r = pr["median"] if pr else fw[field]["median"] / (plain[field]["median"] or float("nan"))
            spread = f"\n[dim]{pr['min']:.2f}-{pr['max']:.2f}x[/dim]" if pr and len(pr["runs"]) > 1 else ""
            ratios.append((r, f"{r:.2f}x{spread}"))
        (rate_r, rate_text), (cpu_r, cpu_text) = ratios
        fc, pc = fw["cpu_ms_per_msg"], plain["cpu_ms_per_msg"]
        if work:
            cpu_target, cpu_ok = f"≤ {SQL_CPU_TARGET_MS:g} ms", fc["median"] <= SQL_CPU_TARGET_MS
        else:
            cpu_target, cpu_ok = f"≤ {SQL_CPU0_RATIO_TARGET:.1f}x plain", cpu_r <= SQL_CPU0_RATIO_TARGET
        return [
            Row(
                f"SQL effects: {w} {label}, {work:g} ms work + 1 row in ctx.sql_transaction, {inbox}, "
                f"{self.sizes.sql_messages:,} backlog",
                _rate(fw["msgs_per_s"]),
                f"{_rate(plain['msgs_per_s'])}\n[dim]plain redis-py + psycopg batch consumer[/dim]",
                rate_text,
                f"≥ {SQL_RATIO_TARGET:.1f}x plain" if work else "stated",
                rate_r >= SQL_RATIO_TARGET if work else None,
            ),
            Row(
                f"SQL effects: client CPU per message, {w} {label}, {work:g} ms work, {inbox} "
                "(utime+stime of the workers)",
                f"{_ms(fc)} ms",
                f"{_ms(pc)} ms\n[dim]plain consumer[/dim]",
                cpu_text,
                cpu_target,
                cpu_ok,
            ),
        ]

    @staticmethod
    def _external_row(label: str, result: dict[str, Any], build: Callable[[dict[str, Any]], Row]) -> Row:
        try:
            return build(result)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            return Row(
                label,
                f"[yellow]ran, but its result has an unexpected shape ({type(exc).__name__}: {exc}); "
                "see --json[/yellow]",
            )

    @staticmethod
    def _outbox_row(o: dict[str, Any]) -> Row:
        st = stats(o["relay_runs"])
        return Row(
            f"outbox relay {o.get('database', 'PostgreSQL')} → broker, one relay",
            _rate(st),
            target=f"≥ {OUTBOX_TARGET:,} msg/s",
            ok=st["median"] >= OUTBOX_TARGET,
        )

    @staticmethod
    def _spark_row(o: dict[str, Any]) -> Row:
        runs = o.get("runs", {})
        st = stats(runs["broker"]) if runs.get("broker") else {"median": o["broker_rows_per_s"], "runs": [1]}
        return Row(
            "spark: broker → Parquet (eventlog source)",
            _rate(st, "rows/s"),
            f"{o['ceiling_rows_per_s']:,.0f} rows/s\n[dim]in-memory Arrow source[/dim]",
            f"{o['ratio']:.0%}",
            target=f"≥ {SPARK_RATIO_TARGET:.0%} of ceiling",
            ok=o["ratio"] >= SPARK_RATIO_TARGET,
        )

    def load_by_benchmark(self) -> dict[str, dict[str, float]]:
        """Per benchmark: median load average and share of CPU other processes used during its trials."""
        out: dict[str, dict[str, float]] = {}
        for key, trials in self.trials.items():
            marks = [t["machine"] for t in trials if "machine" in t]
            if marks:
                out[key] = {
                    "load": statistics.median(m["load_median"] for m in marks),
                    "others_pct": statistics.median(m["cpu_others_pct"] for m in marks),
                    "steal_pct": statistics.median(m["cpu_steal_pct"] for m in marks),
                }
        return out


OWNERSHIP_COST_TARGET = 0.10  # 1 worker with leases vs the unowned read


def _ownership_row(workers: int, o: dict[str, Any]) -> Row:
    owned, off, cost = o["medians"][f"partitioned:{workers}"], o["medians"][f"off:{workers}"], o["cost"][str(workers)]
    return Row(
        f"ownership: 8 partitions, inbox on, {workers} worker(s), leases + fencing ({o['cores']} cores)",
        f"{owned:,.0f} msg/s",
        f"{off:,.0f} msg/s\n[dim]unowned read, same run[/dim]",
        f"cost {cost:.0%}",
        target=f"cost < {OWNERSHIP_COST_TARGET:.0%}" if workers == 1 else "—",
        ok=cost < OWNERSHIP_COST_TARGET if workers == 1 else None,
    )


def _schedule_row(o: dict[str, Any]) -> Row:
    return Row(
        f"schedule: {o['messages']:,} messages due over {o['spread_s']:g} s, one worker's mover",
        f"lateness p50 {o['p50_ms']:,.0f} ms, p99 {o['p99_ms']:,.0f} ms",
        f"mover {o['mover_per_s']:,.0f} msg/s\n[dim]backlog due at one instant[/dim]",
        target="p99 < 1,000 ms",
        ok=o["p99_ms"] < 1000,
    )


def _saga_row(o: dict[str, Any]) -> Row:
    m, cost = o["medians"], o["cost"]
    return Row(
        f"saga: {o['messages']:,} steps over {o['sagas']:,} instances, one worker ({o['cores']} cores)",
        f"{m['saga_step']:,.0f} steps/s\n[dim]via a topic (2 hops): {m['saga_event']:,.0f}/s[/dim]"
        + (f"\n[dim]each step a new instance: {m['saga_new']:,.0f}/s[/dim]" if "saga_new" in m else ""),
        f"{m['plain']:,.0f} msg/s plain, inbox on\n[dim]{m['plain_tx']:,.0f}/s with redis_transaction[/dim]",
        f"cost {cost['saga_step']:.1f}x plain\n[dim]{m['plain_tx'] / m['saga_step']:.1f}x redis_transaction[/dim]"
        + (f"\n[dim]new instances: {cost['saga_new']:.1f}x plain[/dim]" if "saga_new" in cost else ""),
        target="< 2x plain",
        ok=cost["saga_step"] < 2,
    )


def _saga_sql_row(o: dict[str, Any]) -> Row:
    m, cost = o["medians"], o["cost"]
    return Row(
        f"saga, state in PostgreSQL: {o['messages']:,} steps over {o['sagas']:,} instances, one worker",
        f"{m['saga_sql']:,.0f} steps/s",
        f"{m['sql_tx']:,.0f} msg/s\n[dim]ctx.sql_transaction handler, one upsert[/dim]",
        f"cost {cost['saga_sql']:.1f}x the SQL handler",
        target="(reported)",
        ok=None,
    )


def _cluster_row(workers: int, o: dict[str, Any]) -> Row:
    on_cluster, single = o["medians"][f"cluster:{workers}"], o["medians"][f"single:{workers}"]
    return Row(
        f"cluster: 8 partitions, inbox on, {workers} worker(s), {o['nodes']}-node local cluster ({o['cores']} cores)",
        f"{on_cluster:,.0f} msg/s",
        f"{single:,.0f} msg/s\n[dim]one server, same run[/dim]",
        f"{o['ratio'][str(workers)]:.2f}",
    )


def _table(rows: Sequence[Row], title: str) -> Table:
    table = Table(title=title, show_lines=True)
    for col, justify in (
        ("benchmark", "left"),
        ("result (median, min-max)", "right"),
        ("raw ceiling", "right"),
        ("ratio", "right"),
        ("target", "left"),
        ("", "left"),
    ):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for r in rows:
        table.add_row(r.benchmark, r.result, r.ceiling, r.ratio, r.target, _verdict(r.ok))
    return table


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
