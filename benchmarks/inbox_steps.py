"""The server's time per message of each step of a drain, the inbox on and off, one step at a time.

    python -m benchmarks inbox-steps [--messages 50000] [--batch 500]

Not part of the default run (issue #33). A backlog is sent with ``Client.send_many``; then, each
step alone over the whole backlog, ``batch`` entries per call: the read (``read``), the inbox
claim (``inbox_claim``, inbox on only) and the ack (``ack``, recording the ids with the inbox on).
``INFO commandstats`` before and after each step gives the server's time per message, in all and
by command (a script's ``fcall`` time includes the commands it calls; the rest is its Lua).
``INFO`` counts every client's commands: run it on the embedded server (no ``REDIS_URL``) or a
quiet one. It works in a namespace of its own and deletes it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import anyio

from broker import Delivery, connect
from broker.protocol import DestinationSpec
from framework import Client
from framework.testing import delete_namespace, unique_namespace

__all__ = ["STEPS", "main", "steps"]

STEPS = ("read", "claim", "ack")
_WINDOW_MS = 7 * 24 * 3600 * 1000
_SCRIPTS = ("fcall", "fcall_ro", "evalsha", "eval")  # what a script call is counted as


def _usec(stats: dict[str, Any]) -> dict[str, tuple[int, int]]:
    return {k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for k, v in stats.items()}


def _delta(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> dict[str, int]:
    out = {}
    for name, (calls, usec) in after.items():
        c0, u0 = before.get(name, (0, 0))
        if calls > c0:
            out[name] = usec - u0
    return out


async def steps(
    url: str, messages: int, batch: int, inbox: bool, namespace: str | None = None
) -> dict[str, dict[str, float]]:
    """Each step's server µs per message: ``{"read": {"total": .., "<command>": .., "lua": ..}, ...}``
    (no ``claim`` with the inbox off), in ``namespace`` (default a new one), deleted after."""
    namespace = namespace or unique_namespace("bench-steps")
    broker = await connect(url, namespace=namespace)
    try:
        spec = await broker.declare(DestinationSpec("steps.q", "command"))
        [view] = await broker.subscribe(spec, "g")
        async with Client(url, namespace=namespace) as client:
            for first in range(0, messages, 5000):
                body = [{"seq": n, "pad": "xxxxxxxx"} for n in range(first, min(first + 5000, messages))]
                await client.send_many("steps.q", body)
        channel = broker.channel()
        got: list[Delivery] = []
        out: dict[str, dict[str, float]] = {}

        async def read() -> None:
            while len(got) < messages:
                got.extend(await broker.read(view, "steps", batch, 0, channel=channel))

        async def claim() -> None:
            for i in range(0, len(got), batch):
                await broker.inbox_claim(view, got[i : i + batch], 60_000, channel=channel, window_ms=_WINDOW_MS)

        async def ack() -> None:
            for i in range(0, len(got), batch):
                await broker.ack(view, got[i : i + batch], inbox=inbox, channel=channel)

        for name, step in (("read", read), ("claim", claim), ("ack", ack)):
            if name == "claim" and not inbox:
                continue
            before = _usec(await broker.redis.info("commandstats"))
            await step()
            spent = _delta(before, _usec(await broker.redis.info("commandstats")))
            scripts = sum(u for c, u in spent.items() if c in _SCRIPTS)
            plain = sum(u for c, u in spent.items() if c not in _SCRIPTS and c != "info")
            # A script's time includes the commands it calls: a step of scripts is their time,
            # else the commands' (the read is plain XREADGROUP calls).
            total = scripts or plain
            row = {"total": total / messages}
            row.update({c: u / messages for c, u in spent.items() if c != "info" and u / messages >= 0.01})
            if scripts:
                row["lua"] = max(0.0, (scripts - plain) / messages)
            out[name] = row
        if channel is not None:
            await channel.aclose()
        return out
    finally:
        await broker.close()
        delete_namespace(url, namespace)


def main(url: str, argv: Sequence[str]) -> int:
    """Run the steps with the inbox on, then off, and print µs of server time per message."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks inbox-steps", description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=50_000, help="backlog (default 50000)")
    parser.add_argument("--batch", type=int, default=500, help="entries per call (default 500, the prefetch)")
    args = parser.parse_args(argv)
    if args.messages < 1 or args.batch < 1:
        parser.error("--messages and --batch must be at least 1")
    print(f"server µs per message, {args.messages:,} messages, {args.batch} per call")
    for inbox in (True, False):
        result = anyio.run(steps, url, args.messages, args.batch, inbox)
        for name in STEPS:
            if name not in result:
                continue
            row = result[name]
            parts = ", ".join(f"{c} {v:.2f}" for c, v in row.items() if c != "total")
            print(f"  inbox {'on ' if inbox else 'off'} {name:<5} {row['total']:6.2f}   {parts}")
    return 0
