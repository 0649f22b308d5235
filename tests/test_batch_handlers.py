"""Batch handlers: batches form by size and by wait, keep key order, and settle each message on its own.

Every test runs on the embedded Valkey and on ``memory://`` (the ``url`` fixture below).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import quote

import anyio
import attrs
import pytest

from framework import (
    BatchContext,
    BatchFailed,
    BatchPolicy,
    HandlerError,
    Queue,
    RetryPolicy,
    Service,
)
from framework.testing import ServiceHarness

pytestmark = pytest.mark.anyio

DOC = Path(__file__).resolve().parents[1] / "docs" / "batch-handlers.md"
QUICK = RetryPolicy(max_attempts=2, immediate=1, backoff=0.01, jitter=False)


@pytest.fixture(params=["redis", "memory"])
def url(request: pytest.FixtureRequest, redis_url: str) -> Iterator[str]:
    """The embedded Valkey, and a ``memory://`` server of the test's own."""
    yield redis_url if request.param == "redis" else f"memory://batch-{uuid.uuid4().hex}"


@pytest.fixture
def rabbit_url(rabbitmq_url: str, redis_url: str) -> str:
    """The local RabbitMQ, its inbox on the embedded Valkey (skipped when RabbitMQ is unreachable)."""
    return f"{rabbitmq_url}?inbox={quote(redis_url, safe='')}"


@attrs.frozen
class Posting:
    account: str
    n: int


async def test_batches_form_by_size_and_then_by_max_wait(url: str, namespace: str) -> None:
    svc = Service("ledger")
    sizes: list[int] = []
    stamps: list[float] = []

    @svc.command("ledger.post", batch=BatchPolicy(max_size=10, max_wait=0.3))
    async def post(postings: list[Posting], ctx: BatchContext) -> None:
        assert all(isinstance(p, Posting) for p in postings) and len(ctx) == len(postings)
        sizes.append(len(postings))
        stamps.append(time.monotonic())

    async with ServiceHarness([svc], url=url, namespace=namespace) as h:
        await h.client.send_many("ledger.post", [Posting("a", n) for n in range(25)])
        await h.run_until_idle()
        assert sizes == [10, 10, 5]  # two full batches at once, the rest when its wait ran out
        sent = time.monotonic()
        await h.client.send_many("ledger.post", [Posting("a", n) for n in range(3)])
        await h.run_until_idle()
        assert sizes[3:] == [3]
        assert stamps[3] - sent >= 0.25  # held for max_wait, waiting for more
        assert h.stats()["ledger.post"]["processed"] == 28


async def test_key_order_holds_across_batches_of_a_partition(url: str, namespace: str) -> None:
    svc = Service("ledger")
    seen: dict[str, list[int]] = defaultdict(list)
    running = 0
    overlap = False

    @svc.command(Queue("ledger.post", partitions=2), batch=BatchPolicy(max_size=7, max_wait=0.01))
    async def post(postings: list[Posting]) -> None:
        nonlocal running, overlap
        running += 1
        overlap = overlap or running > 2  # one batch per partition at a time
        await anyio.sleep(0.002 * len(postings))
        for p in postings:
            seen[p.account].append(p.n)
        running -= 1

    async with ServiceHarness([svc], url=url, namespace=namespace) as h:
        for start in range(0, 200, 20):
            await h.client.send_many(
                "ledger.post", [Posting(f"acct-{n % 5}", n) for n in range(start, start + 20)], key=lambda p: p.account
            )
        await h.run_until_idle()
    assert sum(len(v) for v in seen.values()) == 200
    for account, ns in seen.items():
        assert ns == sorted(ns), f"{account} ran out of order: {ns}"
    assert not overlap


async def test_batch_failed_retries_and_dead_letters_only_the_named_messages(url: str, namespace: str) -> None:
    svc = Service("ledger", retry=QUICK)
    calls: Counter[int] = Counter()
    applied: Counter[int] = Counter()

    @svc.command("ledger.post", batch=BatchPolicy(max_size=5, max_wait=0.2))
    async def post(postings: list[Posting], ctx: BatchContext) -> None:
        failed: dict[int, BaseException] = {}
        for i, p in enumerate(postings):
            calls[p.n] += 1
            if p.n == 2:
                failed[i] = ValueError(f"posting {p.n} is poison")
            elif p.n == 4 and calls[p.n] == 1:
                failed[i] = ConnectionError("ledger busy")
            else:
                applied[p.n] += 1
                ctx[i].publish("ledger.posted", {"n": p.n})
        if failed:
            raise BatchFailed(failed)

    async with ServiceHarness([svc], url=url, namespace=namespace) as h:
        await h.client.send_many("ledger.post", [Posting("a", n) for n in range(5)])
        await h.run_until_idle()
        [dead] = await h.dead_letters()
        posted = sorted(json.loads(m.body)["n"] for m in await h.messages("ledger.posted"))
        stats = h.stats()["ledger.post"]
    assert applied == {0: 1, 1: 1, 3: 1, 4: 1}  # each once: the others were not run again
    assert calls[2] == 2 and calls[4] == 2 and calls[0] == 1
    assert dead.error_type.endswith("ValueError") and dead.error_message == "posting 2 is poison"
    assert dead.attempts == 2
    if not url.startswith("amqp"):  # (RabbitMQ keeps no event that no queue subscribes to)
        assert posted == [0, 1, 3, 4]  # the poison message's staged event was dropped with it
    assert stats["processed"] == 4 and stats["dead_lettered"] == 1 and stats["failed"] == 3


async def test_any_other_exception_fails_and_retries_the_whole_batch(url: str, namespace: str) -> None:
    svc = Service("ledger", retry=QUICK)
    calls: Counter[int] = Counter()
    runs = 0

    @svc.command("ledger.post", batch=BatchPolicy(max_size=4, max_wait=0.2))
    async def post(postings: list[Posting]) -> None:
        nonlocal runs
        runs += 1
        for p in postings:
            calls[p.n] += 1
        if runs == 1:
            raise RuntimeError("database down")

    async with ServiceHarness([svc], url=url, namespace=namespace) as h:
        await h.client.send_many("ledger.post", [Posting("a", n) for n in range(4)])
        await h.run_until_idle()
        stats = h.stats()["ledger.post"]
        assert await h.dead_letters() == []
    assert calls == {0: 2, 1: 2, 2: 2, 3: 2}
    assert stats["failed"] == 4 and stats["processed"] == 4


async def test_all_or_nothing_fails_every_message_with_its_own_reason(url: str, namespace: str) -> None:
    svc = Service("ledger", retry=QUICK)
    calls: Counter[int] = Counter()

    @svc.command("ledger.post", batch=BatchPolicy(max_size=3, max_wait=0.2, all_or_nothing=True))
    async def post(postings: list[Posting]) -> None:
        for p in postings:
            calls[p.n] += 1
        raise BatchFailed({i: ValueError(f"posting {p.n} is poison") for i, p in enumerate(postings) if p.n == 1})

    async with ServiceHarness([svc], url=url, namespace=namespace) as h:
        await h.client.send_many("ledger.post", [Posting("a", n) for n in range(3)])
        await h.run_until_idle()
        dead = {json.loads(d.body)["n"]: d for d in await h.dead_letters()}
    assert calls == {0: 2, 1: 2, 2: 2}  # the batch ran twice as one
    assert len(dead) == 3
    assert dead[1].error_message == "posting 1 is poison"
    assert dead[0].error_type == "framework.batching.BatchAborted"
    assert "message 1 failed with ValueError: posting 1 is poison" in dead[2].error_message


async def test_a_batch_failed_index_outside_the_batch_fails_the_whole_batch(url: str, namespace: str) -> None:
    svc = Service("ledger", retry=RetryPolicy(max_attempts=1))

    @svc.command("ledger.post", batch=BatchPolicy(max_size=3, max_wait=0.2))
    async def post(postings: list[Posting]) -> None:
        raise BatchFailed({7: ValueError("wrong index")})

    async with ServiceHarness([svc], url=url, namespace=namespace) as h:
        await h.client.send_many("ledger.post", [Posting("a", n) for n in range(3)])
        await h.run_until_idle()
        dead = await h.dead_letters()
        stats = h.stats()["ledger.post"]
    assert len(dead) == 3 and stats["processed"] == 0  # nothing acked in another message's place
    assert all("BatchFailed index 7 is outside the batch of 3 messages" in d.error_message for d in dead)


async def test_undecodable_messages_go_to_the_dead_letter_queue_not_to_the_handler(url: str, namespace: str) -> None:
    svc = Service("ledger")
    got: list[int] = []

    @svc.command("ledger.post", batch=BatchPolicy(max_size=10, max_wait=0.1))
    async def post(postings: list[Posting]) -> None:
        got.extend(p.n for p in postings)

    async with ServiceHarness([svc], url=url, namespace=namespace) as h:
        await h.client.send_many("ledger.post", [{"account": "a", "n": 0}, {"nope": 1}, {"account": "a", "n": 2}])
        await h.run_until_idle()
        [dead] = await h.dead_letters()
    assert got == [0, 2]
    assert "invalid payload" in dead.reason


async def test_the_handler_timeout_applies_to_the_batch_call(url: str, namespace: str) -> None:
    svc = Service("ledger", retry=QUICK)
    runs = 0

    @svc.command("ledger.post", batch=BatchPolicy(max_size=3, max_wait=0.1), timeout=0.3)
    async def post(postings: list[Posting]) -> None:
        nonlocal runs
        runs += 1
        if runs == 1:
            await anyio.sleep(10)

    async with ServiceHarness([svc], url=url, namespace=namespace) as h:
        started = time.monotonic()
        await h.client.send_many("ledger.post", [Posting("a", n) for n in range(3)])
        await h.run_until_idle()
        stats = h.stats()["ledger.post"]
    assert time.monotonic() - started < 5
    assert runs == 2 and stats["failed"] == 3 and stats["processed"] == 3


async def test_a_republished_copy_is_dropped_by_the_inbox(url: str, namespace: str) -> None:
    svc = Service("ledger")
    got: list[int] = []

    @svc.command("ledger.post", batch=BatchPolicy(max_size=10, max_wait=0.05))
    async def post(postings: list[Posting]) -> None:
        got.extend(p.n for p in postings)

    async with ServiceHarness([svc], url=url, namespace=namespace) as h:
        await h.client.send("ledger.post", Posting("a", 1), message_id="m-1")
        await h.run_until_idle()
        await h.client.send("ledger.post", Posting("a", 1), message_id="m-1")
        await h.client.send("ledger.post", Posting("a", 2), message_id="m-2")
        await h.run_until_idle()
        stats = h.stats()["ledger.post"]
    assert got == [1, 2]
    assert stats["duplicates"] == 1


async def test_a_sync_batch_handler_runs_in_a_worker_thread(url: str, namespace: str) -> None:
    svc = Service("ledger")
    got: list[list[int]] = []

    @svc.command("ledger.post", batch=BatchPolicy(max_size=4, max_wait=0.1))
    def post(postings: list[Posting], ctx: BatchContext) -> None:
        got.append([p.n for p in postings])
        for i in range(len(ctx)):
            ctx[i].publish("ledger.posted", {"n": postings[i].n})

    async with ServiceHarness([svc], url=url, namespace=namespace) as h:
        await h.client.send_many("ledger.post", [Posting("a", n) for n in range(6)])
        await h.run_until_idle()
        posted = await h.messages("ledger.posted")
    assert got == [[0, 1, 2, 3], [4, 5]]
    assert len(posted) == 6


def test_the_example_of_the_batch_handlers_guide_runs_as_written(tmp_path: Path) -> None:
    [block] = [b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S) if "memory://" in b]
    (tmp_path / "example.py").write_text(block)
    env = {**os.environ, "PYTHONPATH": str(DOC.parents[1])}  # this checkout's framework
    run = subprocess.run(
        [sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def test_a_batch_handler_must_take_a_list() -> None:
    svc = Service("ledger")
    with pytest.raises(HandlerError, match=r"annotate its first parameter as list\[YourPayload\], not 'Posting'"):

        @svc.command("ledger.post", batch=BatchPolicy())
        async def post(posting: Posting) -> None: ...

    with pytest.raises(HandlerError, match="batch= takes a BatchPolicy"):
        svc.command("ledger.other", batch=500)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_wait must be seconds between 0 and 60"):
        BatchPolicy(max_wait=-1)


@pytest.mark.parametrize(
    ("failures", "reason"),
    [
        ({"0": ValueError()}, "BatchFailed index '0' is not an int"),
        ({-1: ValueError()}, "BatchFailed index -1 is outside the batch of 3 messages"),
        ({1: "bad"}, "BatchFailed\\[1\\] is 'bad', not an exception"),
        ({}, "BatchFailed names no failed message"),
    ],
)
def test_a_batch_failed_that_names_no_message_of_the_batch_says_why(failures: dict, reason: str) -> None:
    from framework.batching import checked_failures

    with pytest.raises(ValueError, match=reason):
        checked_failures(BatchFailed(failures), 3)


async def test_on_rabbitmq_batch_failed_settles_each_message_and_key_order_holds(rabbit_url: str) -> None:
    await test_batch_failed_retries_and_dead_letters_only_the_named_messages(rabbit_url, f"rb-{uuid.uuid4().hex[:8]}")
    await test_key_order_holds_across_batches_of_a_partition(rabbit_url, f"rb-{uuid.uuid4().hex[:8]}")


async def test_on_memory_and_sqlite_a_retried_batch_finds_its_committed_messages_and_applies_nothing_twice(
    tmp_path: Path,
) -> None:
    from sqlalchemy import text

    from framework import outbox

    engine = outbox.create_engine(f"sqlite:///{tmp_path / 'ledger.db'}")
    await outbox.create_tables(engine)
    async with engine.begin() as conn:
        await conn.execute(text("CREATE TABLE applied (n integer NOT NULL)"))
    svc = Service("ledger", retry=RetryPolicy(max_attempts=3, immediate=2), inbox="sql")
    runs: list[int] = []

    @svc.command("ledger.post", batch=BatchPolicy(max_size=5, max_wait=0.1))
    async def post(postings: list[Posting], ctx: BatchContext) -> None:
        runs.append(len(postings))
        async with ctx.sql_transaction(engine) as conn:
            await conn.execute(text("INSERT INTO applied (n) VALUES (:n)"), [{"n": p.n} for p in postings])
        if len(runs) == 1:
            raise RuntimeError("failed after the commit: the retry must find every message processed")

    try:
        async with ServiceHarness([svc], url=f"memory://batch-{uuid.uuid4().hex}") as h:
            await h.client.send_many("ledger.post", [Posting("a", n) for n in range(5)])
            await h.run_until_idle()
            stats = h.stats()["ledger.post"]
        async with engine.connect() as conn:
            applied = (await conn.execute(text("SELECT n FROM applied ORDER BY n"))).scalars().all()
            inbox = (await conn.execute(text("SELECT count(*) FROM framework_inbox"))).scalar_one()
    finally:
        await engine.dispose()
    assert applied == [0, 1, 2, 3, 4] and inbox == 5
    assert runs == [5, 5] and stats["duplicates"] == 5 and stats["failed"] == 5


async def test_per_message_redis_writes_commit_with_their_own_ack(redis_url: str, namespace: str) -> None:
    svc = Service("ledger", retry=RetryPolicy(max_attempts=1))
    key = f"{namespace}:test:balances"

    @svc.command("ledger.post", batch=BatchPolicy(max_size=4, max_wait=0.1))
    async def post(postings: list[Posting], ctx: BatchContext) -> None:
        for i, p in enumerate(postings):
            ctx[i].redis_transaction().hincrby(key, p.account, p.n)
        raise BatchFailed({i: ValueError("refused") for i, p in enumerate(postings) if p.account == "b"})

    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as h:
        await h.client.send_many("ledger.post", [Posting("a", 1), Posting("b", 10), Posting("a", 2)])
        await h.run_until_idle()
        balances = await h.broker.redis.hgetall(key)  # type: ignore[attr-defined]
        stats = h.stats()["ledger.post"]
    assert {k.decode(): int(v) for k, v in balances.items()} == {"a": 3}  # b's write went with its failure
    assert stats["processed"] == 2 and stats["dead_lettered"] == 1


async def test_a_batch_handler_reads_the_services_resources(namespace: str) -> None:
    svc = Service("ledger")
    seen: list[tuple[str, int]] = []

    @svc.resource
    async def books() -> AsyncIterator[str]:
        yield "the books"

    @svc.command("ledger.post", batch=BatchPolicy(max_size=2, max_wait=0.1))
    async def post(postings: list[Posting], ctx: BatchContext) -> None:
        seen.append((ctx.resources[books], len(postings)))

    async with ServiceHarness([svc], url=f"memory://batch-{uuid.uuid4().hex}", namespace=namespace) as h:
        await h.client.send_many("ledger.post", [Posting("a", n) for n in range(2)])
        await h.run_until_idle()
    assert seen == [("the books", 2)]
