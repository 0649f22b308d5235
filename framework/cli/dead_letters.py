"""``framework dlq list|show|redrive|purge``: dead letters from the command line.

Thin layers over :class:`framework.dead_letters.DeadLetters`. ``--destination`` and ``--group`` must
name what exists ("no such destination", with the near match), so a typo never reads as "0 redriven".
``redrive`` shows a progress bar on a terminal (never in CI logs); ``purge`` asks for confirmation
(``--yes``; without a terminal it refuses rather than ask).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from broker import connect
from framework.cli.args import positive_int, positive_rate
from framework.cli.common import UsageError, connection_options, print_json
from framework.cli.hints import require_destination, require_group
from framework.dead_letters import DeadLetter, DeadLetters

__all__ = ["register"]


def _with_dead_letters(args: argparse.Namespace, fn: Callable[[DeadLetters], Awaitable[Any]]) -> Any:
    """Run ``fn`` on the dead letters of the broker that ``args`` names; close the connection after."""

    async def go() -> Any:
        broker = await connect(args.redis_url, namespace=args.namespace)
        try:
            destination = getattr(args, "destination", None)
            if destination:  # a typo must not read as "nothing to do"
                await require_destination(broker, destination)
            if getattr(args, "group", None):
                await require_group(broker, args.group, destination)
            return await fn(DeadLetters(broker))
        finally:
            await broker.close()

    return anyio.run(go)


def _selection(args: argparse.Namespace) -> dict[str, Any]:
    """The ``group``/``destination``/``everything`` keywords of a redrive or purge; UsageError if unclear."""
    if args.ids and (args.group or args.destination or args.all):
        raise UsageError("give dead-letter ids, or --group/--destination/--all, not both")
    if not (args.ids or args.group or args.destination or args.all):
        raise UsageError("say which dead letters: ids, --group, --destination or --all")
    return {"group": args.group, "destination": args.destination, "everything": args.all}


class _ProgressBar:
    """A rich progress bar on stderr when it is a terminal (not in CI logs), fed ``(done, total)``."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.total = 0
        self._bar: Any = None
        self._task: Any = None

    def __call__(self, done: int, total: int) -> None:
        self.total = total
        if self._bar is None and done == 0 and total >= 2 and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            columns = (TextColumn(self.label), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
            self._bar = Progress(*columns, console=Console(stderr=True))
            self._bar.start()
            self._task = self._bar.add_task(self.label, total=total)
        if self._bar is not None:
            self._bar.update(self._task, completed=done)

    def close(self) -> None:
        """Stop drawing (the bar stays on the screen as it was)."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def list_dead_letters(args: argparse.Namespace) -> int:
    """Print dead letters as a table, or as JSON."""
    items: list[DeadLetter] = _with_dead_letters(
        args, lambda d: d.list(group=args.group, destination=args.destination, limit=args.limit)
    )
    if args.json:
        print_json([i.to_json() for i in items])
        return 0
    if not items:
        print("no dead letters")
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table()
    for col in ("ref", "message id", "attempts", "dead at", "reason"):
        table.add_column(col, overflow="fold")
    for i in items:
        dead = i.dead_at.strftime("%Y-%m-%d %H:%M:%S") if i.dead_at else ""
        table.add_row(i.ref, i.message_id, str(i.attempts), dead, i.reason[:160])
    (Console() if sys.stdout.isatty() else Console(width=200)).print(table)
    return 0


def show_dead_letter(args: argparse.Namespace) -> int:
    """Print one dead letter: payload, headers, reason and traceback."""

    async def get(d: DeadLetters) -> DeadLetter:
        try:
            return await d.get(args.id)
        except (KeyError, ValueError) as exc:
            raise UsageError(exc.args[0]) from None

    data = _with_dead_letters(args, get).to_json()
    if args.json:
        print_json(data)
        return 0
    tb = data.pop("traceback")
    for k, v in data.items():
        print(f"{k:>16}: {v}")
    if tb:
        print("       traceback:\n" + tb)
    return 0


def redrive(args: argparse.Namespace) -> int:
    """Give dead letters back to their failing group; one summary line, a progress bar on a terminal."""
    selected = _selection(args)
    started = time.monotonic()
    bar = _ProgressBar("redriving")

    async def go(d: DeadLetters) -> int:
        try:
            return await d.redrive(args.ids or None, rate=args.rate, progress=bar, **selected)
        except KeyError as exc:
            raise UsageError(exc.args[0]) from None
        finally:
            bar.close()

    moved = _with_dead_letters(args, go)
    gone = f"; {bar.total - moved} were already gone" if bar.total > moved else ""
    print(f"redrove {moved} dead letter(s) to their group(s) in {time.monotonic() - started:.1f} s{gone}")
    return 0


def purge(args: argparse.Namespace) -> int:
    """Delete dead letters for good, after confirmation."""
    selected = _selection(args)
    if not args.yes:
        count = (
            len(args.ids)
            if args.ids
            else _with_dead_letters(args, lambda d: d.count(group=args.group, destination=args.destination))
        )
        if not sys.stdin.isatty():
            raise UsageError(f"refusing to purge {count} dead letter(s) without confirmation: pass --yes")
        answer = input(f"Delete {count} dead letter(s) for good? [y/N] ").strip().lower()
        if answer not in ("y", "yes"):
            print("nothing purged")
            return 1

    async def go(d: DeadLetters) -> int:
        try:
            return await d.purge(args.ids or None, **selected)
        except KeyError as exc:
            raise UsageError(exc.args[0]) from None

    print(f"purged {_with_dead_letters(args, go)} dead letter(s)")
    return 0


def register(sub: Any) -> None:
    """Add ``dlq`` (list, show, redrive, purge) to the ``framework`` command."""
    dlq = sub.add_parser("dlq", help="list, show, redrive and purge dead letters")
    actions = dlq.add_subparsers(dest="dlq_action", required=True)

    p = actions.add_parser("list", help="dead letters, newest last")
    p.add_argument("--group", help="only this consumer group (service)")
    p.add_argument("--destination", help="only this queue/topic")
    p.add_argument("--limit", type=positive_int, default=None, help="at most this many (the oldest first)")
    p.add_argument("--json", action="store_true")
    connection_options(p)
    p.set_defaults(func=list_dead_letters)

    p = actions.add_parser("show", help="one dead letter: payload, headers and reason")
    p.add_argument("id", help="a ref (destination/partition/group/entry) or a message id")
    p.add_argument("--json", action="store_true")
    connection_options(p)
    p.set_defaults(func=show_dead_letter)

    for name, helptext, command in (
        ("redrive", "give dead letters back to their failing group only", redrive),
        ("purge", "delete dead letters for good", purge),
    ):
        p = actions.add_parser(name, help=helptext)
        p.add_argument("ids", nargs="*", help="refs or message ids")
        p.add_argument("--group")
        p.add_argument("--destination")
        p.add_argument("--all", action="store_true", help="every dead letter (of the group/destination if given)")
        if name == "redrive":
            p.add_argument("--rate", type=positive_rate, default=None, help="at most this many per second")
        else:
            p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
        connection_options(p)
        p.set_defaults(func=command)
