"""Request/reply (issue #35): round trips, typed errors, deadlines, late and duplicate replies,
reply destinations that expire, on the embedded Valkey and on ``memory://``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from urllib.parse import quote

import anyio
import anyio.lowlevel
import attrs
import pytest

from broker import Envelope, connect, derive_id
from broker import headers as h
from broker.capabilities import as_replies
from broker.memory import reset
from framework import Context, RetryPolicy, Service
from framework.client import Client
from framework.requests import ReplyDecodeError, RequestFailed, RequestTimeout
from framework.testing import TEST_SETTINGS, ServiceHarness
from tests.conftest import ROOT
from tests.workers import Workers, wait_for

pytestmark = pytest.mark.anyio


@attrs.frozen
class Quote:
    sku: str
    qty: int


@attrs.frozen
class Price:
    sku: str
    cents: int


@attrs.frozen
class Priced:
    sku: str
    cents: int
    currency: str  # a field the handler's reply does not have


def pricing_service(name: str, *, runs: list[str] | None = None, release: anyio.Event | None = None) -> Service:
    """Quotes; the sku ``slow`` waits for ``release`` (or a second) before it replies."""
    svc = Service(name, retry=RetryPolicy(max_attempts=2, backoff=0.01, max_delay=0.02, fatal=(ValueError,)))

    @svc.command(f"{name}.quote")
    async def quote(q: Quote, ctx: Context) -> Price:
        if runs is not None:
            runs.append(q.sku)
        if q.qty < 0:
            raise ValueError(f"quantity {q.qty} is negative")
        if q.sku == "slow":
            if release is None:
                await anyio.sleep(1.0)
            else:
                await release.wait()
        return Price(q.sku, 250 * q.qty)

    @svc.command(f"{name}.total")
    async def total(q: Quote, ctx: Context) -> dict[str, int]:
        one = await ctx.request(f"{name}.quote", Quote(q.sku, 1), timeout=5, response=Price)
        return {"total": one.cents * q.qty}

    @svc.command(f"{name}.sync")
    def sync_quote(q: Quote) -> Price:
        return Price(q.sku, 7)

    return svc


@pytest.fixture(params=["redis", "memory", "rabbitmq"])
def url(request: pytest.FixtureRequest, redis_url: str) -> str:
    if request.param == "memory":
        name = f"rr-{uuid.uuid4().hex[:8]}"
        request.addfinalizer(lambda: reset(name))
        return f"memory://{name}"
    if request.param == "rabbitmq":  # its inbox in the test's Redis
        rabbitmq_url = request.getfixturevalue("rabbitmq_url")
        return f"{rabbitmq_url}?inbox={quote(redis_url, safe='')}"
    return redis_url


async def test_round_trip_returns_the_handlers_value_decoded(url: str) -> None:
    svc = pricing_service(f"p{uuid.uuid4().hex[:6]}")
    async with ServiceHarness([svc], url=url) as hs:
        price = await hs.client.request(f"{svc.name}.quote", Quote("a", 3), timeout=5, response=Price)
        assert price == Price("a", 750)
        # many at once, one reply each, in any order
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                got: dict[int, Price] = {}

                async def ask(i: int) -> None:
                    got[i] = await hs.client.request(f"{svc.name}.quote", Quote(f"s{i}", i), timeout=5, response=Price)

                for i in range(20):
                    tg.start_soon(ask, i)
        assert got == {i: Price(f"s{i}", 250 * i) for i in range(20)}
        # a request from a handler (ctx.request), and a sync handler's reply
        assert await hs.client.request(f"{svc.name}.total", Quote("b", 4), timeout=5) == {"total": 1000}
        assert await hs.client.request(f"{svc.name}.sync", Quote("c", 1), timeout=5, response=Price) == Price("c", 7)
        assert hs.client.reply_stats["replies"] == 23
        assert hs.client.reply_stats["late_replies"] == 0


async def test_handler_exception_comes_back_as_a_typed_error(url: str) -> None:
    svc = pricing_service(f"p{uuid.uuid4().hex[:6]}")
    async with ServiceHarness([svc], url=url) as hs:
        with pytest.raises(RequestFailed) as info:
            await hs.client.request(f"{svc.name}.quote", Quote("a", -1), timeout=5, response=Price)
        assert info.value.error_type == "builtins.ValueError"
        assert info.value.error_message == "quantity -1 is negative"
        assert info.value.destination == f"{svc.name}.quote"
        assert "quantity -1 is negative" in str(info.value)
        [dead] = await hs.dead_letters()  # dead-lettered as any failed command
        assert dead.error_message == "quantity -1 is negative"
        # an invalid payload too (dead-lettered at admission, never run)
        with pytest.raises(RequestFailed, match="invalid payload"):
            await hs.client.request(f"{svc.name}.quote", {"sku": "x"}, timeout=5, response=Price)


async def test_timeout_names_the_destination_and_says_when_nobody_consumes_it(url: str) -> None:
    async with Client(url, namespace=f"t{uuid.uuid4().hex[:8]}") as client:
        started = time.monotonic()
        with pytest.raises(RequestTimeout) as info:
            await client.request("nobody.listens", Quote("a", 1), timeout=0.3, response=Price)
        assert time.monotonic() - started < 3
        assert "'nobody.listens'" in str(info.value) and "no group is subscribed" in str(info.value)
        assert isinstance(info.value, TimeoutError)
        with pytest.raises(ValueError, match="positive number of seconds"):
            await client.request("nobody.listens", Quote("a", 1), timeout=0)


async def test_a_reply_that_does_not_decode_names_the_field(url: str) -> None:
    svc = pricing_service(f"p{uuid.uuid4().hex[:6]}")
    async with ServiceHarness([svc], url=url) as hs:
        with pytest.raises(ReplyDecodeError) as info:
            await hs.client.request(f"{svc.name}.quote", Quote("a", 1), timeout=5, response=Priced)
        assert "currency" in str(info.value) and "Priced" in str(info.value)


async def test_late_replies_are_counted_and_dropped_and_deadline_passed_is_not_run(url: str) -> None:
    runs: list[str] = []
    release = anyio.Event()
    svc = pricing_service(f"p{uuid.uuid4().hex[:6]}", runs=runs, release=release)
    async with ServiceHarness([svc], url=url) as hs:
        # (a deadline long enough for the handler to start on a loaded machine: one that passed
        # before the start would be acked unrun, and no reply would come)
        with pytest.raises(RequestTimeout):
            await hs.client.request(f"{svc.name}.quote", Quote("slow", 1), timeout=1.5, response=Price)
        assert "slow" in runs
        release.set()
        # the slow handler replies after the timeout: counted as late, dropped
        with anyio.fail_after(10):
            while hs.client.reply_stats["late_replies"] < 1:
                await hs.client.request(f"{svc.name}.quote", Quote("x", 1), timeout=5, response=Price)
                await anyio.sleep(0.1)
        # a request whose deadline passed before any handler took it is acked unrun
        await hs.stop()
        runs.clear()
        with pytest.raises(RequestTimeout):
            await hs.client.request(f"{svc.name}.quote", Quote("expired", 1), timeout=0.2, response=Price)
        await hs.start()
        await hs.run_until_idle()
        assert "expired" not in runs
        assert hs.stats()[f"{svc.name}.quote"]["expired"] == 1
        assert await hs.dead_letters() == []


async def test_only_the_first_reply_per_request_is_kept(url: str) -> None:
    async with Client(url, namespace=f"t{uuid.uuid4().hex[:8]}") as client:
        broker = await client.connect()

        async def answer_twice() -> None:  # a replier whose request was redelivered after its reply went out
            with anyio.fail_after(5):
                while True:
                    spec = await broker.get_destination("twice")
                    stored = await as_introspection_messages(broker, spec)
                    if stored:
                        break
                    await anyio.sleep(0.02)
            request = stored[0]
            for cents in (1, 2):
                reply = Envelope(
                    destination=request.headers[h.REPLY_TO],
                    kind="command",
                    type="Price",
                    body=f'{{"sku": "a", "cents": {cents}}}'.encode(),
                    headers={h.IN_REPLY_TO: request.id, h.REPLY_STATUS: "ok"},
                    id=derive_id(request.id, "reply"),
                )
                await as_replies(broker).send_replies([reply])

        async with anyio.create_task_group() as tg:
            tg.start_soon(answer_twice)
            price = await client.request("twice", Quote("a", 1), timeout=5, response=Price)
        assert price == Price("a", 1)
        with anyio.fail_after(5):
            while client.reply_stats["duplicate_replies"] < 1:
                await anyio.sleep(0.02)
        assert client.reply_stats["replies"] == 1


async def as_introspection_messages(broker: object, spec: object) -> list[Envelope]:
    from broker.capabilities import as_introspection

    if spec is None:
        return []
    return list(await as_introspection(broker).stored_messages(spec))  # type: ignore[arg-type]


async def test_reply_destination_is_deleted_on_close_and_expires_when_its_requester_is_gone(url: str) -> None:
    namespace = f"t{uuid.uuid4().hex[:8]}"
    svc = pricing_service(f"p{uuid.uuid4().hex[:6]}")
    async with ServiceHarness([svc], url=url, namespace=namespace) as hs:
        store = as_replies(hs.broker)
        client = Client(broker=hs.broker, reply_ttl=0.6)
        await client.request(f"{svc.name}.quote", Quote("a", 1), timeout=5, response=Price)
        name = client._requester.name  # type: ignore[union-attr]
        assert await store.replies_exist(name)
        await client.close()  # a clean close deletes it at once
        assert not await store.replies_exist(name)
        # a requester whose connection is gone without a close (its process died): gone after the time to live
        idle = Client(url, namespace=namespace, reply_ttl=0.6)
        await idle.request(f"{svc.name}.quote", Quote("b", 1), timeout=5, response=Price)
        name = idle._requester.name  # type: ignore[union-attr]
        assert await store.replies_exist(name)
        await idle.broker.close()  # the connection drops; nothing deletes the destination
        # (not polled: asking RabbitMQ whether a queue exists counts as a use that keeps it)
        await anyio.sleep(0.6 + 1.5)  # its time to live and a margin
        assert not await store.replies_exist(name)
        # a reply to a destination that is gone is dropped, not stored without an expiry
        reply = Envelope(destination=name, kind="command", type="x", body=b"{}", headers={h.IN_REPLY_TO: "r"})
        assert await store.send_replies([reply]) == 0
        assert not await store.replies_exist(name)


def test_a_requester_process_killed_mid_request_leaves_nothing_behind(redis_url: str, namespace: str) -> None:
    """SIGKILL a process waiting on a request: its reply stream is gone after its time to live."""
    code = f"""
import anyio, sys
from framework.client import Client
async def main():
    async with Client({redis_url!r}, namespace={namespace!r}, reply_ttl=1.0) as c:
        async def ask():
            await c.request("nobody.home", {{"a": 1}}, timeout=60)
        async with anyio.create_task_group() as tg:
            tg.start_soon(ask)
            await anyio.sleep(0.3)
            print(c._requester.name, flush=True)
            await anyio.sleep(60)
anyio.run(main)
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout is not None
        name = proc.stdout.readline().strip()
        assert name.startswith("rq-")

        async def exists() -> bool:
            b = await connect(redis_url, namespace=namespace)
            try:
                return await as_replies(b).replies_exist(name)
            finally:
                await b.close()

        assert anyio.run(exists)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 5
        while anyio.run(exists):
            assert time.monotonic() < deadline, "the dead requester's reply stream did not expire"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


_ = TEST_SETTINGS


@pytest.mark.fault
@pytest.mark.slow
def test_a_worker_killed_mid_request_still_gives_exactly_one_reply(
    workers: Workers, redis_url: str, namespace: str
) -> None:
    import redis

    from framework import SyncClient

    r = redis.Redis.from_url(redis_url)
    opts = ("--visibility-timeout", "1")
    a = workers.start("replyapp:pricing", "a", *opts, JOB_SLEEP="30")
    with SyncClient(redis_url, namespace=namespace) as client:

        def kill_a_then_start_b() -> None:
            wait_for(lambda: r.get(f"{namespace}:test:started"), 30, "worker a to start the request")
            a.kill()  # SIGKILL mid-handler: no reply, no ack
            a.wait()
            workers.start("replyapp:pricing", "b", *opts, JOB_SLEEP="0")

        import threading

        killer = threading.Thread(target=kill_a_then_start_b)
        killer.start()
        reply = client.request("pricing.quote", {"sku": "k", "qty": 2}, timeout=30)
        killer.join()
        assert reply == {"sku": "k", "cents": 500}
        assert int(r.hget(f"{namespace}:test:runs", "k") or 0) == 2  # a's run and b's
        assert client.reply_stats["replies"] == 1


@pytest.mark.fault
@pytest.mark.slow
def test_a_worker_killed_after_its_reply_before_its_ack_answers_once(
    workers: Workers, redis_url: str, namespace: str
) -> None:
    import redis

    from framework import SyncClient

    r = redis.Redis.from_url(redis_url)
    opts = ("--visibility-timeout", "1")
    a = workers.start("replyapp:pricing", "a", *opts, DIE_AFTER_REPLY="1")
    with SyncClient(redis_url, namespace=namespace) as client:
        reply = client.request("pricing.quote", {"sku": "d", "qty": 1}, timeout=30)
        assert reply == {"sku": "d", "cents": 250}
        assert a.wait(timeout=10) == -9  # killed right after the reply went out, before the ack
        # the redelivered request runs again on b and replies again: the requester drops that copy
        workers.start("replyapp:pricing", "b", *opts)
        wait_for(lambda: int(r.hget(f"{namespace}:test:runs", "d") or 0) == 2, 30, "b to run the redelivered request")

        def stats() -> dict[str, int]:
            return client.reply_stats

        # (the reader runs while requests wait: the next request reads the copy left on the stream)
        assert client.request("pricing.quote", {"sku": "e", "qty": 1}, timeout=30) == {"sku": "e", "cents": 250}
        wait_for(lambda: stats()["duplicate_replies"] == 1, 10, "the second reply to be dropped as a duplicate")
        assert stats()["replies"] == 2


def test_the_request_reply_guide_example_runs_as_written(tmp_path: Path) -> None:
    doc = (ROOT / "docs" / "request-reply.md").read_text()
    [block] = [b for b in re.findall(r"```python\n(.*?)```", doc, flags=re.S) if b.startswith("# pricing.py")]
    (tmp_path / "pricing.py").write_text(block)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "pricing.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "failed: builtins.ValueError quantity must be positive, not 0" in run.stdout
    assert "no reply from 'inventory.check' within 0.2 s (no group is subscribed" in run.stdout
    assert "'replies': 3, 'late_replies': 0" in run.stdout  # the error reply counts; ctx.request's are the worker's


async def test_replies_after_redis_effects_commit_and_through_middleware(redis_url: str) -> None:
    """A handler with ``ctx.redis_transaction()`` replies once its writes committed; with middleware the
    chain's outcome decides (a middleware that fails the run gets the requester an error reply, not the
    handler's value)."""
    name = f"p{uuid.uuid4().hex[:6]}"
    svc = Service(name, retry=RetryPolicy(max_attempts=1))

    @svc.command(f"{name}.count")
    async def count(q: Quote, ctx: Context) -> int:
        ctx.redis_transaction().hincrby(f"{ctx.hash_tag}:counts", q.sku, q.qty)
        value = await ctx.redis.hget(f"{ctx.hash_tag}:counts", q.sku)
        return int(value or 0) + q.qty  # what the commit makes it

    @svc.command(f"{name}.echo")
    async def echo(q: Quote, ctx: Context) -> Quote:
        return q

    seen: list[str] = []

    async def audit(message: object, ctx: Context, call_next: object) -> object:
        outcome = await call_next()  # type: ignore[operator]
        seen.append(outcome.status)
        if ctx.headers.get("x-refuse"):
            raise PermissionError("refused by policy")
        return outcome

    async with ServiceHarness([svc], url=redis_url) as hs:
        assert await hs.client.request(f"{name}.count", Quote("a", 2), timeout=5, response=int) == 2
        assert await hs.client.request(f"{name}.count", Quote("a", 3), timeout=5, response=int) == 5
    async with ServiceHarness([svc], url=redis_url, middleware=[audit]) as hs:  # type: ignore[list-item]
        assert await hs.client.request(f"{name}.count", Quote("b", 1), timeout=5, response=int) == 1
        assert await hs.client.request(f"{name}.echo", Quote("c", 1), timeout=5, response=Quote) == Quote("c", 1)
        with pytest.raises(RequestFailed, match="refused by policy"):
            await hs.client.request(f"{name}.echo", Quote("c", 1), timeout=5, headers={"x-refuse": "1"})
        assert seen[:2] == ["success", "success"]


async def test_bad_input_fails_before_anything_is_sent(redis_url: str) -> None:
    from types import SimpleNamespace

    from broker import ConfigurationError
    from framework.requests import Requester

    thin = SimpleNamespace(transport="thin", capabilities=frozenset())
    with pytest.raises(ConfigurationError, match="'replies' capability, which the thin transport does not have"):
        Requester(thin, lambda items: anyio.lowlevel.checkpoint())  # type: ignore[arg-type]
    async with Client(redis_url, namespace=f"t{uuid.uuid4().hex[:8]}") as client:
        with pytest.raises(TypeError, match="is not a payload type: give an attrs class"):
            await client.request("q", {}, timeout=1, response=object())
        with pytest.raises(TypeError, match="payload type Thing is not supported"):
            await client.request("q", {}, timeout=1, response=type("Thing", (), {}))
        for bad in (-1, 0, float("nan"), "2", True):
            with pytest.raises(ValueError, match="positive number of seconds"):
                await client.request("q", {}, timeout=bad)
        assert await client.broker.get_destination("q") is None  # nothing was declared or sent
