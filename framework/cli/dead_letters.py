"""``framework dlq list|show|redrive|purge``, ``framework unsubscribe`` and ``framework delete``.

The dead-letter commands are thin layers over :class:`framework.dead_letters.DeadLetters`. ``unsubscribe``
refuses while consumers of the group are alive and ``delete`` while a destination has groups or
entries (``--force`` overrides); both say what goes (and what a re-created group would replay)
and ask for confirmation (``--yes``; without a terminal they refuse rather than ask).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import anyio
import attrs
import orjson
from redis.exceptions import ResponseError

from broker import RedisBroker, connect
from broker.topology import DestinationSpec
from framework.cli.args import duration, positive_int, positive_rate
from framework.dead_letters import DeadLetter, DeadLetters

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


@contextlib.contextmanager
def _progress(total: int, label: str) -> Iterator[Callable[[], None]]:
    """A rich progress bar on stderr when it is a terminal (not in CI logs); yields "one more done"."""
    if total < 2 or not sys.stderr.isatty():
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task(label, total=total)
        yield lambda: bar.advance(task)


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
        started = time.monotonic()

        async def go(d: DeadLetters) -> tuple[int, int]:
            # DeadLetters.redrive, one letter at a time so that progress can be shown
            if args.ids:
                wanted = set(args.ids)
                letters = [x for x in await d.list() if x.ref in wanted or x.message_id in wanted]
                missing = wanted - {x.ref for x in letters} - {x.message_id for x in letters}
                if missing:
                    raise usage_error(f"no dead letter {', '.join(sorted(missing))}")
            else:
                letters = await d.list(group=sel["group"], destination=sel["destination"])
            moved = 0
            with _progress(len(letters), "redriving") as advance:
                for letter in letters:
                    spec = await d.broker.get_destination(letter.destination)
                    view = d.broker.group_partition(spec, letter.partition, letter.group) if spec else None
                    if view is not None and await d.broker.redrive(view, letter.entry_id) is not None:
                        moved += 1
                        if args.rate:
                            await anyio.sleep(1 / args.rate)
                    advance()
            return moved, len(letters)

        moved, selected = _with_dlq(args, go)
        gone = f"; {selected - moved} were already gone" if selected > moved else ""
        print(f"redrove {moved} dead letter(s) to their group(s) in {time.monotonic() - started:.1f} s{gone}")
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


# -- what an unsubscribe or a delete would do ----------------------------------------------------------

ALIVE_WITHIN = 120.0  # seconds: twice the default visibility timeout; a live worker reads every few seconds


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _when(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


@attrs.frozen
class ConsumerSeen:
    """A consumer of a group: how long since the server last saw it read, and what it holds."""

    name: str
    idle_ms: int
    pending: int


@attrs.frozen
class GroupReport:
    """What removing ``group`` from ``spec`` deletes, and what a group created again would replay."""

    spec: DestinationSpec
    group: str
    start: str
    live: list[ConsumerSeen]
    inbox: int  # message ids remembered for deduplication (processed, or leased to a running handler)
    retries: int  # waiting in the group's retry path (redeliver stream and delayed set)
    dead: int
    pending: int  # delivered to the group and not acknowledged
    retained: int  # entries in the partition streams
    delivered: int  # of those, already delivered to the group
    unread: int  # of those, not yet delivered to the group
    oldest_ms: int | None  # time of the oldest retained entry

    def live_text(self) -> str:
        """The live consumers, at most five."""
        shown = [f"{c.name} (seen {c.idle_ms / 1000:.1f} s ago, {c.pending} pending)" for c in self.live[:5]]
        more = f" and {len(self.live) - 5} more" if len(self.live) > 5 else ""
        return ", ".join(shown) + more

    def holds_text(self) -> str:
        """What is deleted with the group."""
        lost = " (those messages are lost)" if not self.spec.is_topic and (self.retries or self.dead) else ""
        retries = _plural(self.retries, "waiting retry", "waiting retries")
        return (
            f"the group holds {_plural(self.dead, 'dead letter')}, {retries}{lost} and an inbox of "
            f"{_plural(self.inbox, 'message id')}, all deleted with it"
        )

    def replay_text(self) -> str:
        """What happens when the group is created again (its service runs again)."""
        g = repr(self.group)
        if not self.spec.is_topic:
            if not self.retained:
                return "the queue is empty, so nothing replays"
            return (
                f"the {_plural(self.retained, 'entry', 'entries')} still in the queue stay for its next subscriber; "
                f"{self.pending} of them were delivered to {g} and not acknowledged, and run again"
            )
        if self.start == "latest":
            return (
                f"if {g} subscribes again (start=latest) it begins at new events: nothing replays, and the "
                f"{_plural(self.unread, 'entry', 'entries')} it has not read yet are skipped"
            )
        if not self.retained:
            return f"the topic retains no entries, so nothing replays if {g} subscribes again (start=earliest)"
        since = f" from {_when(self.oldest_ms)}" if self.oldest_ms is not None else ""
        return (
            f"if {g} subscribes again (start=earliest) it processes all {self.retained} retained entries{since} "
            f"again: {self.delivered} of them it already received, and with its inbox gone their effects apply twice"
        )


async def _unread(broker: RedisBroker, stream: str, info: dict[str, Any]) -> int:
    if info.get("lag") is not None:
        return int(info["lag"])
    last = _text(info.get("last-delivered-id", "0-0"))  # the server cannot tell (entries were deleted): count
    return len(await broker.redis.execute_command("XRANGE", stream, f"({last}", "+", "COUNT", 1_000_000))


async def group_report(broker: RedisBroker, spec: DestinationSpec, group: str, alive_within_ms: int) -> GroupReport:
    """Read everything :class:`GroupReport` says about ``group`` on ``spec`` (nothing is changed)."""
    raw = await broker.redis.hget(broker.keyspace.subscriptions, f"{spec.name}|{group}")
    start = str(orjson.loads(raw).get("start", "earliest")) if raw else "earliest"
    seen: dict[str, ConsumerSeen] = {}
    inbox = retries = dead = pending = retained = delivered = unread = 0
    oldest: int | None = None
    for p in range(spec.partitions):
        view = broker.group_partition(spec, p, group)
        for stream in (view.stream, view.keys.redeliver):
            try:
                rows = await broker.redis.xinfo_consumers(stream, group)
            except ResponseError:  # no stream or no group there
                rows = []
            for row in rows:
                info = {_text(k): v for k, v in row.items()}
                name, idle, held = _text(info["name"]), int(info.get("idle") or 0), int(info.get("pending") or 0)
                before = seen.get(name)
                if before is not None:
                    idle, held = min(idle, before.idle_ms), held + before.pending
                seen[name] = ConsumerSeen(name, idle, held)
        length = int(await broker.redis.xlen(view.stream))
        retained += length
        for info in await broker.stream_groups(view.stream):
            if _text(info["name"]) == group:
                pending += int(info.get("pending") or 0)
                if spec.is_topic:
                    lag = min(await _unread(broker, view.stream, info), length)
                    unread += lag
                    delivered += length - lag
        if length:
            first = await broker.redis.execute_command("XRANGE", view.stream, "-", "+", "COUNT", 1)
            if first:
                ms = int(_text(first[0][0]).split("-")[0])
                oldest = ms if oldest is None else min(oldest, ms)
        pipe = broker.redis.pipeline(transaction=False)
        pipe.zcard(view.keys.inbox)  # processed ids and running leases; ZCARD keeps the operator ACL small
        pipe.zcard(view.keys.delayed)
        pipe.xlen(view.keys.redeliver)
        pipe.xlen(view.keys.dlq)
        processed, delayed, redeliver, dlq = await pipe.execute()
        inbox, retries, dead = inbox + int(processed), retries + int(delayed) + int(redeliver), dead + int(dlq)
    live = sorted((c for c in seen.values() if c.idle_ms < alive_within_ms or c.pending > 0), key=lambda c: c.idle_ms)
    return GroupReport(spec, group, start, live, inbox, retries, dead, pending, retained, delivered, unread, oldest)


@attrs.frozen
class DestinationUsage:
    """What stops a destination from being deleted: its groups and stored entries."""

    groups: list[str]
    entries: int
    dead: int

    def text(self) -> str:
        """One clause for the messages of ``framework delete``."""
        names = f" ({', '.join(self.groups)})" if self.groups else ""
        entries = _plural(self.entries, "stored entry", "stored entries")
        return (
            f"{_plural(len(self.groups), 'consumer group')}{names}, {entries} and {_plural(self.dead, 'dead letter')}"
        )


async def destination_usage(broker: RedisBroker, spec: DestinationSpec) -> DestinationUsage:
    """Groups (registered or present on a stream), stored entries and dead letters of ``spec``."""
    groups = {g for d, g in await broker.list_subscriptions() if d == spec.name}
    entries = dead = 0
    for p in range(spec.partitions):
        stream = broker.keyspace.partition(spec.name, p).stream
        groups |= {_text(info["name"]) for info in await broker.stream_groups(stream)}
        entries += int(await broker.redis.xlen(stream))
    for group in groups:
        for p in range(spec.partitions):
            dead += int(await broker.redis.xlen(broker.group_partition(spec, p, group).keys.dlq))
    return DestinationUsage(sorted(groups), entries, dead)


def _confirm(yes: bool, action: str, summary: str, usage_error: type[Exception]) -> bool:
    """True when the operator confirmed ``action`` (``--yes``, or "y" at a prompt on a terminal).

    Without a terminal and without ``--yes``: refuse in one line that says what would happen.
    """
    if yes:
        return True
    if not sys.stdin.isatty():
        raise usage_error(f"refusing to {action} without confirmation: {summary}; pass --yes")
    print(f"{action}: {summary}", file=sys.stderr)
    return input(f"{action[0].upper()}{action[1:]}? [y/N] ").strip().lower() in ("y", "yes")


def _plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


def _unsubscribe_cmd(usage_error: type[Exception]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        async def go() -> str | None:
            broker = await connect(args.redis_url, namespace=args.namespace)
            try:
                spec = await broker.get_destination(args.destination)
                if spec is None or (args.destination, args.group) not in await broker.list_subscriptions():
                    raise usage_error(f"group {args.group!r} is not subscribed to {args.destination!r}")
                report = await group_report(broker, spec, args.group, int(args.alive_within * 1000))
                if report.live and not args.force:
                    raise usage_error(
                        f"group {args.group!r} on {args.destination!r} has live consumers: {report.live_text()}; "
                        "stop its workers first (they would crash on the missing group, and a restarted worker "
                        "creates it again), or pass --force"
                    )
                summary = f"{report.holds_text()}; {report.replay_text()}"
                if not _confirm(
                    args.yes, f"remove group {args.group!r} from {args.destination!r}", summary, usage_error
                ):
                    return None
                await broker.unsubscribe(spec, args.group)
                return summary
            finally:
                await broker.close()

        summary = anyio.run(go)
        if summary is None:
            print("nothing removed")
            return 1
        print(f"removed group {args.group!r} from {args.destination!r}: {summary}")
        return 0

    return run


def _delete_cmd(usage_error: type[Exception]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        async def go() -> str | None:
            broker = await connect(args.redis_url, namespace=args.namespace)
            try:
                spec = await broker.get_destination(args.destination)
                if spec is None:
                    known = ", ".join(s.name for s in await broker.list_destinations()) or "none"
                    raise usage_error(f"unknown destination {args.destination!r}; known destinations: {known}")
                noun = "queue" if spec.kind == "command" else "topic"
                usage = await destination_usage(broker, spec)
                if (usage.groups or usage.entries) and not args.force:
                    first = "unsubscribe its groups first (framework unsubscribe), or " if usage.groups else ""
                    raise usage_error(
                        f"{noun} {spec.name!r} is in use: {usage.text()}; {first}pass --force to delete all of it"
                    )
                action = f"delete {noun} {spec.name!r}"
                summary = f"{usage.text()}, all deleted with its keys and registration"
                if not _confirm(args.yes, action, summary, usage_error):
                    return None
                deleted = await broker.delete_destination(spec, force=args.force)
                return f"deleted {noun} {spec.name!r} ({usage.text()}; {_plural(deleted, 'key')} removed)"
            finally:
                await broker.close()

        done = anyio.run(go)
        print(done or "nothing deleted")
        return 0 if done else 1

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
    p.add_argument(
        "--force", action="store_true", help="even while consumers of the group are alive (their workers crash)"
    )
    p.add_argument(
        "--alive-within",
        type=duration,
        default=ALIVE_WITHIN,
        metavar="DURATION",
        help="a consumer seen this recently (or holding pending entries) counts as alive (default 2m)",
    )
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation (what goes and what replays)")
    connection_options(p)
    p.set_defaults(func=_unsubscribe_cmd(usage_error))

    p = sub.add_parser("delete", help="delete an unused destination with all its keys")
    p.add_argument("destination")
    p.add_argument("--force", action="store_true", help="even with subscribed groups or stored entries (all deleted)")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    connection_options(p)
    p.set_defaults(func=_delete_cmd(usage_error))
