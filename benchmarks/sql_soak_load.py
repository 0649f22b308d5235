"""The load of the SQL-effects soak (:mod:`benchmarks.sql_soak`): its options, and the publisher
that offers a steady rate of good, failing and malformed messages and keeps a ledger of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import anyio
import attrs

from benchmarks import sql_bench
from benchmarks.sql_services import SQL_QUEUE, SqlMessage, stream_key
from broker import COMMAND
from broker.ids import new_id
from framework import Client
from framework._messages import build_envelope

__all__ = ["TICK_S", "Ledger", "Options", "Progress", "publish"]

TICK_S = 0.05

Progress = Callable[[str], None]


@attrs.frozen
class Options:
    """What the soak does: how long, how fast (None: 80% of the measured capacity), how many workers."""

    minutes: float = 20.0
    rate: float | None = None
    workers: int = 3
    fail_every: int = 100  # 1 in 100 messages always fails
    malformed_every: int = 200  # 1 in 200 is malformed
    kill_every: tuple[float, float] = (20.0, 40.0)
    reset_every: float = 60.0
    capacity_messages: int = 3000
    drain_timeout: float = 180.0
    kind: str = "framework"


def _kind(seq: int, options: Options) -> str:
    if seq % options.malformed_every == options.malformed_every - 1:
        return "malformed"
    if seq % options.fail_every == options.fail_every // 2:
        return "fail"
    return "good"


class Ledger:
    """What the publisher sent, by kind: sequence numbers of good and failing messages, bad message ids."""

    def __init__(self) -> None:
        self.sent = 0
        self.good: set[int] = set()
        self.fail_seqs: set[int] = set()
        self.bad_ids: set[str] = set()  # failing and malformed: all must reach the dead-letter stream
        self.good_ids: set[str] = set()
        self.publish_retries = 0


_MALFORMED_BODIES = (None, b"{not json", b'{"nope": 1}')


async def publish(url: str, namespace: str, rate: float, seconds: float, options: Options, ledger: Ledger) -> None:
    """Offer ``rate`` msg/s for ``seconds``; a failed publish is repeated with the same ids until it succeeds."""
    stream = stream_key(namespace)
    async with Client(url, namespace=namespace) as client:
        broker = client.broker
        await broker.declare(SQL_QUEUE.spec())
        began = time.monotonic()
        seq = 0
        while (now := time.monotonic()) - began < seconds:
            due = int((now - began) * rate)
            envelopes, raw = [], []
            for s in range(seq, due):
                kind = _kind(s, options)
                if kind == "malformed":
                    mid = new_id()
                    fields: list[Any] = ["id", mid, "type", "SqlMessage", "ts", time.time_ns() // 1_000_000]
                    body = _MALFORMED_BODIES[(s // options.malformed_every) % len(_MALFORMED_BODIES)]
                    if body is not None:
                        fields += ["body", body]
                    raw.append(fields)
                    ledger.bad_ids.add(mid)
                    continue
                msg = SqlMessage(s, time.time_ns(), fail=kind == "fail")
                env, _ = build_envelope(SQL_QUEUE, COMMAND, msg, key=str(s % sql_bench.KEYS))
                envelopes.append(env)
                if kind == "fail":
                    ledger.fail_seqs.add(s)
                    ledger.bad_ids.add(env.id)
                else:
                    ledger.good.add(s)
                    ledger.good_ids.add(env.id)
            while envelopes or raw:
                try:
                    if envelopes:
                        await broker.publish(envelopes)
                        envelopes = []
                    for fields in list(raw):
                        await broker.redis.execute_command("XADD", stream, "*", *fields)
                        raw.remove(fields)
                except Exception:
                    ledger.publish_retries += 1
                    await anyio.sleep(0.05)
            ledger.sent = due
            seq = due
            await anyio.sleep(TICK_S)
