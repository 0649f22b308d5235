"""``framework dlq list|show|redrive|purge`` and ``framework unsubscribe``: thin layers over the Python API."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import orjson

from broker import connect
from framework.cli_args import positive_int, positive_rate
from framework.dlq import DeadLetter, DeadLetters

__all__ = ["register"]


def _with_dlq(args: argparse.Namespace, fn: Callable[[DeadLetters], Awaitable[Any]]) -> Any:
    async def go() -> Any:
        broker = await connect(args.redis_url, namespace=args.namespace)
        try:
            return await fn(DeadLetters(broker))
        finally:
            await broker.close()

    return anyio.run(go)


def _print_json(data: Any) -> None:
    sys.stdout.write(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode() + "\n")


def _register_cmds(usage_error: type[Exception]) -> dict[str, Callable[[argparse.Namespace], int]]:
    def selection(args: argparse.Namespace) -> dict[str, Any]:
        if args.ids and (args.group or args.destination or args.all):
            raise usage_error("give dead-letter ids, or --group/--destination/--all, not both")
        if not (args.ids or args.group or args.destination or args.all):
            raise usage_error("say which dead letters: ids, --group, --destination or --all")
        return {"group": args.group, "destination": args.destination, "everything": args.all}

    def list_cmd(args: argparse.Namespace) -> int:
        items: list[DeadLetter] = _with_dlq(
            args, lambda d: d.list(group=args.group, destination=args.destination, limit=args.limit)
        )
        if args.json:
            _print_json([i.to_json() for i in items])
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

    def show_cmd(args: argparse.Namespace) -> int:
        async def get(d: DeadLetters) -> DeadLetter:
            try:
                return await d.get(args.id)
            except (KeyError, ValueError) as exc:
                raise usage_error(exc.args[0]) from None

        item = _with_dlq(args, get)
        data = item.to_json()
        if args.json:
            _print_json(data)
            return 0
        tb = data.pop("traceback")
        for k, v in data.items():
            print(f"{k:>16}: {v}")
        if tb:
            print("       traceback:\n" + tb)
        return 0

    def redrive_cmd(args: argparse.Namespace) -> int:
        sel = selection(args)

        async def go(d: DeadLetters) -> int:
            try:
                return await d.redrive(args.ids or None, rate=args.rate, **sel)
            except KeyError as exc:
                raise usage_error(exc.args[0]) from None

        moved = _with_dlq(args, go)
        print(f"redrove {moved} dead letter(s) to their group(s)")
        return 0

    def purge_cmd(args: argparse.Namespace) -> int:
        sel = selection(args)
        if not args.yes:
            count = (
                len(args.ids)
                if args.ids
                else _with_dlq(args, lambda d: d.count(group=args.group, destination=args.destination))
            )
            if not sys.stdin.isatty():
                raise usage_error(f"refusing to purge {count} dead letter(s) without confirmation: pass --yes")
            answer = input(f"Delete {count} dead letter(s) for good? [y/N] ").strip().lower()
            if answer not in ("y", "yes"):
                print("nothing purged")
                return 1

        async def go(d: DeadLetters) -> int:
            try:
                return await d.purge(args.ids or None, **sel)
            except KeyError as exc:
                raise usage_error(exc.args[0]) from None

        print(f"purged {_with_dlq(args, go)} dead letter(s)")
        return 0

    return {"list": list_cmd, "show": show_cmd, "redrive": redrive_cmd, "purge": purge_cmd}


def _unsubscribe_cmd(usage_error: type[Exception]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        async def go() -> None:
            broker = await connect(args.redis_url, namespace=args.namespace)
            try:
                spec = await broker.get_destination(args.destination)
                if spec is None or (args.destination, args.group) not in await broker.list_subscriptions():
                    raise usage_error(f"group {args.group!r} is not subscribed to {args.destination!r}")
                dead = await DeadLetters(broker).count(group=args.group, destination=args.destination)
                if dead and not args.yes:  # nothing is dropped silently, dead letters included
                    raise usage_error(
                        f"group {args.group!r} holds {dead} dead letter(s) for {args.destination!r}, which would be "
                        "deleted with the subscription: redrive or purge them first (framework dlq), or pass --yes"
                    )
                await broker.unsubscribe(spec, args.group)
            finally:
                await broker.close()

        anyio.run(go)
        print(f"removed group {args.group!r} from {args.destination!r} (with its retries, dead letters and inbox)")
        return 0

    return run


def register(
    sub: Any, connection_options: Callable[[argparse.ArgumentParser], None], usage_error: type[Exception]
) -> None:
    """Add ``dlq`` and ``unsubscribe`` to the ``framework`` command."""
    cmds = _register_cmds(usage_error)
    dlq = sub.add_parser("dlq", help="list, show, redrive and purge dead letters")
    actions = dlq.add_subparsers(dest="dlq_action", required=True)

    p = actions.add_parser("list", help="dead letters, newest last")
    p.add_argument("--group", help="only this consumer group (service)")
    p.add_argument("--destination", help="only this queue/topic")
    p.add_argument("--limit", type=positive_int, default=None, help="at most this many (the oldest first)")
    p.add_argument("--json", action="store_true")
    connection_options(p)
    p.set_defaults(func=cmds["list"])

    p = actions.add_parser("show", help="one dead letter: payload, headers and reason")
    p.add_argument("id", help="a ref (destination/partition/group/entry) or a message id")
    p.add_argument("--json", action="store_true")
    connection_options(p)
    p.set_defaults(func=cmds["show"])

    for name, helptext in (
        ("redrive", "give dead letters back to their failing group only"),
        ("purge", "delete dead letters for good"),
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
        p.set_defaults(func=cmds[name])

    p = sub.add_parser("unsubscribe", help="remove a service's consumer group from a destination")
    p.add_argument("destination")
    p.add_argument("--group", required=True, help="the service whose subscription goes")
    p.add_argument("--yes", action="store_true", help="also delete the group's dead letters")
    connection_options(p)
    p.set_defaults(func=_unsubscribe_cmd(usage_error))
