"""One ``python -m framework run`` worker process: the commands and events drains and the latency trial.

* :func:`commands`: ``n`` commands sent with ``Client.send_many`` (5,000 per call), then drained by
  ONE worker with a per-message async handler that only counts.
* :func:`events`: ``n`` events on one topic drained by three services (three groups) in one worker.
* :func:`latency`: a producer process at a fixed rate, publish to handler start.

Throughput runs from the first handler start (taken in the worker) to the moment the benchmark
sees every entry acknowledged (XINFO GROUPS pending 0, polled every millisecond once the worker
reported its last message), so worker start-up is left out and the final acks are counted in.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio

from benchmarks.bench_services import COMMANDS, EVENTS, LATENCY, BenchMessage
from benchmarks.cpu_watch import CpuWatch
from benchmarks.paced import CPU_SAMPLE_S, cpu_per_message, latency_summary, produce, wait_consumer
from benchmarks.procs import RssSampler, child
from benchmarks.streams import FILL_BATCH, Progress, quiet, raw_client, wait_done, wait_settled
from broker import connect
from framework import Client
from framework.testing import delete_namespace, unique_namespace

__all__ = ["FRAMEWORK", "commands", "declare", "drain", "events", "latency", "start_worker"]

FRAMEWORK = ("-m", "framework")  # how a worker starts: python -m framework run ...


async def declare(url: str, namespace: str, spec: Any) -> None:
    """Declare ``spec`` in ``namespace`` (so a worker finds its queue before anything is sent)."""
    broker = await connect(url, namespace=namespace)
    try:
        await broker.declare(spec)
    finally:
        await broker.close()


def start_worker(
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


def drain(
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
    client = raw_client(url)
    extra: dict[str, Any] = {}
    worker_cm = start_worker(
        target, url, namespace, expect=n, handlers=handlers, env=env, extra_args=extra_args, launcher=launcher
    )
    try:
        with worker_cm as worker, RssSampler(worker.pid) as rss:
            summary = wait_done(
                client,
                namespace,
                worker,
                stream=stream,
                total=n * handlers,
                timeout=max(120.0, n * handlers / 1000),
                label=label,
                progress=progress,
            )
            settled_ns = wait_settled(client, stream, handlers)
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
    progress: Progress = quiet,
    label: str | None = None,
    env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    launcher: Sequence[str] = FRAMEWORK,
    on_settled: Callable[[], dict[str, Any]] | None = None,
    target: str | None = None,
    profile: bool = False,
    server_pid: int | None = None,
) -> dict[str, Any]:
    """Send ``n`` commands with the client, then drain them with one worker; msgs/s of the drain.

    ``env``, ``extra_args``, ``launcher`` and ``on_settled`` go to the worker (see :func:`start_worker`, :func:`drain`);
    ``target`` names the service of :mod:`benchmarks.bench_services` it runs (default: by ``inbox``).
    With ``profile``, where the time goes over the timed span: the worker's CPU per message and
    the share of the span it was busy, and the server's CPU per message (with ``server_pid``, a
    server on this machine; it includes the benchmark's own polling, the same for every trial).
    """
    namespace = unique_namespace("bench")
    label = label or f"commands (inbox {'on' if inbox else 'off'})"
    try:
        publish_rate = anyio.run(functools.partial(_publish_all, url, namespace, COMMANDS, n, events=False))
        progress(f"{label}: sent {n:,} commands at {publish_rate:,.0f}/s; draining with one worker")
        stream = f"{namespace}:{{{COMMANDS.name}:0}}"
        watch = CpuWatch(server_pid=server_pid) if profile else contextlib.nullcontext()
        with watch:
            result = drain(
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
        if isinstance(watch, CpuWatch):
            span = (result["first_ns"], result["settled_ns"])
            worker_s = watch.between(*span)
            result["worker_us_per_msg"] = worker_s * 1e6 / n
            result["worker_busy"] = worker_s / result["seconds"]
            if (server_s := watch.server_between(*span)) is not None:
                result["server_us_per_msg"] = server_s * 1e6 / n
        return {
            "n": n,
            "inbox": inbox,
            "publish_msgs_per_s": publish_rate,
            "msgs_per_s": n / result["seconds"],
            **result,
        }
    finally:
        delete_namespace(url, namespace)


def events(url: str, n: int, *, progress: Progress = quiet) -> dict[str, Any]:
    """Publish ``n`` events to a topic with three subscribing services, drained by one worker."""
    namespace = unique_namespace("bench")
    label = "events (3 groups)"
    try:
        publish_rate = anyio.run(functools.partial(_publish_all, url, namespace, EVENTS, n, events=True))
        progress(f"{label}: published {n:,} events at {publish_rate:,.0f}/s; draining with one worker")
        stream = f"{namespace}:{{{EVENTS.name}:0}}"
        result = drain(url, namespace, "event_services", n=n, handlers=3, stream=stream, label=label, progress=progress)
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


def latency(
    url: str,
    *,
    rate: float = 500.0,
    seconds: float = 10.0,
    warmup: float = 1.0,
    progress: Progress = quiet,
    inbox: bool = True,
    env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    launcher: Sequence[str] = FRAMEWORK,
    server_pid: int | None = None,
) -> dict[str, Any]:
    """Commands at a fixed ``rate`` from a producer process; latency from publish to handler start,
    and the worker's CPU per message meanwhile (the server's too, with ``server_pid``).

    ``inbox=False`` runs the same handler with the inbox off; ``env``, ``extra_args`` and
    ``launcher`` go to the worker (see :func:`start_worker`).
    """
    namespace = unique_namespace("bench")
    skip = int(rate * warmup)
    count = skip + int(rate * seconds)
    client = raw_client(url)
    try:
        anyio.run(functools.partial(declare, url, namespace, LATENCY.spec()))
        stream = f"{namespace}:{{{LATENCY.name}:0}}"
        target = "latency" if inbox else "latency_no_inbox"
        worker_cm = start_worker(
            target, url, namespace, expect=count, env=env, extra_args=extra_args, launcher=launcher
        )
        with worker_cm as worker:
            wait_consumer(client, stream, worker)
            progress(
                f"latency (inbox {'on' if inbox else 'off'}): producing {count:,} commands at {rate:,.0f}/s "
                f"({warmup:.0f}s warm-up not counted)"
            )
            with CpuWatch(CPU_SAMPLE_S, server_pid, pid=worker.pid) as watch:
                achieved = produce("framework", url, namespace, rate, count, worker, seconds + warmup)
                wait = {"stream": stream, "total": count, "timeout": 60, "label": "latency", "progress": progress}
                done = wait_done(client, namespace, worker, **wait)
        summary = latency_summary(client, namespace, skip, count)
        cpu = cpu_per_message(watch, done, count)
        return {"rate": rate, "inbox": inbox, "achieved_rate": achieved, **summary, **cpu}
    finally:
        client.close()
        delete_namespace(url, namespace)
