"""Middleware: order (the runtime's, then the service's), every outcome, headers in and out,
a failing middleware, and the two examples of docs/middleware.md, run for real."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
import structlog

from framework import Context, Queue, RetryPolicy, Runtime, Service
from framework.effects import AlreadyProcessed
from framework.middleware import CallNext, InboundMessage, Outcome
from framework.testing import TEST_SETTINGS, ServiceHarness

pytestmark = pytest.mark.anyio

DOC = Path(__file__).resolve().parents[1] / "docs" / "middleware.md"


def _doc_example(name: str) -> Any:
    """The object ``name`` defined by a python block of docs/middleware.md, executed as written."""
    for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S):
        scope: dict[str, Any] = {"__name__": "doc_example"}
        exec(compile(block, str(DOC), "exec"), scope)  # the documentation's own code
        if name in scope:
            return scope[name]
    raise AssertionError(f"docs/middleware.md defines no {name!r}")


async def _run(services: list[Service], h: ServiceHarness, middleware: Any = (), **settings: Any) -> Runtime:
    return Runtime(services, broker=h.broker, settings=attrs.evolve(TEST_SETTINGS, **settings), middleware=middleware)


async def _drain(runtime: Runtime, send: Any, *, timeout: float = 20) -> None:
    async with anyio.create_task_group() as tg:
        await tg.start(runtime.run)
        await send()
        await runtime.wait_idle(timeout=timeout)
        runtime.stop()


def _recorder(name: str, log: list[str], outcomes: list[tuple[str, Outcome]] | None = None) -> Any:
    async def mw(message: InboundMessage, ctx: Context, call_next: CallNext) -> Outcome:
        log.append(f"{name}>")
        outcome = await call_next()
        log.append(f"{name}<")
        if outcomes is not None:
            outcomes.append((message.payload.get("case", "?"), outcome))
        return outcome

    return mw


async def test_runtime_middleware_is_outermost_then_the_services_in_order(redis_url: str, namespace: str) -> None:
    log: list[str] = []
    svc = Service("ordered", middleware=[_recorder("s1", log)])
    svc.middleware(_recorder("s2", log))

    @svc.command(Queue("mw.order"))
    async def handle(job: dict) -> None:
        log.append("handler")

    async with ServiceHarness([], url=redis_url, namespace=namespace) as h:
        runtime = await _run([svc], h, [_recorder("r1", log), _recorder("r2", log)])
        await _drain(runtime, lambda: h.client.send("mw.order", {"n": 1}))
    assert log == ["r1>", "r2>", "s1>", "s2>", "handler", "s2<", "s1<", "r2<", "r1<"]


class Boom(Exception):
    pass


async def test_every_outcome_is_observed(redis_url: str, namespace: str) -> None:
    outcomes: list[tuple[str, Outcome]] = []
    svc = Service("outcomes", retry=RetryPolicy(max_attempts=2, immediate=1, fatal=ValueError), timeout=0.3)
    svc.middleware(_recorder("m", [], outcomes))

    @svc.command(Queue("mw.outcomes"))
    async def handle(job: dict, ctx: Context) -> None:
        case = job["case"]
        if case == "flaky" and ctx.attempt == 1:
            raise Boom("once")
        if case == "fatal":
            raise ValueError("never")
        if case == "duplicate":
            raise AlreadyProcessed("seen")
        if case == "slow":
            await anyio.sleep(30)

    cases = ["ok", "flaky", "fatal", "duplicate", "slow"]
    async with ServiceHarness([], url=redis_url, namespace=namespace) as h:
        runtime = await _run([svc], h)

        async def send() -> None:
            for case in cases:
                await h.client.send("mw.outcomes", {"case": case})

        await _drain(runtime, send)
        stats = runtime.stats()["outcomes.handle"]
    seen = {(case, o.status, o.attempt, type(o.exception).__name__) for case, o in outcomes}
    assert ("ok", "success", 1, "NoneType") in seen
    assert ("flaky", "retry", 1, "Boom") in seen and ("flaky", "success", 2, "NoneType") in seen
    assert ("fatal", "dead_letter", 1, "ValueError") in seen
    assert ("duplicate", "duplicate", 1, "NoneType") in seen
    # a timeout: never retried in place; the second attempt (max_attempts=2) is dead-lettered
    assert ("slow", "retry", 1, "HandlerTimeout") in seen and ("slow", "dead_letter", 2, "HandlerTimeout") in seen
    retry = next(o for case, o in outcomes if case == "slow" and o.status == "retry")
    assert not retry.in_place
    assert stats["dead_lettered"] == 2 and stats["duplicates"] == 1


async def test_headers_are_read_from_the_incoming_message_and_written_onto_outgoing_ones(
    redis_url: str, namespace: str
) -> None:
    received: list[dict[str, str]] = []
    seen_parent: list[str | None] = []
    read_only: list[bool] = []

    async def tracing(message: InboundMessage, ctx: Context, call_next: CallNext) -> Outcome:
        parent = message.headers.get("traceparent")
        seen_parent.append(parent)
        try:
            message.headers["x"] = "y"  # type: ignore[index]
        except TypeError:
            read_only.append(True)
        if message.destination == "mw.first":
            ctx.set_outgoing_header("traceparent", f"child-of-{parent}")
        outcome = await call_next()
        if message.destination == "mw.first":
            ctx.set_outgoing_header("x-outcome", outcome.status)  # after the call: staged ones get it too
        return outcome

    svc = Service("traced")

    @svc.command(Queue("mw.first"))
    async def first(job: dict, ctx: Context) -> None:
        ctx.send("mw.second", {"n": 1}, headers={"traceparent": "overridden"})

    @svc.command(Queue("mw.second"))
    async def second(job: dict, ctx: Context) -> None:
        received.append(dict(ctx.headers))

    async with ServiceHarness([], url=redis_url, namespace=namespace) as h:
        runtime = await _run([svc], h, [tracing])
        await _drain(runtime, lambda: h.client.send("mw.first", {"n": 0}, headers={"traceparent": "root"}))
    assert seen_parent[0] == "root"
    assert received[0]["traceparent"] == "child-of-root" and received[0]["x-outcome"] == "success"
    assert read_only == [True, True]


async def test_a_middleware_that_raises_fails_the_attempt(redis_url: str, namespace: str) -> None:
    outcomes: list[tuple[str, Outcome]] = []
    ran: list[int] = []

    async def picky(message: InboundMessage, ctx: Context, call_next: CallNext) -> Outcome:
        if message.attempt == 1:
            raise Boom("middleware failed")
        return await call_next()

    svc = Service("picky", retry=RetryPolicy(immediate=1))

    @svc.command(Queue("mw.picky"))
    async def handle(job: dict, ctx: Context) -> None:
        ran.append(ctx.attempt)

    async with ServiceHarness([], url=redis_url, namespace=namespace) as h:
        runtime = await _run([svc], h, [_recorder("outer", [], outcomes), picky])
        await _drain(runtime, lambda: h.client.send("mw.picky", {"case": "x"}))
        stats = runtime.stats()["picky.handle"]
    assert ran == [2]  # the failed attempt never reached the handler
    assert [(o.status, o.attempt, type(o.exception).__name__) for _, o in outcomes] == [
        ("retry", 1, "Boom"),
        ("success", 2, "NoneType"),
    ]
    assert stats["failed"] == 1 and stats["processed"] == 1


async def test_the_timing_log_example_runs(redis_url: str, namespace: str) -> None:
    timing = _doc_example("timing")
    svc = Service("timed")

    @svc.command(Queue("mw.timed"))
    async def handle(job: dict, ctx: Context) -> None:
        if job["n"] == 1 and ctx.attempt == 1:
            raise Boom("once")

    async with ServiceHarness([], url=redis_url, namespace=namespace) as h:
        runtime = await _run([svc], h, [timing])
        with structlog.testing.capture_logs() as logs:
            await _drain(runtime, lambda: h.client.send_many("mw.timed", [{"n": 0}, {"n": 1}]))
    handled = [e for e in logs if e["event"] == "handled"]
    assert sorted((e["attempt"], e["status"]) for e in handled) == [(1, "retry"), (1, "success"), (2, "success")]
    assert all(e["ms"] >= 0 for e in handled)


async def test_the_per_key_rate_limit_example_runs(redis_url: str, namespace: str) -> None:
    limit = _doc_example("PerKeyRateLimit")(rate=20.0)
    starts: dict[str, list[float]] = {"a": [], "b": []}
    svc = Service("limited", middleware=[limit])

    @svc.command(Queue("mw.limited"))
    async def handle(job: dict, ctx: Context) -> None:
        starts[ctx.key or "-"].append(time.monotonic())

    async with ServiceHarness([], url=redis_url, namespace=namespace) as h:
        runtime = await _run([svc], h)

        async def send() -> None:
            await h.client.send_many("mw.limited", [{"n": i} for i in range(6)], key=lambda _: "a")
            await h.client.send("mw.limited", {"n": 0}, key="b")

        await _drain(runtime, send)
    a = starts["a"]
    assert len(a) == 6 and len(starts["b"]) == 1
    assert a[-1] - a[0] >= 5 / 20 * 0.9  # 20 per second for key "a": 6 runs take at least 0.25 s
