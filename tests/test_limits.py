"""The maximum body size: producers refuse larger bodies with a clear error, consumers dead-letter them."""

from __future__ import annotations

import json
import time

import anyio
import pytest
import redis

from broker import new_id
from broker.codec import DEFAULT_MAX_BODY_BYTES
from broker.errors import MessageTooLarge
from framework import Client, Context, Runtime, Service
from framework.testing import TEST_SETTINGS
from tests.conftest import run_cli

pytestmark = pytest.mark.anyio


async def test_a_producer_refuses_a_body_over_the_limit_and_stores_nothing(redis_url: str, namespace: str) -> None:
    assert DEFAULT_MAX_BODY_BYTES == 1024 * 1024
    async with Client(redis_url, namespace=namespace, max_body_bytes=1000) as client:
        at_limit = b"x" * 1000
        assert await client.send("limits.q", at_limit) is not None  # at the limit: accepted
        with pytest.raises(MessageTooLarge) as caught:
            await client.send("limits.q", b"x" * 1001)
        assert "1,001 bytes, over the limit of 1,000 bytes" in str(caught.value)
        with pytest.raises(MessageTooLarge):
            async with client.batch() as batch:  # a batch is refused whole
                batch.send("limits.q", b"small")
                batch.send("limits.q", b"x" * 5000)
    r = redis.Redis.from_url(redis_url)
    assert r.xlen(f"{namespace}:{{limits.q:0}}") == 1
    r.close()


async def test_the_default_limit_refuses_a_huge_body_cleanly(redis_url: str, namespace: str) -> None:
    async with Client(redis_url, namespace=namespace) as client:
        with pytest.raises(MessageTooLarge) as caught:
            await client.send("limits.q", b"x" * (DEFAULT_MAX_BODY_BYTES + 1))
        assert "over the limit of 1,048,576 bytes" in str(caught.value)


@pytest.mark.slow
async def test_a_600_mb_body_fails_with_the_clear_error(redis_url: str, namespace: str) -> None:
    async with Client(redis_url, namespace=namespace) as client:
        with pytest.raises(MessageTooLarge, match="629,145,600 bytes"):
            await client.send("limits.q", bytes(600 * 1024 * 1024))


def test_cli_send_of_a_large_body_is_one_line(worker_env: dict[str, str]) -> None:
    env = {**worker_env, "FRAMEWORK_MAX_BODY_BYTES": "100"}
    out = run_cli("send", "limits.cli", json.dumps({"text": "x" * 200}), env=env)
    assert out.returncode in (1, 2)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "over the limit of 100 bytes" in lines[0], out.stderr
    bad = run_cli("send", "limits.cli", "{}", env={**worker_env, "FRAMEWORK_MAX_BODY_BYTES": "lots"})
    assert bad.returncode == 1 and "FRAMEWORK_MAX_BODY_BYTES='lots'" in bad.stderr.strip().splitlines()[-1]


async def test_a_worker_dead_letters_an_oversized_entry_with_the_reason(
    redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FRAMEWORK_MAX_BODY_BYTES", "1000")
    seen: list[int] = []
    svc = Service("limits")

    @svc.command("limits.jobs")
    async def handle(body: bytes, ctx: Context) -> None:
        seen.append(len(body))

    runtime = Runtime([svc], url=redis_url, namespace=namespace, settings=TEST_SETTINGS)
    r = redis.Redis.from_url(redis_url)
    stream = f"{namespace}:{{limits.jobs:0}}"
    dlq = f"{stream}:g:limits:dlq"
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(runtime.run)
            now = str(int(time.time() * 1000))
            for size in (2000, 1000):  # written raw, in the framework's field layout, past any producer
                r.xadd(stream, {"id": new_id(), "type": "bytes", "body": b"y" * size, "ts": now})
            deadline = time.monotonic() + 20
            while (r.xlen(dlq) < 1 or not seen) and time.monotonic() < deadline:
                await anyio.sleep(0.05)
            runtime.stop()
        assert seen == [1000]  # at the limit: handled
        [(_, fields)] = r.xrange(dlq)
        assert "2,000 bytes, over the limit of 1,000 bytes" in fields[b"dlq-reason"].decode()
        assert len(fields[b"body"]) == 2000  # kept for inspection: nothing dropped silently
    finally:
        r.close()


async def test_a_handler_staging_an_oversized_message_is_dead_lettered_at_once(redis_url: str, namespace: str) -> None:
    from framework import RetryPolicy
    from framework.dead_letters import DeadLetters
    from framework.testing import ServiceHarness

    calls: list[int] = []
    svc = Service("limits", retry=RetryPolicy(max_attempts=5, immediate=1, backoff=0.05))

    @svc.command("limits.fanout")
    async def fanout(cmd: dict, ctx: Context) -> None:
        calls.append(ctx.attempt)
        ctx.publish("limits.report", {"blob": "x" * (2 * DEFAULT_MAX_BODY_BYTES)})  # refused when staged

    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as h:
        message_id = await h.client.send("limits.fanout", {"n": 1})
        await h.run_until_idle()
        [dead] = await DeadLetters(h.broker).list()
        published = await h.messages("limits.report")
    assert calls == [1]  # not retried: the same body would be as large again
    assert dead.message_id == message_id and dead.error_type == "broker.errors.MessageTooLarge"
    assert "over the limit" in dead.error_message
    assert published == []
