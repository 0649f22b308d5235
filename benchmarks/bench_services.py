"""Services the benchmark worker runs: per-message async handlers that only count what they receive.

A worker is ``python -m framework run benchmarks.bench_services:<NAME>``, told through its environment
where to report (``BENCH_REDIS_URL``, ``BENCH_NAMESPACE``), how many messages each handler is to
expect (``BENCH_EXPECT``) and how many handlers it runs (``BENCH_HANDLERS``). A handler touches
nothing but a counter in this process; Redis hears from the worker once, when every handler has seen
its count: one ``LPUSH`` of a JSON summary (first and last handler start, Unix ns) to
``<ns>:bench:done``, which the benchmark waits on with ``BLPOP``.
So the measured loop is the framework's own: fetch, decode into an attrs class, run, ack.

The latency handler (``latency``, inbox on; ``latency_no_inbox``, off) also keeps ``time.time_ns() -
sent_ns`` of each message, taken first thing in the handler, and writes the samples to
``<ns>:bench:latency`` at the end (one pipeline).
"""

from __future__ import annotations

import os
import time
from array import array

import attrs
import orjson
import redis.asyncio as aredis

from framework import BatchPolicy, Queue, Service, Topic

__all__ = [
    "COMMANDS",
    "EVENTS",
    "LATENCY",
    "BenchMessage",
    "body",
    "commands",
    "commands_batch",
    "commands_no_inbox",
    "done_key",
    "event_services",
    "latency",
    "latency_key",
    "latency_no_inbox",
]

COMMANDS = Queue("bench.commands")
EVENTS = Topic("bench.events")
LATENCY = Queue("bench.latency")


@attrs.frozen
class BenchMessage:
    """The payload every benchmark message carries (its JSON body is about 60 bytes)."""

    seq: int
    sent_ns: int
    pad: str = "xxxxxxxx"


def body(seq: int, sent_ns: int) -> bytes:
    """The JSON body of a :class:`BenchMessage`, byte for byte what the framework writes."""
    return orjson.dumps({"seq": seq, "sent_ns": sent_ns, "pad": "xxxxxxxx"})


def done_key(namespace: str) -> str:
    """List the worker pushes its summary to when every handler has seen its count."""
    return f"{namespace}:bench:done"


def latency_key(namespace: str) -> str:
    """List of ``seq:latency_ns`` samples written by the latency handler."""
    return f"{namespace}:bench:latency"


class _Tally:
    """Counts per handler in this process and reports once, when every handler reached its count."""

    def __init__(self) -> None:
        self.expect = int(os.environ.get("BENCH_EXPECT", "0"))
        self.namespace = os.environ.get("BENCH_NAMESPACE", "")
        self.url = os.environ.get("BENCH_REDIS_URL", "")
        self.handlers = int(os.environ.get("BENCH_HANDLERS", "1"))
        self.finished = 0
        self.first_ns = 0
        self.last_ns = 0
        self.samples: array[int] = array("q")
        self.seqs: array[int] = array("q")

    async def finish_one(self, now_ns: int) -> None:
        self.finished += 1
        self.last_ns = max(self.last_ns, now_ns)
        if self.finished < self.handlers:
            return
        client = aredis.Redis.from_url(self.url, protocol=2)
        try:
            if self.samples:
                pipe = client.pipeline(transaction=False)
                pairs = [f"{s}:{v}" for s, v in zip(self.seqs, self.samples, strict=True)]
                for i in range(0, len(pairs), 10_000):
                    pipe.rpush(latency_key(self.namespace), *pairs[i : i + 10_000])
                await pipe.execute()
            summary = {
                "first_ns": self.first_ns,
                "last_ns": self.last_ns,
                "handlers": self.handlers,
                "expect": self.expect,
                "pid": os.getpid(),
            }
            await client.lpush(done_key(self.namespace), orjson.dumps(summary))
        finally:
            await client.aclose()


class _Counter:
    """One handler's count."""

    __slots__ = ("count", "tally")

    def __init__(self, tally: _Tally) -> None:
        self.tally = tally
        self.count = 0

    async def hit(self) -> None:
        """Count one message; report when this handler reached the expected count."""
        self.count += 1
        if self.count == 1:
            now = time.time_ns()
            if self.tally.first_ns == 0 or now < self.tally.first_ns:
                self.tally.first_ns = now
        if self.count == self.tally.expect:
            await self.tally.finish_one(time.time_ns())

    async def hit_many(self, k: int) -> None:
        """Count ``k`` messages (a batch); report when this handler reached the expected count."""
        before, self.count = self.count, self.count + k
        if before == 0:
            now = time.time_ns()
            if self.tally.first_ns == 0 or now < self.tally.first_ns:
                self.tally.first_ns = now
        if before < self.tally.expect <= self.count:
            await self.tally.finish_one(time.time_ns())


_tally = _Tally()


def _counting_service(name: str, destination: Queue | Topic, *, inbox: bool = True) -> Service:
    service = Service(name, inbox=inbox)
    counter = _Counter(_tally)

    async def handle(message: BenchMessage) -> None:
        await counter.hit()

    if isinstance(destination, Queue):
        service.command(destination)(handle)
    else:
        service.event(destination)(handle)
    return service


commands = _counting_service("bench-commands", COMMANDS)
"""Commands with the inbox on (the framework's default)."""

commands_batch = Service("bench-commands-batch")
"""The same commands to a batch handler (inbox on): up to 500 per call (issue #35)."""
_batch_counter = _Counter(_tally)


@commands_batch.command(COMMANDS, batch=BatchPolicy(max_size=500, max_wait=0.05))
async def handle_batch(messages: list[BenchMessage]) -> None:
    """Count a batch of commands."""
    await _batch_counter.hit_many(len(messages))


commands_no_inbox = _counting_service("bench-commands-noinbox", COMMANDS, inbox=False)
"""The same commands with the inbox off."""

event_services = [_counting_service(f"bench-events-{g}", EVENTS) for g in ("a", "b", "c")]
"""Three services subscribed to one topic: three consumer groups (run with ``BENCH_HANDLERS=3``)."""

latency = Service("bench-latency")
_latency_counter = _Counter(_tally)


@latency.command(LATENCY)
async def timed(message: BenchMessage) -> None:
    """Record how long ago the producer stamped the message, first thing in the handler."""
    now = time.time_ns()
    _tally.samples.append(now - message.sent_ns)
    _tally.seqs.append(message.seq)
    await _latency_counter.hit()


latency_no_inbox = Service("bench-latency-noinbox", inbox=False)
"""The same latency handler with the inbox off (a worker runs one of the two, so they share the counter)."""
latency_no_inbox.command(LATENCY)(timed)
