"""``framework unsubscribe`` and ``framework delete``: remove a group or a destination, safely.

``unsubscribe`` refuses while workers of the group are alive (by their heartbeats; by the server's
consumer list, seen within ``--alive-within``, where no heartbeat is kept) and ``delete`` while a destination
has groups or entries (``--force`` overrides); both say what goes (and what a re-created group
would replay) and ask for confirmation (``--yes``; without a terminal they refuse rather than ask).
The figures come from :meth:`~broker.introspection.Introspection.group_usage` and ``destination_usage``.
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from typing import Any

import anyio

from broker import connect
from broker.capabilities import as_dead_letter_admin, as_introspection
from broker.introspection import ConsumerSeen, DestinationUsage, GroupUsage
from framework.cli.args import duration
from framework.cli.common import UsageError, connection_options
from framework.operations.overview import heartbeats_for

__all__ = ["register"]

ALIVE_WITHIN = 120.0  # seconds: twice the default visibility timeout; a live worker reads every few seconds


def _plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


def _when(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


# -- what an unsubscribe or a delete would do, in words ------------------------------------------------


def live_consumers(usage: GroupUsage, alive_within_ms: int) -> list[ConsumerSeen]:
    """Consumers seen within ``alive_within_ms``, or holding pending entries: a worker still running."""
    return [c for c in usage.consumers if c.idle_ms < alive_within_ms or c.pending > 0]


def live_text(live: list[ConsumerSeen]) -> str:
    """The live consumers, at most five."""
    shown = [f"{c.name} (seen {c.idle_ms / 1000:.1f} s ago, {c.pending} pending)" for c in live[:5]]
    more = f" and {len(live) - 5} more" if len(live) > 5 else ""
    return ", ".join(shown) + more


def holds_text(usage: GroupUsage) -> str:
    """What is deleted with the group."""
    lost = " (those messages are lost)" if not usage.spec.is_topic and (usage.retries or usage.dead) else ""
    retries = _plural(usage.retries, "waiting retry", "waiting retries")
    return (
        f"the group holds {_plural(usage.dead, 'dead letter')}, {retries}{lost} and an inbox of "
        f"{_plural(usage.inbox, 'message id')}, all deleted with it"
    )


def replay_text(usage: GroupUsage) -> str:
    """What happens when the group is created again (its service runs again)."""
    g = repr(usage.group)
    if not usage.spec.is_topic:
        if not usage.retained:
            return "the queue is empty, so nothing replays"
        return (
            f"the {_plural(usage.retained, 'entry', 'entries')} still in the queue stay for its next subscriber; "
            f"{usage.pending} of them were delivered to {g} and not acknowledged, and run again"
        )
    if usage.start == "latest":
        return (
            f"if {g} subscribes again (start=latest) it begins at new events: nothing replays, and the "
            f"{_plural(usage.unread, 'entry', 'entries')} it has not read yet are skipped"
        )
    if not usage.retained:
        return f"the topic retains no entries, so nothing replays if {g} subscribes again (start=earliest)"
    since = f" from {_when(usage.oldest_ms)}" if usage.oldest_ms is not None else ""
    return (
        f"if {g} subscribes again (start=earliest) it processes all {usage.retained} retained entries{since} "
        f"again: {usage.delivered} of them it already received, and with its inbox gone their effects apply twice"
    )


def usage_text(usage: DestinationUsage) -> str:
    """One clause for the messages of ``framework delete``."""
    names = f" ({', '.join(usage.groups)})" if usage.groups else ""
    entries = _plural(usage.entries, "stored entry", "stored entries")
    return f"{_plural(len(usage.groups), 'consumer group')}{names}, {entries} and {_plural(usage.dead, 'dead letter')}"


def _confirm(yes: bool, action: str, summary: str) -> bool:
    """True when the operator confirmed ``action`` (``--yes``, or "y" at a prompt on a terminal).

    Without a terminal and without ``--yes``: refuse in one line that says what would happen.
    """
    if yes:
        return True
    if not sys.stdin.isatty():
        raise UsageError(f"refusing to {action} without confirmation: {summary}; pass --yes")
    print(f"{action}: {summary}", file=sys.stderr)
    return input(f"{action[0].upper()}{action[1:]}? [y/N] ").strip().lower() in ("y", "yes")


# -- the commands --------------------------------------------------------------------------------------


def unsubscribe(args: argparse.Namespace) -> int:
    """Remove a group from a destination, with its dead letters, retries and inbox."""

    async def go() -> str | None:
        broker = await connect(args.redis_url, namespace=args.namespace)
        try:
            spec = await broker.get_destination(args.destination)
            if spec is None or (args.destination, args.group) not in await broker.list_subscriptions():
                raise UsageError(f"group {args.group!r} is not subscribed to {args.destination!r}")
            usage = await as_introspection(broker).group_usage(spec, args.group)
            beats = await heartbeats_for(broker, args.destination, args.group)  # who runs now, if known
            if beats is not None:
                live = [ConsumerSeen(w.name, w.ago_ms, 0) for w in beats if w.alive]
                live_line = ", ".join(f"{c.name} (seen {c.idle_ms / 1000:.1f} s ago by its heartbeat)" for c in live)
            else:  # no heartbeats: the server's consumers seen recently
                live = live_consumers(usage, int(args.alive_within * 1000))
                live_line = live_text(live)
            if live and not args.force:
                raise UsageError(
                    f"group {args.group!r} on {args.destination!r} has live consumers: {live_line}; "
                    "stop its workers first (they would crash on the missing group, and a restarted worker "
                    "creates it again), or pass --force"
                )
            summary = f"{holds_text(usage)}; {replay_text(usage)}"
            if not _confirm(args.yes, f"remove group {args.group!r} from {args.destination!r}", summary):
                return None
            await as_dead_letter_admin(broker).unsubscribe(spec, args.group)
            return summary
        finally:
            await broker.close()

    summary = anyio.run(go)
    if summary is None:
        print("nothing removed")
        return 1
    print(f"removed group {args.group!r} from {args.destination!r}: {summary}")
    return 0


def delete(args: argparse.Namespace) -> int:
    """Delete a destination with all its keys and its registration."""

    async def go() -> str | None:
        broker = await connect(args.redis_url, namespace=args.namespace)
        try:
            spec = await broker.get_destination(args.destination)
            if spec is None:
                known = ", ".join(s.name for s in await broker.list_destinations()) or "none"
                raise UsageError(f"unknown destination {args.destination!r}; known destinations: {known}")
            noun = "queue" if spec.kind == "command" else "topic"
            usage = await as_introspection(broker).destination_usage(spec)
            if (usage.groups or usage.entries) and not args.force:
                first = "unsubscribe its groups first (framework unsubscribe), or " if usage.groups else ""
                raise UsageError(
                    f"{noun} {spec.name!r} is in use: {usage_text(usage)}; {first}pass --force to delete all of it"
                )
            action = f"delete {noun} {spec.name!r}"
            summary = f"{usage_text(usage)}, all deleted with its keys and registration"
            if not _confirm(args.yes, action, summary):
                return None
            deleted = await as_dead_letter_admin(broker).delete_destination(spec, force=args.force)
            return f"deleted {noun} {spec.name!r} ({usage_text(usage)}; {_plural(deleted, 'key')} removed)"
        finally:
            await broker.close()

    done = anyio.run(go)
    print(done or "nothing deleted")
    return 0 if done else 1


def register(sub: Any) -> None:
    """Add ``unsubscribe`` and ``delete`` to the ``framework`` command."""
    p = sub.add_parser("unsubscribe", help="remove a service's consumer group from a destination")
    p.add_argument("destination")
    p.add_argument("--group", required=True, help="the service whose subscription goes")
    p.add_argument(
        "--force", action="store_true", help="even while consumers of the group are alive (their workers crash)"
    )
    p.add_argument(
        "--alive-within",
        type=duration,
        default=ALIVE_WITHIN,
        metavar="DURATION",
        help="where workers keep no heartbeat: a consumer seen this recently (or holding pending entries) "
        "counts as alive (default 2m)",
    )
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation (what goes and what replays)")
    connection_options(p)
    p.set_defaults(func=unsubscribe)

    p = sub.add_parser("delete", help="delete an unused destination with all its keys")
    p.add_argument("destination")
    p.add_argument("--force", action="store_true", help="even with subscribed groups or stored entries (all deleted)")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    connection_options(p)
    p.set_defaults(func=delete)
