"""Runtime benchmarks: one worker process against the raw redis-py ceiling measured beside it.

Each function below is one trial in a fresh namespace (deleted afterwards) and returns plain
numbers; ``python -m benchmarks`` repeats them and reports medians.

* :func:`raw_ceiling`: sync redis-py, no framework. Fill ``n`` entries with pipelined XADD (the
  framework's field layout: id, type, ~60-byte JSON body, ts), then drain them with XREADGROUP
  COUNT 500 and one XACK per batch (variant ``delete``: XACK and XDEL in one pipeline per batch, as
  the framework's queues delete acknowledged entries). Replies are left unparsed, as the broker does.
* :func:`commands`: ``n`` commands sent with ``Client.send_many`` (5,000 per call), then drained by
  ONE ``python -m framework run`` worker with a per-message async handler that only counts.
* :func:`events`: ``n`` events on one topic drained by three services (three groups) in one worker.
* :func:`latency` / :func:`raw_latency`: a producer process at a fixed rate, publish to handler start.
* :func:`memory`: peak RSS of the worker draining a pre-filled backlog.

Throughput runs from the first handler start (taken in the worker) to the moment the benchmark
sees every entry acknowledged (XINFO GROUPS pending 0, polled every millisecond once the worker
reported its last message), so worker start-up is left out and the final acks are counted in.
"""

from __future__ import annotations

import functools
import math
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
import orjson
import redis

from benchmarks.bench_services import COMMANDS, EVENTS, LATENCY, BenchMessage, body, done_key, latency_key
from benchmarks.procs import Child, RssSampler, child
from benchmarks.roles import RAW_GROUP, raw_stream
from broker import Envelope, connect
from broker.codec import encode_fields
from framework import Client
from framework.testing import delete_namespace, unique_namespace

__all__ = [
    "FILL_BATCH",
    "Progress",
    "commands",
    "events",
    "latency",
    "memory",
    "percentile",
    "raw_ceiling",
    "raw_latency",
]

FILL_BATCH = 5000  # messages per pipeline when filling a stream
FRAMEWORK = ("-m", "framework")  # how a worker starts: python -m framework run ...
Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def _raw_client(url: str) -> redis.Redis:
    client = redis.Redis.from_url(url, protocol=2)  # RESP2 like the broker (redis-py 8 defaults to RESP3)
    for command in ("XREADGROUP", "XINFO GROUPS"):  # like the broker: no per-entry dicts from redis-py
        client.set_response_callback(command, lambda response, **_: response)
    return client


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0..100) of already sorted values."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return float(sorted_values[rank - 1])


# -- raw redis-py ceiling ----------------------------------------------------------------------------------


def raw_ceiling(url: str, n: int, *, delete: bool = False, progress: Progress = _quiet) -> dict[str, Any]:
    """Fill ``n`` entries with pipelined XADD, drain with XREADGROUP COUNT 500 + one XACK per batch."""
    namespace = unique_namespace("bench")
    client = _raw_client(url)
    stream = f"{namespace}:raw"
    try:
        client.xgroup_create(stream, "g", id="0", mkstream=True)
        started = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for i in range(n):
            pipe.execute_command(
                "XADD",
                stream,
                "*",
                "id",
                str(uuid.uuid4()),
                "type",
                "BenchMessage",
                "body",
                body(i, time.time_ns()),
                "ts",
                time.time_ns() // 1_000_000,
            )
            if len(pipe) >= FILL_BATCH:
                pipe.execute()
        pipe.execute()
        fill_s = time.perf_counter() - started
        progress(f"raw: filled {n:,} entries in {fill_s:.1f}s; draining{' (XACK+XDEL)' if delete else ''}")
        drained = 0
        started = time.perf_counter()
        while True:
            reply = client.execute_command("XREADGROUP", "GROUP", "g", "c", "COUNT", 500, "STREAMS", stream, ">")
            if not reply or not reply[0][1]:
                break
            ids = [entry_id for entry_id, _ in reply[0][1]]
            if delete:
                ack = client.pipeline(transaction=False)
                ack.xack(stream, "g", *ids)
                ack.xdel(stream, *ids)
                ack.execute()
            else:
                client.xack(stream, "g", *ids)
            drained += len(ids)
        drain_s = time.perf_counter() - started
        if drained != n:
            raise RuntimeError(f"raw drain read {drained} entries, expected {n}")
        return {"n": n, "fill_msgs_per_s": n / fill_s, "drain_msgs_per_s": n / drain_s}
    finally:
        client.close()
        delete_namespace(url, namespace)


# -- one framework worker ---------------------------------------------------------------------------------


def _worker(
    target: str,
    url: str,
    namespace: str,
    *,
    expect: int,
    handlers: int = 1,
    env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    launcher: Sequence[str] = FRAMEWORK,
) -> Any:
    """A context manager running ``python -m framework run TARGET`` as one worker process.

    ``env`` is added to the worker's environment, ``extra_args`` to its command line;
    ``launcher`` replaces ``-m framework`` (the observability benchmark's baseline checkout).
    """
    args = [
        *launcher,
        "run",
        f"benchmarks.bench_services:{target}",
        "--redis-url",
        url,
        "--namespace",
        namespace,
        "--consumer",
        "bench-worker",
        "--log-format",
        "json",
        *extra_args,
    ]
    full_env = {
        **(env or {}),
        "BENCH_REDIS_URL": url,
        "BENCH_NAMESPACE": namespace,
        "BENCH_EXPECT": str(expect),
        "BENCH_HANDLERS": str(handlers),
    }
    return child(f"worker-{target}", args, full_env)


def _group_rows(client: redis.Redis, stream: str) -> list[dict[str, Any]]:
    try:
        reply = client.execute_command("XINFO GROUPS", stream)
    except redis.ResponseError:
        return []
    rows = []
    for row in reply:
        items = row.items() if isinstance(row, dict) else zip(row[::2], row[1::2], strict=True)
        rows.append({(k.decode() if isinstance(k, bytes) else k): v for k, v in items})
    return rows


def _wait_done(
    client: redis.Redis,
    namespace: str,
    worker: Child,
    *,
    stream: str,
    total: int,
    timeout: float,
    label: str,
    progress: Progress,
) -> dict[str, Any]:
    """Block until the worker reports its last message; report progress from the groups meanwhile."""
    deadline = time.monotonic() + timeout
    last_report = time.monotonic()
    while True:
        reply = client.blpop([done_key(namespace)], timeout=1)
        if reply is not None:
            return dict(orjson.loads(reply[1]))
        worker.check()
        now = time.monotonic()
        if now > deadline:
            raise RuntimeError(f"{label}: not done after {timeout:.0f}s; the worker's log ends:\n{worker.log_tail()}")
        if now - last_report >= 5:
            last_report = now
            rows = _group_rows(client, stream)
            done = sum(int(r.get("entries-read") or 0) - int(r.get("pending") or 0) for r in rows)
            progress(f"{label}: {done:,}/{total:,} processed")


def _wait_settled(client: redis.Redis, stream: str, groups: int, timeout: float = 30.0) -> int:
    """Poll XINFO GROUPS every millisecond until ``groups`` groups have nothing pending; return time_ns."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = _group_rows(client, stream)
        if len(rows) >= groups and all(int(r["pending"]) == 0 for r in rows):
            return time.time_ns()
        time.sleep(0.001)
    raise RuntimeError(f"entries of {stream} still pending {timeout:.0f}s after the worker processed them all")


async def _publish_all(url: str, namespace: str, destination: Any, n: int, *, events: bool) -> float:
    async with Client(url, namespace=namespace) as client:
        started = time.perf_counter()
        for start in range(0, n, FILL_BATCH):
            batch = [BenchMessage(i, time.time_ns()) for i in range(start, min(start + FILL_BATCH, n))]
            if events:
                await client.publish_many(destination, batch)
            else:
                await client.send_many(destination, batch)
        return n / (time.perf_counter() - started)


def _drain(
    url: str,
    namespace: str,
    target: str,
    *,
    n: int,
    handlers: int,
    stream: str,
    label: str,
    progress: Progress,
    sample_rss: bool = True,
    env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    launcher: Sequence[str] = FRAMEWORK,
    on_settled: Callable[[], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Drain with one worker; ``on_settled`` runs once all is acknowledged, before the worker stops
    (outside the timed span), and its figures join the result."""
    client = _raw_client(url)
    extra: dict[str, Any] = {}
    worker_cm = _worker(
        target, url, namespace, expect=n, handlers=handlers, env=env, extra_args=extra_args, launcher=launcher
    )
    try:
        with worker_cm as worker, RssSampler(worker.pid) as rss:
            summary = _wait_done(
                client,
                namespace,
                worker,
                stream=stream,
                total=n * handlers,
                timeout=max(120.0, n * handlers / 1000),
                label=label,
                progress=progress,
            )
            settled_ns = _wait_settled(client, stream, handlers)
            if on_settled is not None:
                extra = on_settled()
            status = worker.stop()
        if status not in (0, None):
            raise RuntimeError(f"{label}: the worker exited with status {status} on SIGTERM:\n{worker.log_tail()}")
        seconds = (settled_ns - summary["first_ns"]) / 1e9
        return {
            "seconds": seconds,
            "handled_s": (summary["last_ns"] - summary["first_ns"]) / 1e9,
            "first_ns": summary["first_ns"],  # the timed span, Unix ns
            "settled_ns": settled_ns,
            "peak_rss_mib": rss.peak_kib / 1024 if sample_rss else None,
            "halves_rss_mib": rss.halves_mib(seconds) if sample_rss else None,
            **extra,
        }
    finally:
        client.close()


def commands(
    url: str,
    n: int,
    *,
    inbox: bool = True,
    progress: Progress = _quiet,
    label: str | None = None,
    env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    launcher: Sequence[str] = FRAMEWORK,
    on_settled: Callable[[], dict[str, Any]] | None = None,
    target: str | None = None,
) -> dict[str, Any]:
    """Send ``n`` commands with the client, then drain them with one worker; msgs/s of the drain.

    ``env``, ``extra_args``, ``launcher`` and ``on_settled`` go to the worker (see :func:`_worker`, :func:`_drain`);
    ``target`` names the service of :mod:`benchmarks.bench_services` it runs (default: by ``inbox``).
    """
    namespace = unique_namespace("bench")
    label = label or f"commands (inbox {'on' if inbox else 'off'})"
    try:
        publish_rate = anyio.run(functools.partial(_publish_all, url, namespace, COMMANDS, n, events=False))
        progress(f"{label}: sent {n:,} commands at {publish_rate:,.0f}/s; draining with one worker")
        stream = f"{namespace}:{{{COMMANDS.name}:0}}"
        result = _drain(
            url,
            namespace,
            target or ("commands" if inbox else "commands_no_inbox"),
            n=n,
            handlers=1,
            stream=stream,
            label=label,
            progress=progress,
            env=env,
            extra_args=extra_args,
            launcher=launcher,
            on_settled=on_settled,
        )
        return {
            "n": n,
            "inbox": inbox,
            "publish_msgs_per_s": publish_rate,
            "msgs_per_s": n / result["seconds"],
            **result,
        }
    finally:
        delete_namespace(url, namespace)


def events(url: str, n: int, *, progress: Progress = _quiet) -> dict[str, Any]:
    """Publish ``n`` events to a topic with three subscribing services, drained by one worker."""
    namespace = unique_namespace("bench")
    label = "events (3 groups)"
    try:
        publish_rate = anyio.run(functools.partial(_publish_all, url, namespace, EVENTS, n, events=True))
        progress(f"{label}: published {n:,} events at {publish_rate:,.0f}/s; draining with one worker")
        stream = f"{namespace}:{{{EVENTS.name}:0}}"
        result = _drain(
            url, namespace, "event_services", n=n, handlers=3, stream=stream, label=label, progress=progress
        )
        return {
            "n": n,
            "groups": 3,
            "publish_msgs_per_s": publish_rate,
            "events_per_s": n / result["seconds"],
            "deliveries_per_s": 3 * n / result["seconds"],
            **result,
        }
    finally:
        delete_namespace(url, namespace)


# -- latency --------------------------------------------------------------------------------------------------


def _wait_consumer(client: redis.Redis, stream: str, worker: Child, timeout: float = 60.0) -> None:
    """Wait until a consumer has read from ``stream`` (the group exists and the fetch loop runs)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(int(r.get("consumers") or 0) > 0 for r in _group_rows(client, stream)):
            return
        worker.check()
        time.sleep(0.05)
    raise RuntimeError(f"no consumer read {stream} within {timeout:.0f}s; log ends:\n{worker.log_tail()}")


def _latency_summary(client: redis.Redis, namespace: str, skip: int, count: int) -> dict[str, Any]:
    raw = client.lrange(latency_key(namespace), 0, -1)
    samples = sorted(int(v) / 1e6 for s, v in (x.split(b":") for x in raw) if int(s) >= skip)
    if len(samples) != count - skip:
        raise RuntimeError(f"got {len(samples)} latency samples, expected {count - skip}")
    return {
        "samples": len(samples),
        "p50_ms": percentile(samples, 50),
        "p90_ms": percentile(samples, 90),
        "p99_ms": percentile(samples, 99),
        "max_ms": samples[-1],
        "mean_ms": sum(samples) / len(samples),
    }


def _run_producer(
    mode: str, url: str, namespace: str, rate: float, count: int, consumer: Child, seconds: float
) -> float:
    args = ["-m", "benchmarks.roles", "produce", "--mode", mode, "--url", url, "--namespace", namespace]
    return run_producer(f"producer-{mode}", [*args, "--rate", str(rate), "--count", str(count)], consumer, seconds)


def run_producer(name: str, args: Sequence[str], consumer: Child, seconds: float) -> float:
    """Run a paced producer process to its end (checking ``consumer`` meanwhile); its achieved rate,
    from the JSON line it prints last."""
    with child(name, list(args), finishes=True) as producer:
        deadline = time.monotonic() + seconds + 60
        while producer.alive():
            consumer.check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the producer did not finish; its log ends:\n{producer.log_tail()}")
            time.sleep(0.1)
        if producer.proc.returncode != 0:
            raise RuntimeError(f"the producer failed; its log ends:\n{producer.log_tail()}")
        last = producer.log_tail(500).strip().splitlines()[-1]
    return float(orjson.loads(last)["achieved_rate"])


def latency(
    url: str,
    *,
    rate: float = 500.0,
    seconds: float = 10.0,
    warmup: float = 1.0,
    progress: Progress = _quiet,
    inbox: bool = True,
    env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    launcher: Sequence[str] = FRAMEWORK,
) -> dict[str, Any]:
    """Commands at a fixed ``rate`` from a producer process; latency from publish to handler start.

    ``inbox=False`` runs the same handler with the inbox off; ``env``, ``extra_args`` and
    ``launcher`` go to the worker (see :func:`_worker`).
    """
    namespace = unique_namespace("bench")
    skip = int(rate * warmup)
    count = skip + int(rate * seconds)
    client = _raw_client(url)
    try:
        anyio.run(functools.partial(_declare, url, namespace, LATENCY.spec()))
        stream = f"{namespace}:{{{LATENCY.name}:0}}"
        target = "latency" if inbox else "latency_no_inbox"
        worker_cm = _worker(target, url, namespace, expect=count, env=env, extra_args=extra_args, launcher=launcher)
        with worker_cm as worker:
            _wait_consumer(client, stream, worker)
            progress(
                f"latency (inbox {'on' if inbox else 'off'}): producing {count:,} commands at {rate:,.0f}/s "
                f"({warmup:.0f}s warm-up not counted)"
            )
            achieved = _run_producer("framework", url, namespace, rate, count, worker, seconds + warmup)
            _wait_done(
                client, namespace, worker, stream=stream, total=count, timeout=60, label="latency", progress=progress
            )
        summary = _latency_summary(client, namespace, skip, count)
        return {"rate": rate, "inbox": inbox, "achieved_rate": achieved, **summary}
    finally:
        client.close()
        delete_namespace(url, namespace)


def raw_latency(
    url: str, *, rate: float = 500.0, seconds: float = 10.0, warmup: float = 1.0, progress: Progress = _quiet
) -> dict[str, Any]:
    """The same with plain redis-py: XADD from a producer process, XREADGROUP BLOCK in a consumer process."""
    namespace = unique_namespace("bench")
    skip = int(rate * warmup)
    count = skip + int(rate * seconds)
    client = _raw_client(url)
    stream = raw_stream(namespace)
    try:
        client.xgroup_create(stream, RAW_GROUP, id="0", mkstream=True)
        args = ["-m", "benchmarks.roles", "raw-consume", "--url", url, "--namespace", namespace, "--count", str(count)]
        with child("raw-consumer", args, finishes=True) as consumer:
            _wait_consumer(client, stream, consumer)
            progress(f"raw latency: producing {count:,} entries at {rate:,.0f}/s")
            achieved = _run_producer("raw", url, namespace, rate, count, consumer, seconds + warmup)
            _wait_done(
                client,
                namespace,
                consumer,
                stream=stream,
                total=count,
                timeout=60,
                label="raw latency",
                progress=progress,
            )
        return {"rate": rate, "achieved_rate": achieved, **_latency_summary(client, namespace, skip, count)}
    finally:
        client.close()
        delete_namespace(url, namespace)


async def _declare(url: str, namespace: str, spec: Any) -> None:
    broker = await connect(url, namespace=namespace)
    try:
        await broker.declare(spec)
    finally:
        await broker.close()


# -- memory ---------------------------------------------------------------------------------------------------


def _fill_queue(url: str, namespace: str, n: int, progress: Progress) -> float:
    """XADD ``n`` commands to the benchmark queue with raw pipelines, in the framework's field layout."""
    anyio.run(functools.partial(_declare, url, namespace, COMMANDS.spec()))
    client = redis.Redis.from_url(url, protocol=2)
    stream = f"{namespace}:{{{COMMANDS.name}:0}}"
    started = time.perf_counter()
    try:
        pipe = client.pipeline(transaction=False)
        for i in range(n):
            env = Envelope(destination=COMMANDS.name, kind="command", type="BenchMessage", body=body(i, time.time_ns()))
            pipe.execute_command("XADD", stream, "*", *encode_fields(env))
            if len(pipe) >= 10_000:
                pipe.execute()
                if (i + 1) % 200_000 == 0:
                    progress(f"memory: filled {i + 1:,}/{n:,}")
        pipe.execute()
    finally:
        client.close()
    return n / (time.perf_counter() - started)


def _memory_usage_mib(client: redis.Redis, key: str) -> float:
    return int(client.memory_usage(key, samples=0) or 0) / 2**20


def _inbox_bytes(client: redis.Redis, inbox: str) -> int:
    """Server bytes of a group's inbox: the zset and every bucket key (MEMORY USAGE of each, plus
    about 56 bytes per key for its keyspace and expiry entries, which MEMORY USAGE leaves out)."""
    total = 0
    for key in [inbox, *client.scan_iter(f"{inbox}:*", count=1000)]:
        used = client.memory_usage(key, samples=0)
        if used:
            total += int(used) + 56
    return total


def memory(url: str, backlog: int, *, progress: Progress = _quiet) -> dict[str, Any]:
    """Peak RSS of one worker (inbox on) draining a pre-filled backlog of ``backlog`` commands.

    Also reports the server memory the group's inbox holds afterwards (one record per message id,
    kept for the dedup window) and what one remembered id costs (issue #15's target: <= 32 bytes).
    """
    namespace = unique_namespace("bench")
    client = _raw_client(url)
    label = f"memory ({backlog:,} backlog)"
    try:
        fill_rate = _fill_queue(url, namespace, backlog, progress)
        progress(f"{label}: filled at {fill_rate:,.0f}/s; draining with one worker, sampling RSS every 0.2s")
        stream = f"{namespace}:{{{COMMANDS.name}:0}}"
        result = _drain(
            url, namespace, "commands", n=backlog, handlers=1, stream=stream, label=label, progress=progress
        )
        return {
            "backlog": backlog,
            "peak_rss_mib": result["peak_rss_mib"],
            # peak RSS in the first and the second half of the drain: growth over time shows here
            "first_half_rss_mib": result["halves_rss_mib"][0],
            "second_half_rss_mib": result["halves_rss_mib"][1],
            "msgs_per_s": backlog / result["seconds"],
            "fill_msgs_per_s": fill_rate,
            "server_inbox_mib": (inbox := _inbox_bytes(client, f"{stream}:g:bench-commands:inbox")) / 2**20,
            "inbox_bytes_per_id": inbox / backlog,
        }
    finally:
        client.close()
        delete_namespace(url, namespace)
