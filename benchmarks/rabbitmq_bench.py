"""``python -m benchmarks.rabbitmq_bench``: the RabbitMQ transport next to raw aio-pika and FastStream, same run.

    python -m benchmarks.rabbitmq_bench [--messages 20000] [--rounds 2] [--url amqp://...]

Consume: one worker process per contender, each draining its own quorum queue of ``--messages``
prefilled messages with a per-message handler (the framework: ``framework run`` with a no-op
``inbox=False`` handler; raw: an aio-pika consume-and-ack loop acking each message, and
raw-batched: one ``multiple`` ack per 100, as the transport batches its acks; FastStream: a
``RabbitBroker`` subscriber acking after its handler), each with prefetch 1000. A rate is measured from the first
handled message to the last, so start-up does not count. Publish: the framework's ``publish`` (confirmed, mandatory)
next to raw aio-pika publishes with confirms, both in batches of 100 on one channel. Ratios are to
the raw figures of the same round; rounds alternate the order. The server is ``--url`` (default
``$RABBITMQ_URL``, else the local guest account); the run works in a virtual host of its own
(``rabbitmqctl``), deleted after.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from framework import Context, Queue, Service

__all__ = ["main", "service"]

PREFETCH = 1000
QUEUE = Queue("bench.jobs")

service = Service("bench", inbox=False)
_seen = {"n": 0, "first": 0.0}


@service.command(QUEUE)
async def handle(cmd: dict, ctx: Context) -> None:
    """A per-message handler doing nothing: what the framework costs per message."""
    _record()


def _record() -> None:
    """Count a handled message; at the last one write the first and last times to ``$BENCH_OUT``."""
    now = time.perf_counter()
    _seen["n"] += 1
    if _seen["n"] == 1:
        _seen["first"] = now
    if _seen["n"] == int(os.environ["BENCH_MESSAGES"]):
        Path(os.environ["BENCH_OUT"]).write_text(f"{_seen['first']} {now}")


# -- contenders (each a process of its own) -------------------------------------------------------


async def _raw_consumer(url: str, queue: str, batched: bool = False) -> None:
    """Consume and ack each message (``batched``: one ``multiple`` ack per 100, as the transport batches)."""
    import aio_pika

    connection = await aio_pika.connect(url)
    channel = await connection.channel()
    await channel.set_qos(prefetch_count=PREFETCH)
    found = await channel.declare_queue(queue, passive=True)
    done = asyncio.Event()

    total = int(os.environ["BENCH_MESSAGES"])

    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        _record()
        if not batched:
            await message.ack()
        elif _seen["n"] % 100 == 0 or _seen["n"] >= total:
            await message.ack(multiple=True)
        if _seen["n"] >= total:
            done.set()

    await found.consume(on_message)
    await done.wait()
    await connection.close()


async def _faststream_consumer(url: str, queue: str) -> None:
    from faststream.middlewares import AckPolicy
    from faststream.rabbit import Channel, QueueType, RabbitBroker, RabbitQueue

    broker = RabbitBroker(url, logger=None)
    done = asyncio.Event()

    @broker.subscriber(
        RabbitQueue(queue, queue_type=QueueType.QUORUM, declare=False),
        channel=Channel(prefetch_count=PREFETCH),
        ack_policy=AckPolicy.ACK,
    )
    async def on_message(body: dict) -> None:
        _record()
        if _seen["n"] >= int(os.environ["BENCH_MESSAGES"]):
            done.set()

    await broker.start()
    await done.wait()
    await broker.stop()


# -- the run ------------------------------------------------------------------------------------


def _vhost_url(base: str) -> tuple[str, str]:
    name = f"fw-bench-{uuid.uuid4().hex[:8]}"
    user = urlsplit(base).username or "guest"
    subprocess.run(["rabbitmqctl", "-q", "add_vhost", name], check=True, capture_output=True)
    subprocess.run(["rabbitmqctl", "-q", "set_permissions", "-p", name, user, ".*", ".*", ".*"], check=True)
    return name, urlunsplit(urlsplit(base)._replace(path=f"/{name}"))


async def _fill_raw(url: str, queue: str, n: int, arguments: dict) -> float:
    """Declare ``queue`` (quorum) and publish ``n`` JSON bodies with confirms in batches of 100; msgs/s."""
    import aio_pika

    connection = await aio_pika.connect(url)
    channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
    await channel.declare_queue(queue, durable=True, arguments=arguments)
    started = time.perf_counter()
    for i in range(0, n, 100):
        batch = [
            channel.default_exchange.publish(
                aio_pika.Message(b'{"n": %d}' % j, message_id=str(j), content_type="application/json"), queue
            )
            for j in range(i, min(i + 100, n))
        ]
        await asyncio.gather(*batch)
    rate = n / (time.perf_counter() - started)
    await connection.close()
    return rate


async def _fill_framework(url: str, namespace: str, n: int) -> float:
    """Publish ``n`` commands through the framework's broker in batches of 100; msgs/s."""
    from broker import Envelope, connect

    broker = await connect(url, namespace=namespace)
    try:
        await broker.declare(QUEUE.spec())
        started = time.perf_counter()
        for i in range(0, n, 100):
            await broker.publish(
                [Envelope(QUEUE.name, "command", "dict", b'{"n": %d}' % j) for j in range(i, min(i + 100, n))]
            )
        return n / (time.perf_counter() - started)
    finally:
        await broker.close()


def _consume(role: str, url: str, queue: str, namespace: str, n: int) -> float:
    """Run one contender's worker process until it handled ``n`` messages; its msgs/s."""
    out = Path(tempfile.mkstemp(prefix=f"bench-{role}-")[1])
    out.unlink()
    env = {**os.environ, "BENCH_MESSAGES": str(n), "BENCH_OUT": str(out), "FRAMEWORK_LOG_LEVEL": "warning"}
    if role == "framework":
        env.update(BROKER_URL=f"{url}?prefetch={PREFETCH}", FRAMEWORK_NAMESPACE=namespace)
        args = ["-m", "framework", "run", "benchmarks.rabbitmq_bench:service", "--consumer", "bench"]
    else:
        args = ["-m", "benchmarks.rabbitmq_bench", "--role", role, "--url", url, "--queue", queue]
    proc = subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 600
        while not out.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{role} consumer ended early: {proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.05)
        first, last = (float(x) for x in out.read_text().split())
    finally:
        proc.terminate()
        proc.wait(30)
        out.unlink(missing_ok=True)
    return (n - 1) / (last - first)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.rabbitmq_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/"))
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--role", choices=("raw", "raw-batched", "faststream"), help=argparse.SUPPRESS)
    parser.add_argument("--queue", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role:
        if args.role == "faststream":
            asyncio.run(_faststream_consumer(args.url, args.queue))
        else:
            asyncio.run(_raw_consumer(args.url, args.queue, batched=args.role == "raw-batched"))
        return 0
    med = run(args.url, messages=args.messages, rounds=args.rounds)
    print(f"RabbitMQ transport benchmark: {args.messages} messages, {args.rounds} rounds (medians)")
    cpu = platform.processor() or platform.machine()
    print(f"machine: {os.cpu_count()} cores, {cpu}, Python {platform.python_version()}")
    for kind in ("consume", "publish"):
        raw = med[f"{kind} raw"]
        for name in ("raw", "raw-batched", "framework", "faststream"):
            key = f"{kind} {name}"
            if key in med:
                print(f"  {key:22s} {med[key]:>10,.0f} msgs/s   {med[key] / raw:6.2f} x raw")
    return 0


def run(url: str, *, messages: int = 20_000, rounds: int = 2) -> dict[str, float]:
    """Every contender's median msgs/s (``consume <name>``, ``publish <name>``), in a vhost of its own
    (deleted after); what ``python -m benchmarks --only rabbitmq`` reports."""
    vhost, url = _vhost_url(url)
    quorum = {"x-queue-type": "quorum", "x-delivery-limit": 50, "x-overflow": "reject-publish"}  # as the transport's
    results: dict[str, list[float]] = {}
    try:
        for r in range(rounds):
            order = ("framework", "raw", "raw-batched", "faststream")
            order = order if r % 2 == 0 else order[::-1]
            namespace = f"bench{r}"
            publish = {
                "framework": asyncio.run(_fill_framework(url, namespace, messages)),
                "raw": asyncio.run(_fill_raw(url, f"raw{r}", messages, quorum)),
            }
            for other in ("faststream", "raw-batched"):
                asyncio.run(_fill_raw(url, f"{other}{r}", messages, quorum))
            for name, rate in publish.items():
                results.setdefault(f"publish {name}", []).append(rate)
            for role in order:
                queue = f"{role}{r}" if role != "framework" else ""
                rate = _consume(role, url, queue, namespace, messages)
                results.setdefault(f"consume {role}", []).append(rate)
    finally:
        subprocess.run(["rabbitmqctl", "-q", "delete_vhost", vhost], check=False, capture_output=True)
    return {k: statistics.median(v) for k, v in results.items()}


if __name__ == "__main__":
    raise SystemExit(main())
