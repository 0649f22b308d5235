"""What the demo shows: the live progress table, the recovery report, the ledger, the Spark tables."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from example_services.demo.ledger import Check
from framework.faults import COUNTERS, Fault, Recovery

SERVICES = ("orders", "billing", "inventory", "shipping", "notifications")


def progress_view(
    n: int, accepted: int, snap: dict[str, int], counters: dict[str, dict[str, int]], rate: float, events: list[str]
) -> Group:
    """The live view: orders by state, throughput, lag, and each service's counters."""
    final = sum(snap.get(s, 0) for s in ("shipped", "declined", "cancelled"))
    head = Text.assemble(
        ("orders ", "bold"),
        f"placed {accepted}/{n}   ",
        ("final ", "bold"),
        f"{final} (shipped {snap.get('shipped', 0)}, declined {snap.get('declined', 0)}, "
        f"cancelled {snap.get('cancelled', 0)})   ",
        ("throughput ", "bold"),
        f"{rate:.0f} orders/s   ",
        ("lag ", "bold"),
        f"{accepted - final} orders in flight, {snap.get('outbox', 0)} in the outbox",
    )
    table = Table(box=None, pad_edge=False)
    table.add_column("service")
    for c in COUNTERS[:4]:
        table.add_column(c.replace("_", "-"), justify="right")
    for s in SERVICES:
        got = counters.get(s, {})
        table.add_row(s, *(str(got.get(c, 0)) for c in COUNTERS[:4]))
    return Group(head, table, *(Text(e, style="yellow") for e in events[-4:]))


def plain_line(accepted: int, snap: dict[str, int], counters: dict[str, dict[str, int]]) -> str:
    """One line of progress for a log (CI, no terminal)."""
    final = sum(snap.get(s, 0) for s in ("shipped", "declined", "cancelled"))
    per = ", ".join(f"{s} {counters.get(s, {}).get('processed', 0)}" for s in SERVICES)
    return f"placed {accepted}, final {final}, outbox {snap.get('outbox', 0)}; processed: {per}"


def recovery_table(faults: list[Fault], by_worker: dict[str, Recovery], counters: dict[str, dict[str, int]]) -> Table:
    """What the framework did about each fault, from the workers' logs and counters."""
    table = Table(title="what the framework did (from the workers' logs and /metrics)", title_justify="left")
    table.add_column("worker")
    for col in ("took over", "claimed", "leases lost", "partitions acquired"):
        table.add_column(col, justify="right")
    faulted = {f.worker for f in faults}
    for worker, r in sorted(by_worker.items()):
        if worker in faulted or worker.startswith(("billing", "inventory")) or r.taken_over or r.leases_lost:
            table.add_row(worker, str(r.taken_over), str(r.claimed), str(r.leases_lost), str(r.leases_acquired))
    for f in faults:
        what = "SIGKILL" if f.kind == "SIGKILL" else f"SIGSTOP for {f.seconds:g} s"
        table.caption = (table.caption or "") + f"{f.worker}: {what}.  "
    totals = {c: sum(v.get(c, 0) for v in counters.values()) for c in COUNTERS}
    table.caption = (table.caption or "") + (
        f"\nretried {totals['retried']}, dead-lettered {totals['dead_lettered']}, "
        f"duplicates dropped by the inboxes {totals['duplicates']}"
    )
    return table


def ledger_table(checks: list[Check]) -> Table:
    table = Table(title="ledger", title_justify="left")
    table.add_column("check")
    table.add_column("value", justify="right")
    table.add_column("ok")
    for c in checks:
        table.add_row(c.name, c.value, "[green]yes[/]" if c.ok else "[red]NO[/]")
    return table


def outcome_table(figures: dict[str, Any], accepted: int) -> Table:
    table = Table(title=f"{accepted} orders", title_justify="left")
    table.add_column("outcome")
    table.add_column("orders", justify="right")
    table.add_row("shipped", str(figures["shipped"]))
    for reason, n in sorted(figures["reasons"].items()):
        table.add_row(f"not shipped: {reason}", str(n))
    table.add_row(
        "charged / refunded", f"{figures['charged_cents'] / 100:,.2f} / {figures['refunded_cents'] / 100:,.2f}"
    )
    return table


def spark_tables(tables: dict[str, list[dict[str, Any]]]) -> list[Table]:
    found = []
    for name, rows in tables.items():
        table = Table(title=f"Spark: {name.replace('_', ' ')}", title_justify="left")
        if rows:
            for col in rows[0]:
                table.add_column(col, justify="right")
            for row in rows[:12]:
                table.add_row(*(str(v) for v in row.values()))
        found.append(table)
    return found
