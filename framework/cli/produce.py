"""``framework send QUEUE JSON`` and ``framework publish TOPIC JSON``: one message from the command line.

An unknown destination is refused (a typo would create one that nobody consumes) unless
``--create`` declares it; the body comes from the argument, stdin (``-``) or a file (``@FILE``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import anyio

from broker.envelope import Kind
from broker.errors import transport_errors
from framework._near import did_you_mean, listed
from framework.cli.args import duration
from framework.cli.common import UsageError, connection_options, json_payload

__all__ = ["register"]


def _produce(kind: Kind) -> Callable[[argparse.Namespace], int]:
    """The command that sends (``kind`` command) or publishes (``kind`` event) one message."""

    def run(args: argparse.Namespace) -> int:
        from framework.client import Client

        payload = json_payload(args.payload)

        async def go() -> str | None:
            async with Client(args.redis_url, namespace=args.namespace) as client:
                if not args.create:
                    from broker.codec import check_body_size
                    from framework._messages import build_envelope

                    # an oversized body gets its own error first, whatever the destination
                    check_body_size(build_envelope(args.destination, kind, payload)[0], client.broker.max_body_bytes)
                    await _require_known(client.broker, args.destination, kind)
                method = client.send if kind == "command" else client.publish
                return await method(
                    args.destination,
                    payload,
                    key=args.key,
                    type=args.type,
                    idempotency_key=args.idempotency_key,
                    message_id=args.message_id,
                    delay=args.delay,
                    create=True,  # checked above (or --create)
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
    noun = "queue" if kind == "command" else "topic"
    try:
        known = [s.name for s in await broker.list_destinations() if s.kind == kind]
    except transport_errors():  # a producer's ACL need not list destinations (HGETALL: NOPERM)
        raise UsageError(f"unknown {noun} {name!r}; pass --create to declare it") from None
    hint = did_you_mean(name, known)
    raise UsageError(f"unknown {noun} {name!r}{hint}; known {noun}s: {listed(known)}; pass --create to declare it")


def register(sub: Any) -> None:
    """Add ``send`` (a command to a queue) and ``publish`` (an event to a topic) to the ``framework`` command."""
    verbs: tuple[tuple[str, Kind, str], ...] = (("send", "command", "queue"), ("publish", "event", "topic"))
    for name, kind, noun in verbs:
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
        p.add_argument(
            "--message-id",
            default=None,
            help="the message id (default: a new UUIDv7); a repeat of an id already processed is dropped by "
            "the consumers' inbox",
        )
        p.add_argument(
            "--delay",
            type=duration,
            default=None,
            metavar="DURATION",
            help="deliver after this long, e.g. 30, 90s, 10m, 2h (a scheduled message)",
        )
        connection_options(p)
        p.set_defaults(func=_produce(kind))
