"""The Redis inbox beside RabbitMQ (``broker/rabbitmq/inbox.py``, ``broker/redis/side_inbox.py``): where its
server comes from, its keys, the order of the record and the AMQP ack, leases released by retries and dead
letters, redeliveries taking leases over, and one-line errors when its Redis is away.

Runs on the local RabbitMQ (skipped when unreachable, failed under CI) and the session's Redis server.
The conformance kit's inbox checks run on RabbitMQ too (``tests/test_broker_conformance.py``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import attrs
import pytest
import redis.asyncio as aredis

from broker import Broker, BrokerUnavailable, GroupPartition, connect
from broker.capabilities import INBOX, as_inbox, as_introspection
from broker.conformance.support import command
from broker.envelope import Envelope, now_ms
from broker.redis.keys import KeySpace
from broker.topology import DestinationSpec
from broker.urls import redact
from framework import Context, HandlerError, Service
from framework.runtime.requirements import check_requirements
from framework.testing import TEST_SETTINGS

pytestmark = pytest.mark.anyio

RUN, DUPLICATE, ELSEWHERE = 0, 1, 2
LEASE = 60_000


def with_inbox(amqp_url: str, inbox: str) -> str:
    return f"{amqp_url}?inbox={quote(inbox, safe='')}"


@pytest.fixture
def ns() -> str:
    return f"ri-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def rabbit(rabbitmq_url: str, redis_url: str, ns: str) -> AsyncIterator[Broker]:
    broker = await connect(with_inbox(rabbitmq_url, redis_url), namespace=ns)
    yield broker
    await broker.close()


async def _queue(broker: Broker, name: str = "billing.charge") -> GroupPartition:
    spec = await broker.declare(DestinationSpec(name, "command"))
    [view] = await broker.subscribe(spec, "billing")
    return view


@attrs.frozen
class Charge:
    order_id: str


def _services() -> tuple[Service, Service]:
    billing = Service("billing")  # the default inbox: the Redis one

    @billing.command("billing.charge")
    async def charge(cmd: Charge, ctx: Context) -> None: ...

    lean = Service("lean", inbox=False)

    @lean.command("lean.charge")
    async def charge_lean(cmd: Charge, ctx: Context) -> None: ...

    return billing, lean


async def test_the_default_inbox_runs_on_rabbitmq_and_inbox_none_turns_it_off(
    rabbitmq_url: str, redis_url: str, ns: str
) -> None:
    """With the Redis inbox (here ``?inbox=``) the broker declares ``inbox`` and a service with the default
    inbox is accepted; ``?inbox=none`` turns it off: the start is refused naming the handler, as before."""
    billing, lean = _services()
    broker = await connect(with_inbox(rabbitmq_url, redis_url), namespace=ns)
    try:
        assert INBOX in broker.capabilities
        check_requirements(broker, [billing, lean], TEST_SETTINGS)
        await as_inbox(broker).inbox_ready()
    finally:
        await broker.close()
    off = await connect(f"{rabbitmq_url}?inbox=none", namespace=ns)
    try:
        assert INBOX not in off.capabilities
        with pytest.raises(HandlerError, match=r"rabbitmq transport lacks.*billing.charge needs 'inbox'"):
            check_requirements(off, [billing], TEST_SETTINGS)
        check_requirements(off, [lean], TEST_SETTINGS)
    finally:
        await off.close()


async def test_the_inbox_server_comes_from_the_url_else_the_environment(
    rabbitmq_url: str, redis_url: str, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``?inbox=`` first, else ``$FRAMEWORK_INBOX_URL``, else ``$REDIS_URL`` (else the embedded Valkey, not
    started here); a URL of another scheme is refused in one line."""
    monkeypatch.setenv("FRAMEWORK_INBOX_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("REDIS_URL", redis_url)
    broker = await connect(rabbitmq_url, namespace=ns)
    try:
        with pytest.raises(BrokerUnavailable, match=r"127\.0\.0\.1:1/0 \(FRAMEWORK_INBOX_URL\)"):
            await as_inbox(broker).inbox_ready()
    finally:
        await broker.close()
    monkeypatch.delenv("FRAMEWORK_INBOX_URL")
    broker = await connect(rabbitmq_url, namespace=ns)
    try:
        await as_inbox(broker).inbox_ready()  # REDIS_URL's server
    finally:
        await broker.close()
    with pytest.raises(BrokerUnavailable, match="invalid inbox URL"):
        await connect(with_inbox(rabbitmq_url, "http://example.com/"), namespace=ns)


async def test_an_unreachable_inbox_server_is_one_line_fast_and_the_runtime_stops_at_start(
    rabbitmq_url: str, ns: str
) -> None:
    """Publishing needs no inbox (nothing connects to it); using it, or starting services that need it,
    fails within the connect timeout with one line naming the server and how to start one."""
    from framework.runtime import Runtime

    url = with_inbox(rabbitmq_url, "redis://:secret-pw@127.0.0.1:1/0")
    broker = await connect(url, namespace=ns)
    try:
        view = await _queue(broker)
        await broker.publish([command(view.spec.name, 1)])  # the inbox's server is not needed to publish
        started = time.monotonic()
        with pytest.raises(BrokerUnavailable) as caught:
            await as_inbox(broker).inbox_ready()
        assert time.monotonic() - started < 8, "an unreachable inbox server took longer than its connect timeout"
        message = str(caught.value)
        assert "\n" not in message and "secret-pw" not in message, message
        assert "inbox's Redis at redis://:***@127.0.0.1:1/0" in message and "redis-server" in message, message
        with pytest.raises(BrokerUnavailable, match="inbox's Redis"):
            await as_inbox(broker).read_leased(view, "c", 10, 100, lease_ms=LEASE)
        state = await as_introspection(broker).group_state(view)  # framework status still answers
        assert state.inbox.ids == 0, state
    finally:
        await broker.close()
    billing, _ = _services()
    runtime = Runtime([billing], url=url, namespace=ns, settings=TEST_SETTINGS)
    with pytest.raises(BrokerUnavailable, match="inbox's Redis"):
        await runtime.run()
    assert "secret-pw" not in redact(url) and "secret-pw" not in repr(redact(url))


async def test_keys_are_the_redis_transports_and_share_the_partitions_hash_tag(
    rabbit: Broker, redis_url: str, ns: str
) -> None:
    """A leased id sits in the zset the Redis transport keeps for the same group partition; its record
    after the ack in the buckets beside it (same hash tag), which ``inbox_memory`` (framework status) reads."""
    view = await _queue(rabbit)
    sent = command(view.spec.name, 1)
    await rabbit.publish([sent])
    [d] = await as_inbox(rabbit).read_leased(view, "c", 10, 2000, lease_ms=LEASE)
    assert d.inbox_status == RUN
    keys = KeySpace(ns).partition(view.spec.name, 0).group("billing")
    client = aredis.Redis.from_url(redis_url)
    try:
        assert (await client.zscore(keys.inbox, sent.id) or 0) < 0, "the lease is in the group partition's zset"
        assert await rabbit.ack(view, [d], inbox=True) == 1
        assert await client.zscore(keys.inbox, sent.id) is None, "the ack replaced the lease by a record"
        stored = [k.decode() async for k in client.scan_iter(f"{keys.inbox}*", count=1000)]
        tag = "{" + f"{view.spec.name}:0" + "}"
        assert stored and all(tag in k for k in stored), stored
    finally:
        await client.aclose()
    memory = await as_introspection(rabbit).inbox_memory(view)
    assert memory.ids >= 1, memory


async def test_ids_are_recorded_before_the_amqp_ack(rabbit: Broker) -> None:
    """An ack whose message was requeued meanwhile (its channel closed) still records the id: the
    redelivered copy is found processed, a duplicate dropped, never a second run."""
    view = await _queue(rabbit)
    sent = command(view.spec.name, 1)
    await rabbit.publish([sent])
    inbox = as_inbox(rabbit)
    [d] = await inbox.read_leased(view, "c", 10, 2000, lease_ms=LEASE)
    feed: Any = rabbit._feeds[view.keys.queue]  # type: ignore[attr-defined]
    await feed.channel.close()  # what the AMQP ack would confirm is gone: the server requeues it
    assert await rabbit.ack(view, [d], inbox=True) == 0, "nothing held here to ack"
    [again] = await inbox.read_leased(view, "c", 10, 5000, lease_ms=LEASE)
    assert again.message_id == sent.id and again.delivery_count > 1
    assert again.inbox_status == DUPLICATE, "the requeued copy of a recorded message runs again"


async def test_a_redelivery_takes_the_lease_of_a_closed_connection_over(
    rabbitmq_url: str, redis_url: str, ns: str, rabbit: Broker
) -> None:
    """A worker that read (and leased) a message dies: the server requeues it and the next reader runs it at
    once (its delivery count says it is redelivered), not after the lease's end."""
    view = await _queue(rabbit)
    await rabbit.publish([command(view.spec.name, 1)])
    [d] = await as_inbox(rabbit).read_leased(view, "a", 10, 2000, lease_ms=LEASE)
    assert d.inbox_status == RUN
    await rabbit.close()  # its connection closes: the message goes back to the queue
    other = await connect(with_inbox(rabbitmq_url, redis_url), namespace=ns)
    try:
        [again] = await as_inbox(other).read_leased(view, "b", 10, 5000, lease_ms=LEASE)
        assert again.message_id == d.message_id and again.delivery_count == 2
        assert again.inbox_status == RUN, "a redelivery waits for the dead reader's lease"
    finally:
        await other.close()


async def test_retries_and_dead_letters_release_the_lease(rabbit: Broker) -> None:
    """A retried message's copy is leased again at once (its lease was released before the copy went out);
    after a dead letter a new copy of the message runs (released, not recorded)."""
    view = await _queue(rabbit)
    first, second = command(view.spec.name, 1), command(view.spec.name, 2)
    await rabbit.publish([first, second])
    inbox = as_inbox(rabbit)
    got = await inbox.read_leased(view, "c", 10, 2000, lease_ms=LEASE)
    assert [d.inbox_status for d in got] == [RUN, RUN]
    retried, dead = got
    assert await rabbit.retry_later(retried, now_ms())
    [copy] = await inbox.read_leased(view, "c", 10, 5000, lease_ms=LEASE)
    assert copy.message_id == first.id and copy.delivery_count == 1
    assert copy.inbox_status == RUN, "the retry's copy found the released lease still live"
    assert await rabbit.dead_letter(dead, {"dlq-reason": "test"})
    again = command(view.spec.name, 2)
    again.id = second.id
    await rabbit.publish([again])
    [republished] = await inbox.read_leased(view, "c", 10, 5000, lease_ms=LEASE)
    assert republished.inbox_status == RUN, "a dead-lettered message's lease outlived it"


async def test_extend_pushes_out_the_leases_of_what_is_held(rabbit: Broker, redis_url: str, ns: str) -> None:
    view = await _queue(rabbit)
    sent = command(view.spec.name, 1)
    await rabbit.publish([sent])
    [d] = await as_inbox(rabbit).read_leased(view, "c", 10, 2000, lease_ms=1000)
    key = KeySpace(ns).partition(view.spec.name, 0).group("billing").inbox
    client = aredis.Redis.from_url(redis_url)
    try:
        before = -float(await client.zscore(key, sent.id) or 0)
        assert await rabbit.extend(view, "c", [d], lease_ms=LEASE) == {d.entry_id}
        after = -float(await client.zscore(key, sent.id) or 0)
        assert after >= before + LEASE - 2000, (before, after)
    finally:
        await client.aclose()


async def test_without_a_url_the_inbox_starts_and_uses_the_embedded_valkey(
    rabbitmq_url: str, ns: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of the box (no ``?inbox=``, ``FRAMEWORK_INBOX_URL`` or ``REDIS_URL``) the inbox is the per-user
    embedded Valkey, started on first use (here in a ``FRAMEWORK_HOME`` of the test's own)."""
    from broker.redis.embedded import EmbeddedServer, default_data_dir

    for name in ("FRAMEWORK_INBOX_URL", "REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FRAMEWORK_HOME", str(tmp_path / "home"))
    server = EmbeddedServer(default_data_dir())
    broker = await connect(rabbitmq_url, namespace=ns)
    try:
        assert not server.status().running, "connecting started the inbox's server (publishers never need it)"
        view = await _queue(broker)
        await broker.publish([command(view.spec.name, 1)])
        [d] = await as_inbox(broker).read_leased(view, "c", 10, 2000, lease_ms=LEASE)
        assert d.inbox_status == RUN and server.status().running
        assert await broker.ack(view, [d], inbox=True) == 1
        assert (await as_introspection(broker).inbox_memory(view)).ids == 1
    finally:
        await broker.close()
        server.stop()


def test_framework_run_stops_at_start_with_one_line_when_the_inbox_redis_is_away(rabbitmq_url: str, ns: str) -> None:
    """``framework run`` of a service with the default inbox exits 1 at start, saying which server and how to
    start one, without a traceback and within seconds."""
    import os

    from tests.conftest import ROOT, run_cli

    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "BROKER_URL", "FRAMEWORK_INBOX_URL")}
    env.update(
        BROKER_URL=with_inbox(rabbitmq_url, "redis://:pw-not-shown@127.0.0.1:1/0"),
        FRAMEWORK_NAMESPACE=ns,
        PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "apps"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        RUNS_DIR="/nonexistent",
    )
    started = time.monotonic()
    out = run_cli("run", "rabbitapp:billing", env=env, timeout=60)
    assert out.returncode == 1, out.stdout + out.stderr
    assert time.monotonic() - started < 30
    errors = [line for line in out.stderr.splitlines() if line.startswith("framework run:")]
    assert len(errors) == 1 and "cannot reach the inbox's Redis at redis://:***@127.0.0.1:1/0" in errors[0], out.stderr
    assert "redis-server" in errors[0] and "Traceback" not in out.stderr and "pw-not-shown" not in out.stderr


async def test_unsubscribe_forgets_the_groups_inbox(rabbit: Broker) -> None:
    """``framework unsubscribe`` on RabbitMQ deletes the group's inbox records with its queues: a group
    subscribing again later runs what it gets."""
    from broker.capabilities import as_dead_letter_admin

    spec = await rabbit.declare(DestinationSpec("billing.paid", "event"))
    [view] = await rabbit.subscribe(spec, "billing")
    sent = Envelope(destination=spec.name, kind="event", type="E", body=b"{}")
    await rabbit.publish([sent])
    [d] = await as_inbox(rabbit).read_leased(view, "c", 10, 2000, lease_ms=LEASE)
    assert await rabbit.ack(view, [d], inbox=True) == 1
    assert (await as_introspection(rabbit).inbox_memory(view)).ids == 1
    await as_dead_letter_admin(rabbit).unsubscribe(spec, "billing")
    assert (await as_introspection(rabbit).inbox_memory(view)).ids == 0
