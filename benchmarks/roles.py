"""Programs the latency benchmark runs in child processes: a paced producer and the raw consumer.

    python -m benchmarks.roles produce --mode framework|raw --url URL --namespace NS --rate 500 --count N
    python -m benchmarks.roles raw-consume --url URL --namespace NS --count N

The producer sends ``count`` messages at ``rate`` per second on a monotonic schedule (message i is
due at start + i/rate, so a late send does not shift the ones after it), each stamped with
``time.time_ns()`` just before it is handed to the client. ``framework`` mode sends commands one
by one with :class:`framework.Client` to the latency queue; ``raw`` mode XADDs the same fields with
plain redis-py to a stream of its own. The raw consumer is the ceiling's other half: XREADGROUP
BLOCK, COUNT 500, one XACK per batch, recording ``time.time_ns() - sent_ns`` per entry.
"""

from __future__ import annotations

import argparse
import time
import uuid
from array import array

import anyio
import orjson
import redis

from benchmarks.bench_services import LATENCY, BenchMessage, body, done_key, latency_key

__all__ = ["RAW_GROUP", "main", "raw_stream", "raw_xadd"]

RAW_GROUP = "raw"


def raw_stream(namespace: str) -> str:
    """The stream of the raw latency path."""
    return f"{namespace}:raw-latency"


def raw_xadd(stream: str, seq: int) -> tuple[str | bytes | int, ...]:
    """The XADD of message ``seq`` with the framework's fields (id, type, body, ts), stamped now."""
    return (
        "XADD",
        stream,
        "*",
        "id",
        str(uuid.uuid4()),
        "type",
        "BenchMessage",
        "body",
        body(seq, time.time_ns()),
        "ts",
        time.time_ns() // 1_000_000,
    )


async def _produce_framework(url: str, namespace: str, rate: float, count: int) -> float:
    from framework import Client

    async with Client(url, namespace=namespace) as client:
        await client.broker.declare(LATENCY.spec())
        start = time.monotonic()
        for i in range(count):
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                await anyio.sleep(delay)
            await client.send(LATENCY, BenchMessage(i, time.time_ns()))
        return count / (time.monotonic() - start)


def _produce_raw(url: str, namespace: str, rate: float, count: int) -> float:
    client = redis.Redis.from_url(url, protocol=2)
    stream = raw_stream(namespace)
    try:
        start = time.monotonic()
        for i in range(count):
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            client.execute_command(*raw_xadd(stream, i))
        return count / (time.monotonic() - start)
    finally:
        client.close()


def _raw_consume(url: str, namespace: str, count: int) -> None:
    client = redis.Redis.from_url(url, protocol=2)
    client.set_response_callback("XREADGROUP", lambda response, **_: response)
    stream = raw_stream(namespace)
    latencies: array[int] = array("q")
    seqs: array[int] = array("q")
    first_ns = 0
    try:
        # its own pending entries first, as a consumer starts: this also registers the consumer
        # (Redis 7.0 does not register one that only waits on ">"), which the benchmark waits for
        client.execute_command("XREADGROUP", "GROUP", RAW_GROUP, "c1", "COUNT", 500, "STREAMS", stream, "0")
        while len(latencies) < count:
            reply = client.execute_command(
                "XREADGROUP", "GROUP", RAW_GROUP, "c1", "COUNT", 500, "BLOCK", 1000, "STREAMS", stream, ">"
            )
            if not reply:
                continue
            entries = reply[0][1]
            for _, flat in entries:
                payload = orjson.loads(flat[5])  # fields: id, type, body, ts
                now = time.time_ns()
                first_ns = first_ns or now
                latencies.append(now - payload["sent_ns"])
                seqs.append(payload["seq"])
            client.xack(stream, RAW_GROUP, *(e[0] for e in entries))
        pairs = [f"{s}:{v}" for s, v in zip(seqs, latencies, strict=True)]
        pipe = client.pipeline(transaction=False)
        for i in range(0, len(pairs), 10_000):
            pipe.rpush(latency_key(namespace), *pairs[i : i + 10_000])
        pipe.lpush(done_key(namespace), orjson.dumps({"first_ns": first_ns, "last_ns": time.time_ns()}))
        pipe.execute()
    finally:
        client.close()


def main() -> None:
    """Entry point: ``produce`` or ``raw-consume``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.roles", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="role", required=True)
    produce = sub.add_parser("produce")
    produce.add_argument("--mode", choices=("framework", "raw"), required=True)
    consume = sub.add_parser("raw-consume")
    for p in (produce, consume):
        p.add_argument("--url", required=True)
        p.add_argument("--namespace", required=True)
        p.add_argument("--count", type=int, required=True)
    produce.add_argument("--rate", type=float, default=500.0)
    args = parser.parse_args()
    if args.role == "raw-consume":
        _raw_consume(args.url, args.namespace, args.count)
        return
    if args.mode == "framework":
        achieved = anyio.run(_produce_framework, args.url, args.namespace, args.rate, args.count)
    else:
        achieved = _produce_raw(args.url, args.namespace, args.rate, args.count)
    print(orjson.dumps({"achieved_rate": achieved}).decode())


if __name__ == "__main__":
    main()
