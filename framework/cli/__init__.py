"""The ``framework`` command: run services, inspect destinations, send messages, manage the server.

Every sub-command takes ``--redis-url`` (default ``$REDIS_URL``, else the per-user embedded Valkey,
see :func:`broker.default_data_dir`) and ``--namespace`` (default ``$FRAMEWORK_NAMESPACE`` or ``fw``). Errors
are one line on stderr with exit status 2 (bad arguments) or 1 (the broker or the code failed).
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import anyio
import orjson

from broker import BrokerError, connect
from framework.cli.args import json_argument, log_level, positive_duration, positive_int
from framework.logs import configure_logging, get_logger
from framework.service import HandlerError, Service

__all__ = ["load_services", "main"]


class UsageError(Exception):
    """A wrong argument: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def load_services(targets: Sequence[str]) -> list[Service]:
    """Import ``module:attribute`` targets (a Service or a list of them; ``module`` alone finds all)."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)  # like `python -m`: services in the working directory are importable
    services: list[Service] = []
    for target in targets:
        module_name, _, attr = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            raise UsageError(f"cannot import {module_name!r}: {exc}") from None
        except HandlerError as exc:
            raise UsageError(str(exc)) from None
        except Exception as exc:  # SyntaxError included: one line with file:line, not a long traceback
            raise UsageError(f"cannot import {module_name!r}: {_import_failure(exc)}") from None
        found = {k: v for k, v in vars(module).items() if isinstance(v, Service)}
        if not attr:
            if not found:
                raise UsageError(f"module {module_name!r} defines no Service; name one as {module_name}:NAME")
            services += list(found.values())
            continue
        if not hasattr(module, attr):
            hint = f"; services there: {', '.join(sorted(found))}" if found else ""
            raise UsageError(f"module {module_name!r} has no attribute {attr!r}{hint}")
        value = getattr(module, attr)
        items = value if isinstance(value, list | tuple) else [value]
        for item in items:
            if not isinstance(item, Service):
                raise UsageError(f"{target} is a {type(item).__name__}, not a framework.Service")
            services.append(item)
    unique: dict[str, Service] = {}
    for s in services:
        unique.setdefault(s.name, s)
    return list(unique.values())


def _import_failure(exc: Exception) -> str:
    """``Type at file:line: message`` for an exception raised while importing a user's module.

    The line is the innermost frame outside the standard library, installed packages and the
    framework itself: the user's code that raised (or called what raised).
    """
    import sysconfig
    import traceback

    if isinstance(exc, SyntaxError) and exc.filename:
        where = f"{_short_path(exc.filename)}:{exc.lineno}" if exc.lineno else _short_path(exc.filename)
        return f"{type(exc).__name__} at {where}: {exc.msg}"
    skip = [sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    skip += [os.path.join(root, package) + os.sep for package in ("framework", "broker")]
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if not f.filename.startswith("<") and not f.filename.startswith(tuple(skip))]
    frame = (mine or frames or [None])[-1]
    where = f" at {_short_path(frame.filename)}:{frame.lineno}" if frame is not None else ""
    return f"{type(exc).__name__}{where}: {exc}"


def _short_path(path: str) -> str:
    """``path`` relative to the working directory when it lies inside it."""
    rel = os.path.relpath(path) if os.path.isabs(path) else path
    return path if rel.startswith("..") else rel


def _json_arg(text: str) -> Any:
    """The JSON argument of a command: the JSON itself, ``-`` (stdin) or ``@FILE``."""
    try:
        return json_argument(text)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


# -- commands -------------------------------------------------------------------------------------------


def _cmd_run(args: argparse.Namespace) -> int:
    from framework.runtime import Runtime
    from framework.settings import RuntimeSettings

    early: list[int] = []  # a signal that arrives while we import and connect still stops us gracefully
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda n, _frame: early.append(n))
    services = load_services(args.targets)
    settings = RuntimeSettings(
        concurrency=args.concurrency,
        prefetch=args.prefetch,
        visibility_timeout=args.visibility_timeout,
        shutdown_timeout=args.shutdown_timeout,
        consumer=args.consumer,
        inbox_window=args.inbox_window,
    )
    runtime = Runtime(
        services, url=args.redis_url, namespace=args.namespace, settings=settings, outbox_database_url=args.outbox_relay
    )
    log = get_logger("framework.cli")

    async def watch_signals(scope: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            if early:
                log.info("signal received during start-up: shutting down gracefully")
                runtime.stop()
            async for signum in signals:
                if runtime._stopping:
                    log.warning("second signal: exiting now; unacknowledged messages will be redelivered")
                    os._exit(128 + signum)
                log.info("signal received: shutting down gracefully", signal=signal.Signals(signum).name)
                runtime.stop()

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_signals, tg.cancel_scope)
            await runtime.run()
            tg.cancel_scope.cancel()

    anyio.run(main, backend_options={"use_uvloop": _use_uvloop()})
    _abandon_running_threads(log)
    return 0


def _abandon_running_threads(log: Any) -> None:
    """Exit now if sync handlers still run past the shutdown timeout (threads cannot be stopped).

    Their messages were not acknowledged and stay pending: another consumer claims them after the
    visibility timeout. Waiting for the threads would break the shutdown bound.
    """
    import threading

    busy = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    for t in busy:
        t.join(timeout=0.2)  # idle worker threads stop on their own at once
    busy = [t for t in busy if t.is_alive()]
    if busy:
        log.warning(
            "sync handlers still running after the shutdown timeout were abandoned; "
            "their messages stay pending and will be redelivered",
            threads=len(busy),
        )
        sys.stderr.flush()
        os._exit(0)


def _use_uvloop() -> bool:
    """uvloop (10-15% more throughput, lower latency) unless FRAMEWORK_EVENT_LOOP=asyncio or absent."""
    if os.environ.get("FRAMEWORK_EVENT_LOOP", "uvloop") == "asyncio":
        return False
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def _cmd_status(args: argparse.Namespace) -> int:
    from broker.inspect import describe

    async def collect() -> list[Any]:
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
        sys.stdout.write(orjson.dumps([s.to_json() for s in states], option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"destinations (namespace {args.namespace or os.environ.get('FRAMEWORK_NAMESPACE') or 'fw'})")
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
    console = Console() if sys.stdout.isatty() else Console(width=160)
    if not states:
        console.print("no destinations declared yet (publish a message or run a service first)")
    else:
        console.print(table)
    return 0


def _cmd_produce(kind: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        from framework.client import Client

        payload = _json_arg(args.payload)

        async def go() -> str | None:
            async with Client(args.redis_url, namespace=args.namespace) as client:
                if not args.create:
                    from broker.codec import check_body_size
                    from framework.messages import build_envelope

                    # an oversized body gets its own error first, whatever the destination
                    check_body_size(build_envelope(args.destination, kind, payload)[0], client.broker.max_body_bytes)
                    await _require_known(client.broker, args.destination, kind)
                method = client.send if kind == "command" else client.publish
                return await method(
                    args.destination, payload, key=args.key, type=args.type, idempotency_key=args.idempotency_key
                )

        message_id = anyio.run(go)
        if message_id is None:
            print(
                f"not stored: idempotency key {args.idempotency_key!r} was already used within the dedup window",
                file=sys.stderr,
            )
            return 0
        print(message_id)
        return 0

    return run


async def _require_known(broker: Any, name: str, kind: str) -> None:
    """Refuse a destination nobody declared (a typo would create one that nobody consumes).

    Known means registered: by a running service (it declares what it consumes), by a producer
    in code (``Client.send``/``publish`` declare on first use) or by ``--create``.
    """
    if await broker.get_destination(name) is not None:
        return  # a kind mismatch is reported by the client, naming the right verb
    import difflib

    from redis.exceptions import NoPermissionError

    noun = "queue" if kind == "command" else "topic"
    try:
        known = [s.name for s in await broker.list_destinations() if s.kind == kind]
    except NoPermissionError:  # a producer's ACL need not list destinations (HGETALL)
        raise UsageError(f"unknown {noun} {name!r}; pass --create to declare it") from None
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    listed = ", ".join(known[:20]) + (f" and {len(known) - 20} more" if len(known) > 20 else "") if known else "none"
    raise UsageError(f"unknown {noun} {name!r}{hint}; known {noun}s: {listed}; pass --create to declare it")


def _cmd_server(args: argparse.Namespace) -> int:
    """Start, stop or show the per-user embedded Valkey; output never shows its password."""
    from broker.embedded import EmbeddedServer

    server = EmbeddedServer(args.data_dir)
    if args.action == "start":
        server.ensure_running()
        st = server.status()
        print(
            f"embedded Valkey running at redis://127.0.0.1:{st.port}/0 pid {st.pid} "
            f"(data in {server.data_dir}; password in {server.data_dir / 'password'})"
        )
    elif args.action == "stop":
        print("stopped" if server.stop() else f"not running (data dir {server.data_dir})")
    else:
        st = server.status()
        if st.running:
            print(f"running: {st.safe_url}")
            print(f"data dir: {st.data_dir}")
            print(f"pid: {st.pid}")
            print(f"port: {st.port}")
            print(f"password: in {st.data_dir / 'password'} (clients find it there)")
        else:
            print(f"not running (data dir {st.data_dir}); start it with `framework server start`")
            return 3
    return 0


# -- parser ---------------------------------------------------------------------------------------------


def _connection_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default=None, help="broker URL (default: $REDIS_URL, else the embedded Valkey)")
    p.add_argument("--namespace", default=None, help="key prefix (default: $FRAMEWORK_NAMESPACE or 'fw')")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``framework`` command."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--log-level", type=log_level, default=argparse.SUPPRESS, help="debug, info, warning, error (default: info)"
    )
    common.add_argument(
        "--log-format",
        choices=("console", "json"),
        default=argparse.SUPPRESS,
        help="default: console on a terminal, json otherwise",
    )
    parser = _Parser(prog="framework", description="Event-driven microservices on Redis Streams.", parents=[common])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    real_add = sub.add_parser

    def add_parser(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        return real_add(name, parents=[common], **kwargs)

    sub.add_parser = add_parser  # every sub-command accepts the logging options too

    run = sub.add_parser("run", help="run services until SIGTERM/SIGINT")
    run.add_argument("targets", nargs="+", metavar="MODULE:SERVICE", help="e.g. example_services.billing:service")
    run.add_argument("--concurrency", type=positive_int, default=64, help="handlers running at once (default 64)")
    run.add_argument("--prefetch", type=positive_int, default=500, help="entries fetched per read (default 500)")
    run.add_argument(
        "--visibility-timeout",
        type=positive_duration,
        default=60.0,
        help="seconds before another consumer may claim an unacknowledged entry (default 60)",
    )
    run.add_argument(
        "--shutdown-timeout",
        type=positive_duration,
        default=30.0,
        help="seconds in-flight handlers get to finish on shutdown (default 30)",
    )
    run.add_argument("--consumer", default=None, help="consumer name (default: host name and a free slot)")
    run.add_argument(
        "--inbox-window",
        type=positive_duration,
        default=7 * 24 * 3600.0,
        help="how long processed message ids are remembered for deduplication (default 7d)",
    )
    run.add_argument(
        "--outbox-relay",
        nargs="?",
        const="",
        default=None,
        metavar="DATABASE_URL",
        help="also run an outbox relay in this process (default: $DATABASE_URL, else $FRAMEWORK_HOME/outbox.db)",
    )
    _connection_options(run)
    run.set_defaults(func=_cmd_run)

    status = sub.add_parser("status", help="destinations, partitions, groups, depth, pending and lag")
    status.add_argument("destinations", nargs="*", help="only these destinations")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    _connection_options(status)
    status.set_defaults(func=_cmd_status)

    for name, kind, noun in (("send", "command", "queue"), ("publish", "event", "topic")):
        p = sub.add_parser(name, help=f"{name} one {kind} (JSON) to a {noun}")
        p.add_argument("destination", metavar=noun.upper())
        p.add_argument("payload", metavar="JSON", help="the body as JSON, or - to read it from stdin, or @FILE")
        p.add_argument(
            "--create",
            action="store_true",
            help=f"declare the {noun} if it does not exist (otherwise an unknown name is refused: typos)",
        )
        p.add_argument("--key", default=None, help="partition/ordering key")
        p.add_argument("--type", default=None, help="payload type name recorded in the envelope")
        p.add_argument("--idempotency-key", default=None, help="drop repeats of this key within the dedup window")
        _connection_options(p)
        p.set_defaults(func=_cmd_produce(kind))

    server = sub.add_parser("server", help="manage the embedded Valkey server")
    server.add_argument("action", choices=("start", "stop", "status"))
    server.add_argument("--data-dir", default=None, help="default: $FRAMEWORK_HOME/valkey")
    server.set_defaults(func=_cmd_server)

    _register_extensions(sub)
    return parser


def _register_extensions(sub: Any) -> None:
    """Sub-commands that live beside their feature (dead letters, outbox)."""
    for module_name in ("framework.cli.dead_letters", "framework.cli.outbox"):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        module.register(sub, _connection_options, UsageError)


def _reportable() -> tuple[type[BaseException], ...]:
    """Errors shown as one line (no traceback): they say what was wrong and how to fix it."""
    from redis.exceptions import NoPermissionError  # ACL refusals on connections broker.connect did not make

    errors: tuple[type[BaseException], ...] = (BrokerError, HandlerError, NoPermissionError)
    try:
        from framework.sql import DatabaseUnavailable
    except ImportError:  # the sql extra is not installed
        return errors
    return (*errors, DatabaseUnavailable)


def _cause(group: BaseExceptionGroup) -> BaseException:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _cause(exc)
        if isinstance(exc, (UsageError, KeyboardInterrupt, *_reportable())):
            return exc
    return group


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``framework`` and ``python -m framework``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        configure_logging(getattr(args, "log_level", None), getattr(args, "log_format", None))
    except ValueError as exc:  # FRAMEWORK_LOG_LEVEL/FORMAT (the options are checked by the parser)
        print(f"framework {args.command}: error: {exc}", file=sys.stderr)
        return 2
    try:
        try:
            return int(args.func(args) or 0)
        except BaseExceptionGroup as group:  # raised through task groups: report the cause
            raise _cause(group) from None
    except UsageError as exc:
        print(f"framework {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except _reportable() as exc:
        print(f"framework {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
