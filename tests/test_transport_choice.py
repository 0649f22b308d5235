"""Choosing a transport: by URL scheme, what each refuses, and services checked against what it offers."""

from __future__ import annotations

from types import SimpleNamespace

import attrs
import pytest

from broker import BrokerUnavailable, connect, resolve_url
from broker.capabilities import INBOX, INTROSPECTION, OWNERSHIP, SCHEDULING, as_state
from broker.memory import reset
from framework import Context, HandlerError, Queue, RetryPolicy, Service
from framework.runtime.requirements import check_requirements
from framework.saga import Saga, SagaContext
from framework.testing import TEST_SETTINGS, ServiceHarness
from tests.conftest import run_cli

pytestmark = pytest.mark.anyio


@attrs.frozen
class Pay:
    order_id: str


async def test_an_unknown_scheme_names_the_schemes_there_are() -> None:
    with pytest.raises(BrokerUnavailable) as caught:
        await connect("kafka://guest:secret@127.0.0.1:9092/")
    message = str(caught.value)
    assert "redis://" in message and "memory://" in message and "unix://" in message and "amqp://" in message
    assert "secret" not in message  # the password never reaches a message


def test_broker_url_wins_over_redis_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:6379/0")
    monkeypatch.setenv("BROKER_URL", "memory://shop")
    assert resolve_url() == "memory://shop"
    assert resolve_url("redis://127.0.0.1:6380/0") == "redis://127.0.0.1:6380/0"  # an explicit URL wins


def _tiny_saga() -> tuple[Service, Saga[dict]]:
    shipping = Service("shipping")
    saga = shipping.saga("fulfilment", state=dict)

    @saga.command(Queue("shipping.start"), correlate=lambda m: m.order_id)
    async def start(msg: Pay, ctx: SagaContext[dict]) -> None:
        ctx.state["n"] = ctx.state.get("n", 0) + 1

    return shipping, saga


async def test_a_saga_runs_on_memory_and_is_refused_at_start_without_a_state_store() -> None:
    """A saga keeping its state in the transport's state store needs the ``state`` capability: memory
    has it (the saga runs); a transport without it refuses the service at start, naming the saga."""
    shipping, saga = _tiny_saga()
    url = "memory://saga-runs"
    try:
        async with ServiceHarness([shipping], url=url) as h:
            await h.client.send("shipping.start", Pay("o-1"))
            await h.client.send("shipping.start", Pay("o-1"))
            await h.run_until_idle()
            store = as_state(h.broker)
            key = store.state_key(saga.queue.name, saga.queue.spec().partition_for("o-1", ""), "o-1")
            assert await store.read_state(key, ("v", "s")) == [b"2", b'{"n":2}']
    finally:
        reset(url)

    thin = SimpleNamespace(transport="thin", capabilities=frozenset({INBOX, OWNERSHIP, SCHEDULING, INTROSPECTION}))
    with pytest.raises(HandlerError) as caught:
        check_requirements(thin, [shipping], TEST_SETTINGS)  # type: ignore[arg-type]
    message = str(caught.value)
    assert "thin transport" in message and "'state'" in message and "saga shipping.fulfilment" in message


async def test_a_redis_transaction_on_memory_dead_letters_with_the_reason() -> None:
    """``ctx.redis_transaction()`` needs the ``redis`` capability, which memory lacks: the run fails with
    the reason (the saga steps' own state commits go through ``state`` instead)."""
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
