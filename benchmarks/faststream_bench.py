"""The peer a user would pick instead, measured in the same run: FastStream's Redis Streams subscriber.

    python -m benchmarks --only raw commands latency peer        (the rows of issue #33)
    python -m benchmarks.faststream_bench once --url URL [N]     (one drain and one latency trial per mode)

Two modes, each run as ONE worker process (``FastStream(RedisBroker(url)).run()`` under uvloop, as
``faststream run`` starts an app), consumer group ``g`` on one stream, ``max_records=500`` (the raw
ceiling's ``COUNT 500`` and the framework's prefetch):

* ``batch``: ``StreamSub(stream, group, consumer, batch=True, max_records=500)``; the handler takes
  ``list[Payload]`` and awaits a per-message async function for each message;
* ``single``: the per-message subscriber, ``StreamSub(stream, group, consumer, max_records=500)``; the
  handler takes one ``Payload``.

``Payload`` is a pydantic model of the fields of the framework's ``BenchMessage`` (seq, sent_ns, pad),
so both decode and validate a typed object from the same 60-byte JSON body. Handlers do what the
framework's benchmark handlers do (:mod:`benchmarks.bench_services`, whose counter they share): count,
keep ``time.time_ns() - sent_ns`` first thing in the latency trial, report once with one ``LPUSH``.

Measured the way :mod:`benchmarks.runtime_bench` measures raw and the framework: a drain of a
pre-filled backlog (filled with ``RedisBroker.publish(..., pipeline=...)``, 5,000 per pipeline),
timed from the first handler start to ``XINFO GROUPS`` pending 0; latency from a producer process
publishing with ``RedisBroker.publish`` at a fixed rate (a monotonic schedule), publish stamp to
handler start, warm-up dropped.

What FastStream does differently from the framework (its defaults, as a user gets them):

* **Ack.** ``AckPolicy.REJECT_ON_ERROR`` (the default): ``XACK`` after the handler returned; the batch
  subscriber acks the whole batch with one ``XACK`` after the batch handler, the per-message one sends
  one ``XACK`` per message (a round trip each, awaited before the next message). A failed handler's
  entry is left pending (reject does not ``XACK``) and is only delivered again by a subscriber
  configured with ``min_idle_time`` (``XAUTOCLAIM``); there is no retry policy, DLQ, inbox
  (no deduplication of redeliveries) or ``XDEL`` of acknowledged entries (framework queues delete them).
* **Concurrency.** One message (or batch) at a time per subscriber, in stream order; the framework runs
  up to 64 lanes concurrently and keeps order per key.
* **Format.** One field, ``__data__``, in FastStream's binary format (magic, correlation id and
  content type headers, then the JSON body): about 170 bytes per entry against 133 for the
  framework's four fields (id, type, body, ts) with the same body.
* **Logging.** ``log_level=DEBUG`` for its per-message access log lines (not emitted at the default
  INFO threshold, so they cost an ``isEnabledFor``); errors are still logged.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import logging
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import anyio
import orjson
import redis

from benchmarks.cpu_watch import CpuWatch
from benchmarks.paced import CPU_SAMPLE_S, cpu_per_message, latency_summary, run_producer
from benchmarks.procs import Child, child
from benchmarks.streams import FILL_BATCH, Progress, quiet, raw_client, wait_done, wait_settled
from framework.testing import delete_namespace, unique_namespace

__all__ = ["INSTALL", "MODES", "drain", "latency", "main", "missing", "rows", "summary", "trials", "version"]

MODES = ("batch", "single")
MAX_RECORDS = 500
GROUP = "g"
INSTALL = "pip install faststream[redis]"
LABELS = {"batch": "batch subscriber (batch=True, max_records=500)", "single": "per-message subscriber"}


def missing() -> str | None:
    """Why the peer cannot run here (``not run: ...``), or None when FastStream's Redis broker imports."""
    try:
        import faststream.redis  # noqa: F401
    except ImportError as exc:
        return f"not run: {INSTALL} ({exc})"
    return None


def version() -> str:
    """The installed FastStream version."""
    return importlib.metadata.version("faststream")


def stream_name(namespace: str) -> str:
    """The stream of the FastStream trials."""
    return f"{namespace}:faststream"


def _payload() -> Any:
    """The pydantic model of the body (built lazily: pydantic comes with FastStream)."""
    from pydantic import BaseModel

    class Payload(BaseModel):
        seq: int
        sent_ns: int
        pad: str = "xxxxxxxx"

    return Payload


# -- the worker (child process) -------------------------------------------------------------------------------


def client_name(namespace: str) -> str:
    """The worker's connection name (how the benchmark sees that its subscriber reads)."""
    return f"{namespace}-faststream-worker"


def _app(url: str, namespace: str, mode: str, *, timed: bool) -> Any:
    """The FastStream app of one worker: one subscriber counting into bench_services' tally."""
    from faststream import FastStream
    from faststream.redis import RedisBroker, StreamSub

    from benchmarks import bench_services  # its tally reads BENCH_* from the environment

    payload = _payload()
    tally = bench_services._tally
    counter = bench_services._Counter(tally)
    broker = RedisBroker(url, log_level=logging.DEBUG, client_name=client_name(namespace))
    sub = StreamSub(
        stream_name(namespace), group=GROUP, consumer="bench-worker", batch=mode == "batch", max_records=MAX_RECORDS
    )

    async def one(message: Any) -> None:
        if timed:
            tally.samples.append(time.time_ns() - message.sent_ns)
            tally.seqs.append(message.seq)
        await counter.hit()

    async def handle_batch(messages: Any) -> None:
        for message in messages:
            await one(message)

    async def handle(message: Any) -> None:
        await one(message)

    # typed as a FastStream user types them (real annotations: the model is local to this function)
    handle_batch.__annotations__ = {"messages": list[payload], "return": None}
    handle.__annotations__ = {"message": payload, "return": None}
    broker.subscriber(stream=sub)(handle_batch if mode == "batch" else handle)
    return FastStream(broker)


def _run_worker(url: str, namespace: str, mode: str, *, timed: bool) -> None:
    app = _app(url, namespace, mode, timed=timed)
    options: dict[str, Any] = {}
    try:  # as `faststream run` does
        import uvloop

        options["loop_factory"] = uvloop.new_event_loop
    except ImportError:
        pass
    anyio.run(app.run, backend_options=options)


# -- publishing ---------------------------------------------------------------------------------------------


async def _fill(url: str, stream: str, n: int) -> float:
    """Publish ``n`` messages with FastStream, 5,000 per pipeline; return msg/s."""
    from faststream.redis import RedisBroker

    payload = _payload()
    async with RedisBroker(url) as broker:
        client = await broker.connect()
        started = time.perf_counter()
        for start in range(0, n, FILL_BATCH):
            pipe = client.pipeline(transaction=False)
            for i in range(start, min(start + FILL_BATCH, n)):
                await broker.publish(payload(seq=i, sent_ns=time.time_ns()), stream=stream, pipeline=pipe)
            await pipe.execute()
        return n / (time.perf_counter() - started)


async def _produce(url: str, stream: str, rate: float, count: int) -> float:
    """Publish ``count`` messages at ``rate`` per second, each stamped just before its publish."""
    from faststream.redis import RedisBroker

    payload = _payload()
    async with RedisBroker(url) as broker:
        await broker.connect()
        start = time.monotonic()
        for i in range(count):
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                await anyio.sleep(delay)
            await broker.publish(payload(seq=i, sent_ns=time.time_ns()), stream=stream)
        return count / (time.monotonic() - start)


# -- trials (parent process) --------------------------------------------------------------------------------


def _worker(url: str, namespace: str, mode: str, expect: int, *, timed: bool) -> Any:
    args = ["-m", "benchmarks.faststream_bench", "worker", "--url", url, "--namespace", namespace, "--mode", mode]
    env = {"BENCH_REDIS_URL": url, "BENCH_NAMESPACE": namespace, "BENCH_EXPECT": str(expect), "BENCH_HANDLERS": "1"}
    return child(f"faststream-{mode}", [*args, *(["--timed"] if timed else [])], env)


def _entry_bytes(client: redis.Redis, stream: str) -> int:
    """Bytes of the fields and values of the stream's first entry."""
    reply = client.xrange(stream, count=1)
    return sum(len(k) + len(v) for k, v in reply[0][1].items()) if reply else 0


def drain(url: str, n: int, mode: str, *, progress: Progress = quiet) -> dict[str, Any]:
    """Fill ``n`` messages with FastStream's publisher, drain them with one FastStream worker; msg/s."""
    namespace = unique_namespace("bench")
    stream = stream_name(namespace)
    client = raw_client(url)
    label = f"faststream {mode}"
    try:
        client.xgroup_create(stream, GROUP, id="0", mkstream=True)  # the worker finds it (BUSYGROUP is ignored)
        fill_rate = anyio.run(_fill, url, stream, n)
        entry = _entry_bytes(client, stream)
        progress(f"{label}: published {n:,} at {fill_rate:,.0f}/s ({entry} B per entry); draining with one worker")
        with _worker(url, namespace, mode, n, timed=False) as worker:
            wait: dict[str, Any] = {"stream": stream, "label": label, "progress": progress}
            done = wait_done(client, namespace, worker, total=n, timeout=max(120.0, n / 250), **wait)
            settled_ns = wait_settled(client, stream, 1)
            status = worker.stop()
        if status not in (0, None):
            raise RuntimeError(f"{label}: the worker exited with status {status} on SIGTERM:\n{worker.log_tail()}")
        seconds = (settled_ns - done["first_ns"]) / 1e9
        return {
            "n": n,
            "mode": mode,
            "msgs_per_s": n / seconds,
            "seconds": seconds,
            "handled_s": (done["last_ns"] - done["first_ns"]) / 1e9,
            "fill_msgs_per_s": fill_rate,
            "entry_bytes": entry,
            "faststream": version(),
        }
    finally:
        client.close()
        delete_namespace(url, namespace)


def _wait_reading(client: redis.Redis, namespace: str, worker: Child, timeout: float = 60.0) -> None:
    """Wait until the worker's subscriber has sent its first XREADGROUP (a blocking read on an empty
    stream creates no consumer on Redis 7.0, so XINFO GROUPS cannot tell)."""
    name = client_name(namespace)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(c.get("name") == name and c.get("cmd") == "xreadgroup" for c in client.client_list()):
            return
        worker.check()
        time.sleep(0.05)
    raise RuntimeError(f"the FastStream worker did not read within {timeout:.0f}s; log ends:\n{worker.log_tail()}")


def _run_producer(url: str, namespace: str, rate: float, count: int, consumer: Child, seconds: float) -> float:
    args = ["-m", "benchmarks.faststream_bench", "produce", "--url", url, "--namespace", namespace]
    return run_producer("faststream-producer", [*args, "--rate", str(rate), "--count", str(count)], consumer, seconds)


def latency(
    url: str,
    mode: str,
    *,
    rate: float = 500.0,
    seconds: float = 10.0,
    warmup: float = 1.0,
    progress: Progress = quiet,
    server_pid: int | None = None,
) -> dict[str, Any]:
    """FastStream publishes at a fixed ``rate`` from a producer process; latency from publish to
    handler start, and the worker's CPU per message meanwhile (the server's too, with ``server_pid``)."""
    namespace = unique_namespace("bench")
    stream = stream_name(namespace)
    skip = int(rate * warmup)
    count = skip + int(rate * seconds)
    client = raw_client(url)
    label = f"faststream {mode} latency"
    try:
        client.xgroup_create(stream, GROUP, id="0", mkstream=True)
        with _worker(url, namespace, mode, count, timed=True) as worker:
            _wait_reading(client, namespace, worker)
            progress(f"{label}: publishing {count:,} at {rate:,.0f}/s ({warmup:.0f}s warm-up not counted)")
            with CpuWatch(CPU_SAMPLE_S, server_pid, pid=worker.pid) as watch:
                achieved = _run_producer(url, namespace, rate, count, worker, seconds + warmup)
                done = wait_done(
                    client, namespace, worker, stream=stream, total=count, timeout=60, label=label, progress=progress
                )
        summary_ = latency_summary(client, namespace, skip, count)
        cpu = cpu_per_message(watch, done, count)
        return {"mode": mode, "rate": rate, "achieved_rate": achieved, **summary_, **cpu}
    finally:
        client.close()
        delete_namespace(url, namespace)


PER_MESSAGE_DRAIN = 20_000
"""At most this many messages in the per-message subscriber's drain (about 10 s at its rate)."""


def trials(
    url: str,
    round_: int,
    *,
    messages: int,
    rate: float,
    seconds: float,
    progress: Progress = quiet,
    server_pid: int | None = None,
) -> Iterator[tuple[str, Callable[[], dict[str, Any]]]]:
    """One round's trials as (key, call): the drains, then the latency trials, mode order alternating."""
    modes = MODES if round_ % 2 == 0 else MODES[::-1]
    for mode in modes:  # (the per-message subscriber drains at about 1% of raw: a tenth of the backlog is enough)
        n = messages if mode == MODES[0] else min(messages, PER_MESSAGE_DRAIN)
        yield f"peer:{mode}", functools.partial(drain, url, n, mode, progress=progress)
    for mode in modes:
        kw = {"rate": rate, "seconds": seconds, "progress": progress, "server_pid": server_pid}
        call = functools.partial(latency, url, mode, **kw)
        yield f"peer:latency-{mode}", call


# -- summary and table rows -----------------------------------------------------------------------------------


def _stats(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": list(values)}


def _paired(trials_: Mapping[str, list[dict[str, Any]]], key: str, field: str, base: str, base_field: str) -> Any:
    bases = {t["round"]: t[base_field] for t in trials_.get(base, []) if t.get("round") is not None}
    ratios = [t[field] / bases[t["round"]] for t in trials_.get(key, []) if t.get("round") in bases]
    return _stats(ratios) if ratios else None


def summary(trials_: Mapping[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per mode: medians of msg/s and latency; msg/s paired by round to the raw ceiling, and the
    framework's commands drains (inbox on, off) paired to this mode's."""
    out: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        if drains := trials_.get(f"peer:{mode}"):
            key = f"peer:{mode}"
            fig: dict[str, Any] = {f: _stats([t[f] for t in drains]) for f in ("msgs_per_s", "fill_msgs_per_s")}
            fig["entry_bytes"] = drains[0]["entry_bytes"]
            if pr := _paired(trials_, key, "msgs_per_s", "raw:xack", "drain_msgs_per_s"):
                fig["ratio_to_raw"] = pr
            for inbox in ("on", "off"):
                if pr := _paired(trials_, f"commands:{inbox}", "msgs_per_s", key, "msgs_per_s"):
                    fig[f"framework_{inbox}_over_this"] = pr
            out[key] = fig
        if lat := trials_.get(f"peer:latency-{mode}"):
            names = ("p50_ms", "p90_ms", "p99_ms", "max_ms", "achieved_rate", "cpu_us_per_msg", "server_cpu_us_per_msg")
            out[f"peer:latency-{mode}"] = {f: _stats(v) for f in names if (v := [t[f] for t in lat if f in t])}
    return out


def _spread(s: Mapping[str, Any], fmt: str) -> str:
    return f"\n[dim]{format(s['min'], fmt)}-{format(s['max'], fmt)}[/dim]" if len(s["runs"]) > 1 else ""


def rows(sm: Mapping[str, dict[str, Any]], errors: Mapping[str, str], latency_rate: float) -> list[dict[str, Any]]:
    """Table rows (fields of ``benchmarks.rows.Row``): each mode's drain against the raw ceiling,
    then its latency against the raw consumer's; the FastStream batch row carries issue #33's target
    (the framework's p99 with the inbox on below FastStream's batch subscriber's)."""
    if "peer" in errors:
        reason = errors["peer"].replace("[", "\\[")  # rich markup: keep "faststream[redis]" visible
        return [{"benchmark": "peer: FastStream (Redis Streams)", "result": f"[yellow]{reason}[/yellow]"}]
    out: list[dict[str, Any]] = []
    name = f"FastStream {version()}" if not missing() else "FastStream"
    raw = sm.get("raw:xack", {}).get("drain_msgs_per_s")
    for mode in MODES:
        if not (fig := sm.get(f"peer:{mode}")):
            continue
        pr, on, off = fig.get("ratio_to_raw"), fig.get("framework_on_over_this"), fig.get("framework_off_over_this")
        vs = " / ".join(f"{v['median']:.2f}x" for v in (on, off) if v)
        out.append(
            {
                "benchmark": f"peer: {name} {LABELS[mode]} → one worker ({fig['entry_bytes']} B entries)",
                "result": f"{fig['msgs_per_s']['median']:,.0f} msg/s{_spread(fig['msgs_per_s'], ',.0f')}",
                "ceiling": f"{raw['median']:,.0f} msg/s" if raw else "—",
                "ratio": (f"{pr['median']:.0%}{_spread(pr, '.0%')}" if pr else "—")
                + (f"\n[dim]framework inbox on / off: {vs} this[/dim]" if on and off else ""),
                "target": "reported",
            }
        )
    raw_lat, fw = sm.get("latency:raw"), sm.get("latency:framework")
    for mode in MODES:
        if not (lat := sm.get(f"peer:latency-{mode}")):
            continue
        p99 = lat["p99_ms"]["median"]
        row = {
            "benchmark": f"peer latency publish → handler start @ {latency_rate:,.0f}/s: {name} {LABELS[mode]}",
            "result": f"p50 {lat['p50_ms']['median']:.2f}{_spread(lat['p50_ms'], '.2f')}\n"
            f"p99 {p99:.2f}{_spread(lat['p99_ms'], '.2f')}",
            "ceiling": (
                f"p50 {raw_lat['p50_ms']['median']:.2f}\np99 {raw_lat['p99_ms']['median']:.2f}" if raw_lat else "—"
            ),
            "ratio": f"p99 {p99 / raw_lat['p99_ms']['median']:.1f}x" if raw_lat else "—",
            "target": "reported",
        }
        if mode == "batch" and fw:
            ours = fw["p99_ms"]["median"]
            row["ratio"] += f"\n[dim]framework inbox on p99 {ours:.2f}[/dim]"
            row["target"], row["ok"] = "framework inbox-on p99 below this (#33)", ours < p99
        out.append(row)
    return out


# -- command line ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """``worker`` and ``produce`` (the child processes), or ``URL [N]``: each mode's drain and latency once."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.faststream_bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="role")
    worker = sub.add_parser("worker")
    worker.add_argument("--mode", choices=MODES, required=True)
    worker.add_argument("--timed", action="store_true", help="keep publish → handler latency per message")
    produce = sub.add_parser("produce")
    produce.add_argument("--rate", type=float, default=500.0)
    produce.add_argument("--count", type=int, required=True)
    once = sub.add_parser("once")
    once.add_argument("n", type=int, nargs="?", default=20_000)
    for p in (worker, produce, once):
        p.add_argument("--url", required=True)
    for p in (worker, produce):
        p.add_argument("--namespace", required=True)
    args = parser.parse_args(argv)
    if args.role == "worker":
        _run_worker(args.url, args.namespace, args.mode, timed=args.timed)
    elif args.role == "produce":
        achieved = anyio.run(_produce, args.url, stream_name(args.namespace), args.rate, args.count)
        print(orjson.dumps({"achieved_rate": achieved}).decode())
    elif args.role == "once":
        for mode in MODES:
            print(mode, orjson.dumps(drain(args.url, args.n, mode, progress=print)).decode())
            print(mode, orjson.dumps(latency(args.url, mode, seconds=3.0, progress=print)).decode())
    else:
        parser.print_help()


if __name__ == "__main__":
    main()
