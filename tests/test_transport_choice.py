"""Choosing a transport: by URL scheme, what each refuses, and services checked against what it offers."""

from __future__ import annotations

import attrs
import pytest

from broker import BrokerUnavailable, connect, resolve_url
from framework import Context, HandlerError, Queue, RetryPolicy, Service
from framework.testing import ServiceHarness
from tests.conftest import run_cli

pytestmark = pytest.mark.anyio


@attrs.frozen
class Pay:
    order_id: str


async def test_an_unknown_scheme_names_the_schemes_there_are() -> None:
    with pytest.raises(BrokerUnavailable) as caught:
        await connect("amqp://guest:secret@127.0.0.1:5672/")
    message = str(caught.value)
    assert "redis://" in message and "memory://" in message and "unix://" in message
    assert "secret" not in message  # the password never reaches a message


def test_broker_url_wins_over_redis_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:6379/0")
    monkeypatch.setenv("BROKER_URL", "memory://shop")
    assert resolve_url() == "memory://shop"
    assert resolve_url("redis://127.0.0.1:6380/0") == "redis://127.0.0.1:6380/0"  # an explicit URL wins


async def test_a_saga_keeping_its_state_in_redis_is_refused_at_start_on_memory() -> None:
    shipping = Service("shipping")
    saga = shipping.saga("fulfilment", state=dict)

    @saga.command(Queue("shipping.start"), correlate=lambda m: m.order_id)
    async def start(msg: Pay, ctx: object) -> None: ...

    with pytest.raises(HandlerError) as caught:
        async with ServiceHarness([shipping], url="memory://refusal"):
            pass
    message = str(caught.value)
    assert "memory transport" in message and "'redis'" in message and "saga shipping.fulfilment" in message


async def test_a_redis_transaction_on_memory_dead_letters_with_the_reason() -> None:
    svc = Service("ledger", retry=RetryPolicy(max_attempts=1))

    @svc.command("ledger.post")
    async def post(msg: Pay, ctx: Context) -> None:
        ctx.redis_transaction().hincrby("totals", "n", 1)

    async with ServiceHarness([svc], url="memory://effects") as h:
        await h.client.send("ledger.post", Pay("o-1"))
        await h.run_until_idle()
        [dead] = await h.dead_letters()
        assert "needs the Redis transport" in dead.error_message


@pytest.mark.parametrize("command", [["status"], ["run", "faultapp:worker"], ["dlq", "list"]])
def test_every_command_refuses_memory_urls_in_one_line(command: list[str], worker_env: dict[str, str]) -> None:
    env = dict(worker_env, BROKER_URL="memory://")
    out = run_cli(*command, env=env)
    assert out.returncode == 2, out.stderr
    [line] = out.stderr.strip().splitlines()
    assert "memory:// is an in-process transport" in line
    flag = run_cli(*command, "--broker-url", "memory://x", env=worker_env)
    assert flag.returncode == 2 and "in-process transport" in flag.stderr
