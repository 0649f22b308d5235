"""``framework status [DESTINATION ...]``: destinations, partitions, groups, depth, pending and lag.

``workers`` counts each group's live workers from their heartbeats (``--json``: ``live_workers``,
and ``workers`` with each one's last-seen time; a stopped worker is listed as gone, not counted).
``scheduled`` counts a destination's messages sent with a delay or a due time and not yet due
(``framework schedule list`` shows them).

A table on a terminal, ``--json`` for scripts; the figures come from the transport's introspection
(:meth:`~broker.introspection.Introspection.describe`).
The ``inbox`` column is the server memory a group's Redis inbox needs over its whole dedup window
at its recent rate (bytes per id, shown beside it, x ids per second x window); a footer line names every group past
the budget (``--inbox-budget``, default ``$FRAMEWORK_INBOX_MEMORY_BUDGET``, else 256 MiB).

Destinations whose partitions are owned (docs/partition-ownership.md) get a second table, one row per
partition and group: the owning instance, how long it has held the lease, the fencing token, and
the partition's pending and lag (``--json``: ``per_partition[].groups[].lease``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import anyio

from broker import connect
from broker.introspection import DestinationState
from framework.cli.common import UsageError, connection_options, print_json
from framework.cli.hints import namespace_hint
from framework.operations.overview import Overview, load_overview
from framework.settings import inbox_memory_budget, parse_bytes

__all__ = ["over_budget", "register"]


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def over_budget(states: list[DestinationState], budget: int) -> list[str]:
    """One warning line per group whose inbox needs more than ``budget`` bytes over its window."""
    lines = []
    for s in states:
        for g in s.to_json()["groups"]:
            if g["inbox_bytes"] > budget:
                lines.append(
                    f"warning: the inbox of group {g['group']!r} on {s.spec.name!r} needs about "
                    f"{_mib(g['inbox_bytes'])} of server memory ({g['inbox_ids_per_s']:,.1f} ids/s x "
                    f"{g['inbox_window_s'] / 3600:,.1f} h window), more than the {_mib(budget)} budget: "
                    "shorten the inbox window or raise the budget (docs/idempotency.md)"
                )
    return lines


def show_status(args: argparse.Namespace) -> int:
    """Print the state of every declared destination (or of those named)."""

    async def collect() -> tuple[Overview, str]:
        broker = await connect(args.redis_url, namespace=args.namespace)
        try:
            overview = await load_overview(broker, args.destinations or None)
            return overview, ("" if overview.states else await namespace_hint(broker))
        finally:
            await broker.close()

    try:
        budget = parse_bytes(args.inbox_budget) if args.inbox_budget else inbox_memory_budget()
        overview, empty = anyio.run(collect)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    states = overview.states
    warnings = over_budget(states, budget)
    if args.json:
        print_json(overview.destinations_json())
        for line in [*warnings, empty] if empty else warnings:
            print(line, file=sys.stderr)
        return 0
    from rich.console import Console

    console = Console() if sys.stdout.isatty() else Console(width=160)
    if not states:
        console.print(empty, markup=False, highlight=False)
    else:
        console.print(_table(overview, args.namespace or os.environ.get("FRAMEWORK_NAMESPACE") or "fw"))
        owners = _owners_table(states)
        if owners is not None:
            console.print(owners)
        for line in warnings:
            console.print(line, markup=False, highlight=False)
    return 0


def _table(overview: Overview, namespace: str) -> Any:
    """One row per destination and group; a destination's own columns only on its first row.

    ``workers`` counts the group's live workers (heartbeats; ``status --json`` lists each with its
    last-seen time), not every consumer name the server ever saw."""
    from rich.table import Table

    table = Table(title=f"destinations (namespace {namespace})")
    cols = (
        "destination",
        "kind",
        "parts",
        "depth",
        "scheduled",
        "group",
        "workers",
        "pending",
        "lag",
        "delayed",
        "dlq",
        "inbox",
    )
    for col in cols:
        table.add_column(col, justify="right" if col not in ("destination", "kind", "group") else "left")
    for s, data in zip(overview.states, overview.destinations_json(), strict=True):
        groups = data["groups"] or [None]
        for i, g in enumerate(groups):
            head = (
                [
                    s.spec.name,
                    "queue" if s.spec.kind == "command" else "topic",
                    str(s.spec.partitions),
                    str(s.depth),
                    str(s.scheduled),
                ]
                if i == 0
                else ["", "", "", "", ""]
            )
            tail = (
                [
                    g["group"],
                    str(g["live_workers"]),
                    str(g["pending"]),
                    str(g["lag"]),
                    str(g["delayed"]),
                    str(g["dead_letters"]),
                    f"{_mib(g['inbox_bytes'])} ({g['inbox_bytes_per_id']:.0f} B/id)",
                ]
                if g
                else ["(no group)", "", "", "", "", "", ""]
            )
            table.add_row(*head, *tail)
    return table


def _owners_table(states: list[DestinationState]) -> Any:
    """One row per owned partition and group (None when no partition is owned)."""
    from rich.table import Table

    table = Table(title="partition owners")
    for col in ("destination", "partition", "group", "owner", "held for", "token", "pending", "lag"):
        table.add_column(col, justify="left" if col in ("destination", "group", "owner") else "right")
    rows = 0
    for s in states:
        for p in s.partitions:
            for g in p.groups:
                if g.lease is None:
                    continue
                rows += 1
                owner = g.lease.owner or "(none)"
                held = f"{g.lease.age_ms / 1000:,.1f} s" if g.lease.owner else ""
                table.add_row(
                    s.spec.name, str(p.partition), g.group, owner, held, str(g.lease.token), str(g.pending), str(g.lag)
                )
    return table if rows else None


def register(sub: Any) -> None:
    """Add ``status`` to the ``framework`` command."""
    status = sub.add_parser("status", help="destinations, partitions, groups, depth, pending and lag")
    status.add_argument("destinations", nargs="*", help="only these destinations")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument(
        "--inbox-budget",
        metavar="SIZE",
        help="server memory a group's inbox may need over its window before it is flagged, e.g. 512MiB "
        "(default $FRAMEWORK_INBOX_MEMORY_BUDGET, else 256MiB)",
    )
    connection_options(status)
    status.set_defaults(func=show_status)
