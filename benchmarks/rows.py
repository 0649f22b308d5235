"""Rows of the results table: formatting of figures, the row type, the rows of single benchmarks and the SQL
benchmark's rows (mixed into :class:`benchmarks.report.Report`)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import attrs
from rich.table import Table

__all__ = ["Row", "SqlRows", "sql_kinds", "stats"]

SQL_FRAMEWORK_KINDS = {  # the framework kinds the sql benchmark runs, and how their rows name them
    "framework": "Redis + SQL inbox (default)",
    "framework-sqlinbox": 'inbox="sql"',
}
SQL_BATCH_KINDS = {  # run at 0 ms of work only: the framework's own cost on the plain consumer's shape of work
    "framework-batch": "batch handler (BatchPolicy(max_size=100), one executemany), Redis + SQL inbox",
}
SQL_WORKERS = (1, 3)
SQL_WORK_MS = (2.0, 0.0)  # work per message; the trials at 0 ms are keyed "sql:0ms:<kind>:<workers>"
SQL_RATIO_TARGET = 2.0  # framework msg/s over the plain redis-py + psycopg consumer's, same worker count (#33)
SQL_CPU_TARGET_MS = 0.3  # client CPU per message, framework workers
SQL_CPU0_RATIO_TARGET = 1.0  # 0 ms of work: framework client CPU per message over the plain consumer's (#33)


# -- statistics and formatting ------------------------------------------------------------------------------


def stats(values: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and every value."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": list(values)}


def _rate(s: dict[str, Any], unit: str = "msg/s") -> str:
    spread = f"\n[dim]{s['min']:,.0f}-{s['max']:,.0f}[/dim]" if len(s["runs"]) > 1 else ""
    return f"{s['median']:,.0f} {unit}{spread}"


def _ms(s: dict[str, Any]) -> str:
    return f"{s['median']:.2f}" + (f" [dim]({s['min']:.2f}-{s['max']:.2f})[/dim]" if len(s["runs"]) > 1 else "")


def sql_kinds(work_ms: float) -> dict[str, str]:
    """The framework kinds the sql benchmark runs at ``work_ms`` of work, and how their rows name them."""
    return SQL_FRAMEWORK_KINDS if work_ms else {**SQL_FRAMEWORK_KINDS, **SQL_BATCH_KINDS}


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


class SqlRows:
    """The sql benchmark's rows: framework kinds against the plain consumer."""

    sizes: Any
    paired: Callable[..., dict[str, Any] | None]

    def _sql_rows(self, sm: dict[str, dict[str, Any]]) -> list[Row]:
        """Framework vs plain consumer at 2 and 0 ms of work: drain rate and client CPU per message (paired
        ratios), latency."""
        rows: list[Row] = []
        for work, w in ((work, w) for work in SQL_WORK_MS for w in SQL_WORKERS):
            for kind, name in sql_kinds(work).items():
                fw, plain = sm.get(f"{_sql_key(work)}:{kind}:{w}", {}), sm.get(f"{_sql_key(work)}:plain:{w}", {})
                if "msgs_per_s" in fw and "msgs_per_s" in plain:
                    rows += self._sql_pair_rows(fw, plain, work, w, name)
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


WORKERS_RATIO_TARGET = 0.95  # `--workers 2` over two separate processes: the supervisor costs nothing per message


def _workers_row(o: dict[str, Any]) -> Row:
    m, ratio = o["medians"], o["ratio"]
    return Row(
        f"workers: framework run --workers 2, 4 partitions owned, inbox on ({o['cores']} cores)",
        f"{m['supervisor']:,.0f} msg/s",
        f"{m['separate']:,.0f} msg/s\n[dim]2 separate processes, same run[/dim]",
        f"{ratio:.2f}",
        target=f"ratio >= {WORKERS_RATIO_TARGET:.2f}",
        ok=ratio >= WORKERS_RATIO_TARGET,
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


def _reply_row(o: dict[str, Any]) -> Row:
    fw, raw = o["medians"]["framework"], o["medians"]["raw"]
    return Row(
        f"request/reply: {o['requests']:,} round trips, one worker, one at a time (and {o['concurrent']} in flight)",
        f"{fw['per_s']:,.0f} round trips/s, p50 {fw['p50_ms']:.2f} ms, p99 {fw['p99_ms']:.2f} ms"
        f"\n[dim]{o['concurrent']} in flight: {fw['concurrent_per_s']:,.0f}/s[/dim]",
        f"{raw['per_s']:,.0f}/s raw redis-py, p99 {raw['p99_ms']:.2f} ms"
        f"\n[dim]{o['concurrent']} in flight: {raw['concurrent_per_s']:,.0f}/s[/dim]",
        f"raw {o['ratio']:.1f}x\n[dim]in flight: {o['concurrent_ratio']:.1f}x[/dim]",
        target="(reported)",
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


def _rabbitmq_row(m: dict[str, float]) -> Row:
    """The RabbitMQ transport (#34): one worker's drain against raw aio-pika (acks per message) and FastStream."""
    raw, fw, fs = m["consume raw"], m["consume framework"], m.get("consume faststream")
    return Row(
        "RabbitMQ: one worker drains a quorum queue (per-message handler)",
        f"{fw:,.0f} msg/s\n[dim]publish {m['publish framework']:,.0f}/s with confirms[/dim]",
        f"raw aio-pika {raw:,.0f} msg/s\n[dim]batched acks {m.get('consume raw-batched', 0):,.0f}[/dim]",
        f"{fw / raw:.2f}x raw" + (f"\n{fw / fs:.1f}x FastStream" if fs else ""),
        "≥ 0.5x raw, ahead of FastStream (#34)",
        fw / raw >= 0.5 and (fs is None or fw > fs),
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
