"""``framework status [DESTINATION ...]``: destinations, partitions, groups, depth, pending and lag.

A table on a terminal, ``--json`` for scripts; the figures come from :func:`broker.inspect.describe`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import anyio

from broker import connect
from broker.inspect import DestinationState, describe
from framework.cli.common import UsageError, connection_options, print_json

__all__ = ["register"]


def show_status(args: argparse.Namespace) -> int:
    """Print the state of every declared destination (or of those named)."""

    async def collect() -> list[DestinationState]:
        broker = await connect(args.redis_url, namespace=args.namespace)
        try:
            return await describe(broker, args.destinations or None)
        finally:
            await broker.close()

    try:
        states = anyio.run(collect)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        print_json([s.to_json() for s in states])
        return 0
    from rich.console import Console

    console = Console() if sys.stdout.isatty() else Console(width=160)
    if not states:
        console.print("no destinations declared yet (publish a message or run a service first)")
    else:
        console.print(_table(states, args.namespace or os.environ.get("FRAMEWORK_NAMESPACE") or "fw"))
    return 0


def _table(states: list[DestinationState], namespace: str) -> Any:
    """One row per destination and group; a destination's own columns only on its first row."""
    from rich.table import Table

    table = Table(title=f"destinations (namespace {namespace})")
    for col in ("destination", "kind", "parts", "depth", "group", "consumers", "pending", "lag", "delayed", "dlq"):
        table.add_column(col, justify="right" if col not in ("destination", "kind", "group") else "left")
    for s in states:
        groups = s.to_json()["groups"] or [None]
        for i, g in enumerate(groups):
            head = (
                [s.spec.name, "queue" if s.spec.kind == "command" else "topic", str(s.spec.partitions), str(s.depth)]
                if i == 0
                else ["", "", "", ""]
            )
            tail = (
                [
                    g["group"],
                    str(g["consumers"]),
                    str(g["pending"]),
                    str(g["lag"]),
                    str(g["delayed"]),
                    str(g["dead_letters"]),
                ]
                if g
                else ["(no group)", "", "", "", "", ""]
            )
            table.add_row(*head, *tail)
    return table


def register(sub: Any) -> None:
    """Add ``status`` to the ``framework`` command."""
    status = sub.add_parser("status", help="destinations, partitions, groups, depth, pending and lag")
    status.add_argument("destinations", nargs="*", help="only these destinations")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    connection_options(status)
    status.set_defaults(func=show_status)
