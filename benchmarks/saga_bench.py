"""Sagas (#13): saga steps per second against plain handlers with the inbox on, one worker, same run.

    python -m benchmarks --only saga              (20,000 messages per kind; --quick: 5,000)
    python -m benchmarks.saga_bench URL [N]       (a quick look without the runner)

Each kind drains a backlog of N messages (preloaded while no worker runs, then one
``python -m framework run`` worker with default settings) from 4-partition destinations:

* ``plain``: a command handler that does nothing (the inbox on: the issue's yardstick);
* ``plain_tx``: a command handler that keeps a counter per key with ``ctx.redis_transaction()``
  (exactly-once state without a saga: what a saga step does by hand, minus the load and the guard);
* ``saga_step``: messages sent straight to the saga's queue (key = correlation id, 1,000 saga
  instances): one step each = load the state, run, save it with the version guard in the commit;
* ``saga_event``: events on a topic the saga subscribes to, so each is forwarded to the saga
  queue first (two handler runs per event: the routing hop, then the step).

Rate = N / (time from the worker's "runtime started" line to the last message settled). Kinds are interleaved per
round so background load hits them alike; the ratios are plain's rate over each kind's
(``saga_step / plain`` = how many plain handler runs one saga step costs; target < 2).
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import time
from typing import Any

import anyio
import redis

from benchmarks.procs import child
from framework import Client, Context, Queue, Service, Topic
from framework.saga import SAGA_INPUT, SagaContext
from framework.testing import delete_namespace, unique_namespace

__all__ = ["KINDS", "run", "trial"]

KINDS = ("plain", "plain_tx", "saga_step", "saga_event")
SAGAS = 1000  # saga instances (correlation ids) the messages spread over
_BATCH = 5000

PLAIN = Queue("bench.plain", partitions=4)
PLAIN_TX = Queue("bench.plain_tx", partitions=4)
EVENTS = Topic("bench.saga.events", partitions=4)

plain = Service("bplain")


@plain.command(PLAIN)
async def nothing(cmd: dict[str, Any], ctx: Context) -> None:
    """The yardstick: a handler with the inbox on and no effects."""


plain_tx = Service("bplaintx")


@plain_tx.command(PLAIN_TX)
async def count(cmd: dict[str, Any], ctx: Context) -> None:
    """A counter per key, exactly once with the inbox mark (what a saga step does by hand)."""
    ctx.redis_transaction().hincrby(f"{ctx.hash_tag}:bench:counts", cmd["k"], 1)


sagas = Service("bsaga")
counter = sagas.saga("counter", state=dict)


@counter.event(EVENTS, correlate=lambda e: e["k"])
async def step(event: dict[str, Any], ctx: SagaContext[dict[str, Any]]) -> None:
    """Count the instance's messages (the state is loaded, changed and saved each step)."""
    ctx.state["n"] = ctx.state.get("n", 0) + 1


_TARGETS = {
    "plain": "benchmarks.saga_bench:plain",
    "plain_tx": "benchmarks.saga_bench:plain_tx",
    "saga_step": "benchmarks.saga_bench:sagas",
    "saga_event": "benchmarks.saga_bench:sagas",
}


async def _preload(url: str, namespace: str, kind: str, n: int) -> None:
    async with Client(url, namespace=namespace) as client:
        for start in range(0, n, _BATCH):
            async with client.batch() as batch:
                for i in range(start, min(start + _BATCH, n)):
                    k = f"s{i % SAGAS}"
                    if kind == "plain":
                        batch.send(PLAIN, {"k": k}, key=k)
                    elif kind == "plain_tx":
                        batch.send(PLAIN_TX, {"k": k}, key=k)
                    elif kind == "saga_step":
                        batch.send(counter.queue, {"k": k}, key=k, headers={SAGA_INPUT: EVENTS.name})
                    else:
                        batch.publish(EVENTS, {"k": k}, key=k)


def _remaining(r: redis.Redis, namespace: str, kind: str, n: int) -> int:
    """Messages not yet settled (queues delete acked entries; the topic counts its group's lag)."""
    pipe = r.pipeline(transaction=False)
    queue = {"plain": PLAIN, "plain_tx": PLAIN_TX}.get(kind, counter.queue)
    for p in range(queue.partitions):
        pipe.xlen(f"{namespace}:{{{queue.name}:{p}}}")
    left = sum(pipe.execute())
    if kind == "saga_event":
        for p in range(EVENTS.partitions):
            groups = []
            with contextlib.suppress(redis.ResponseError):
                groups = r.xinfo_groups(f"{namespace}:{{{EVENTS.name}:{p}}}")
            if not groups:
                return left + n  # the worker has not subscribed yet
            for g in groups:
                left += int(g.get("lag") or 0) + int(g.get("pending") or 0)
    return left


def _drain(url: str, kind: str, n: int) -> float:
    """Preload ``n`` messages of ``kind``, start a worker, return messages settled per second."""
    namespace = unique_namespace(f"bench-saga-{kind.replace('_', '')}")
    r = redis.Redis.from_url(url)
    args = ["-m", "framework", "run", _TARGETS[kind], "--redis-url", url]
    args += ["--namespace", namespace, "--log-format", "json", "--consumer", "w"]
    try:
        anyio.run(functools.partial(_preload, url, namespace, kind, n))
        with child(f"saga-{kind}", args, {}) as worker:
            deadline = time.monotonic() + 60
            while b"runtime started" not in worker.log_path.read_bytes():
                worker.check()
                if time.monotonic() > deadline:
                    raise RuntimeError("saga benchmark: the worker did not start within 60 s")
                time.sleep(0.002)
            started = time.perf_counter()
            deadline = time.monotonic() + 300
            while (left := _remaining(r, namespace, kind, n)) > 0:
                worker.check()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"saga benchmark: {left} of {n} {kind} messages left after 300 s")
                time.sleep(0.005)
            return n / (time.perf_counter() - started)
    finally:
        r.close()
        delete_namespace(url, namespace)


def trial(url: str, n: int) -> dict[str, float]:
    """One round: every kind once, interleaved; messages per second of each."""
    return {kind: _drain(url, kind, n) for kind in KINDS}


def run(url: str, *, messages: int = 20_000, repeats: int = 1) -> dict[str, Any]:
    """``repeats`` rounds; medians per kind and the cost of each kind in plain handler runs."""
    trials = [trial(url, messages) for _ in range(repeats)]
    medians = {k: statistics.median(t[k] for t in trials) for k in KINDS}
    return {
        "messages": messages,
        "sagas": SAGAS,
        "cores": os.cpu_count(),
        "trials": trials,
        "medians": medians,
        # cost of one message of each kind, in plain handler runs (plain rate over its rate)
        "cost": {k: medians["plain"] / medians[k] for k in KINDS if k != "plain"},
    }


if __name__ == "__main__":  # a quick look without the benchmark runner
    import sys

    import orjson

    with contextlib.suppress(KeyboardInterrupt):
        print(orjson.dumps(run(sys.argv[1], messages=int(sys.argv[2]) if len(sys.argv) > 2 else 10_000)).decode())
