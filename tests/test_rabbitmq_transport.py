"""The RabbitMQ transport beyond the conformance kit: URLs, one-line errors, what services need of it, its layout.

Runs on the local RabbitMQ (``tests/rabbitmq_server.py``: skipped when it is unreachable, failed under CI).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from urllib.parse import urlsplit, urlunsplit

import attrs
import pytest

from broker import BrokerUnavailable, connect
from broker.rabbitmq import RabbitBroker
from broker.rabbitmq.names import DELAY_UNIT_MS, Layout, delay_bits
from broker.topology import DestinationSpec
from framework import Context, HandlerError, Service
from framework.runtime.requirements import check_requirements
from framework.testing import TEST_SETTINGS

pytestmark = pytest.mark.anyio


def _with(url: str, **parts: object) -> str:
    return urlunsplit(urlsplit(url)._replace(**parts))


async def test_amqp_urls_reach_the_rabbitmq_transport_and_read_the_server_version(rabbitmq_url: str) -> None:
    broker = await connect(rabbitmq_url, namespace=f"t-{uuid.uuid4().hex[:8]}")
    try:
        assert isinstance(broker, RabbitBroker) and broker.transport == "rabbitmq"
        major, minor = (int(x) for x in broker.server_version.split(".")[:2])
        assert (major, minor) >= (3, 10), f"server version {broker.server_version!r}"
    finally:
        await broker.close()


async def test_wrong_credentials_are_one_line_without_the_password(rabbitmq_url: str) -> None:
    parts = urlsplit(rabbitmq_url)
    bad = _with(rabbitmq_url, netloc=f"{parts.username}:wrong-secret@{parts.hostname}:{parts.port or 5672}")
    with pytest.raises(BrokerUnavailable, match="refused the login") as caught:
        await connect(bad)
    assert "wrong-secret" not in str(caught.value) and "\n" not in str(caught.value)


async def test_a_missing_vhost_says_how_to_create_it(rabbitmq_url: str) -> None:
    with pytest.raises(BrokerUnavailable, match="add_vhost no-such-vhost"):
        await connect(_with(rabbitmq_url, path="/no-such-vhost"))


async def test_an_unreachable_server_fails_fast_and_says_how_to_start_one() -> None:
    started = time.monotonic()
    with pytest.raises(BrokerUnavailable, match="rabbitmq-server -detached"):
        await connect("amqp://guest:guest@127.0.0.1:1/?timeout=3")
    assert time.monotonic() - started < 5, "connecting to a closed port took longer than its timeout"


def test_a_missing_client_library_says_which_extra_to_install() -> None:
    code = (
        "import sys, asyncio; sys.modules['aio_pika'] = None\n"
        "from broker import connect\n"
        "try:\n    asyncio.run(connect('amqp://guest:guest@127.0.0.1:5672/'))\n"
        "except Exception as exc:\n    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=os.environ)
    assert "pip install 'framework[rabbitmq]'" in out.stdout, out.stdout + out.stderr


async def test_a_queue_declared_earlier_with_other_arguments_is_a_clear_error(rabbitmq_url: str) -> None:
    import aio_pika

    namespace = f"t-{uuid.uuid4().hex[:8]}"
    queue = Layout(namespace).queue("billing.refund", 0)
    connection = await aio_pika.connect(rabbitmq_url)
    try:
        channel = await connection.channel()
        await channel.declare_queue(queue, durable=True)  # a classic queue where a quorum one belongs
        broker = await connect(rabbitmq_url, namespace=namespace)
        try:
            with pytest.raises(Exception, match="exists with other arguments"):
                await broker.declare(DestinationSpec("billing.refund", "command"))
        finally:
            await broker.close()
    finally:
        channel = await connection.channel()
        await channel.queue_delete(queue)
        await connection.close()


def test_delays_are_rounded_up_to_the_chain_resolution() -> None:
    assert delay_bits(1).endswith(".0.0.1"), "1 ms waits one unit"
    assert delay_bits(DELAY_UNIT_MS * 5).endswith(".1.0.1")
    assert delay_bits(0).replace("0", "").replace(".", "") == "", "no delay: all zero"


@attrs.frozen
class Charge:
    order_id: str


async def test_with_the_redis_inbox_turned_off_services_needing_it_are_refused_at_start(rabbitmq_url: str) -> None:
    """With ``?inbox=none`` the broker has no inbox store: a handler with the default inbox stops the start,
    naming it; one with ``inbox=False`` (or the SQL inbox) is accepted. (With the Redis inbox, the default,
    both start: ``tests/test_rabbitmq_inbox.py``, which also covers an unreachable inbox server.)"""
    billing = Service("billing")

    @billing.command("billing.charge")
    async def charge(cmd: Charge, ctx: Context) -> None: ...

    lean = Service("lean", inbox=False)

    @lean.command("lean.charge")
    async def charge_lean(cmd: Charge, ctx: Context) -> None: ...

    broker = await connect(f"{rabbitmq_url}?inbox=none", namespace=f"t-{uuid.uuid4().hex[:8]}")
    try:
        with pytest.raises(HandlerError, match=r"rabbitmq transport lacks.*billing.charge needs 'inbox'"):
            check_requirements(broker, [billing], TEST_SETTINGS)
        check_requirements(broker, [lean], TEST_SETTINGS)
    finally:
        await broker.close()


async def test_a_reset_connection_is_opened_again_and_loses_nothing(rabbitmq_url: str) -> None:
    """Connections cut by a reset (a restarted load balancer): the next calls reconnect on their own, and
    what the broker held unacknowledged comes back from the server, its delivery count raised."""
    import anyio

    from broker.errors import is_connection_error
    from tests.netproxy import NetProxy

    proxy = NetProxy.for_url(rabbitmq_url)
    try:
        broker = await connect(proxy.url(rabbitmq_url), namespace=f"t-{uuid.uuid4().hex[:8]}")
        try:
            spec = await broker.declare(DestinationSpec("billing.refund", "command"))
            [view] = await broker.subscribe(spec, "billing")
            await broker.publish([_command(spec.name, 1)])
            [held] = await broker.read(view, "a", 10, 2000)
            assert proxy.reset_all() >= 1
            for _ in range(50):  # the first calls may meet the dying connection: a connection error, retried
                try:
                    await broker.publish([_command(spec.name, 2)])
                    break
                except Exception as exc:
                    assert is_connection_error(exc), f"a reset connection raised {exc!r}, not a connection error"
                    await anyio.sleep(0.1)
            got: list = []
            with anyio.fail_after(30):
                while len(got) < 2:
                    got += await broker.read(view, "a", 10, 1000)
            assert sorted(d.envelope.body for d in got if d.envelope) == [b'{"n":1}', b'{"n":2}'], got
            [again] = [d for d in got if d.message_id == held.message_id]
            assert again.delivery_count == 2, f"the requeued message counts {again.delivery_count} deliveries"
            assert await broker.ack(view, got) == 2
        finally:
            await broker.close()
    finally:
        proxy.close()


def _command(queue: str, n: int, key: str | None = None):  # type: ignore[no-untyped-def]
    from broker.conformance.support import command

    return command(queue, n, key)


async def test_a_queue_deleted_under_its_consumer_is_declared_again_and_reading_goes_on(rabbitmq_url: str) -> None:
    """The server cancels the consumer of a deleted queue: the next read declares the queue again and
    consumes it anew (what the deleted queue held went with it: deleting a queue is an operator's act)."""
    import aio_pika
    import anyio

    broker = await connect(rabbitmq_url, namespace=f"t-{uuid.uuid4().hex[:8]}")
    connection = await aio_pika.connect(rabbitmq_url)
    try:
        spec = await broker.declare(DestinationSpec("billing.refund", "command"))
        [view] = await broker.subscribe(spec, "billing")
        await broker.publish([_command(spec.name, 1)])
        assert len(await broker.read(view, "a", 10, 2000)) == 1
        channel = await connection.channel()
        await channel.queue_delete(view.keys.queue)
        await anyio.sleep(0.2)  # the server's cancel reaches the broker
        assert await broker.read(view, "a", 10, 100) == []
        await broker.publish([_command(spec.name, 2)])
        got = await broker.read(view, "a", 10, 5000)
        assert [d.envelope.body for d in got if d.envelope] == [b'{"n":2}'], got
    finally:
        await connection.close()
        await broker.close()


async def test_a_partition_is_read_by_one_broker_at_a_time_and_handed_on_in_order(rabbitmq_url: str) -> None:
    """Single active consumer on a partition of several: a second reader gets nothing while the first
    lives; when the first one's connection closes, the second gets what it held first, in order."""
    namespace = f"t-{uuid.uuid4().hex[:8]}"
    a = await connect(rabbitmq_url, namespace=namespace)
    b = await connect(rabbitmq_url, namespace=namespace)
    try:
        spec = await a.declare(DestinationSpec("billing.refund", "command", partitions=2))
        views_a = await a.subscribe(spec, "billing")
        views_b = await b.subscribe(spec, "billing")
        p = spec.partition_for("k", "")
        await a.publish([_command(spec.name, i, key="k") for i in range(6)])
        first = await a.read(views_a[p], "a", 3, 2000)
        assert [d.envelope.body for d in first if d.envelope] == [b'{"n":%d}' % i for i in range(3)]
        assert await b.read(views_b[p], "b", 10, 300) == [], "a second reader got messages of an owned partition"
        await a.ack(views_a[p], first[:1])
        await a.close()  # holding 1, 2 (read) and 3..5 (delivered, not read)
        got: list = []
        while len(got) < 5:
            batch = await b.read(views_b[p], "b", 10, 5000)
            assert batch, f"the partition was not handed on: {len(got)} of 5 read"
            got += batch
        assert [d.envelope.body for d in got if d.envelope] == [b'{"n":%d}' % i for i in range(1, 6)], got
    finally:
        await b.close()
        await a.close()


async def test_a_stalled_connection_is_dropped_by_the_heartbeat_and_opened_again(rabbitmq_url: str) -> None:
    """A path that goes silent without closing (a dead NAT entry): calls fail within their bound instead
    of hanging, the heartbeat (1 s here) drops the connection, and once the path heals the broker
    reconnects by itself; the message it held comes back from the server."""
    import anyio

    from broker.errors import is_connection_error
    from tests.netproxy import NetProxy

    proxy = NetProxy.for_url(rabbitmq_url)
    try:
        url = proxy.url(rabbitmq_url) + "?heartbeat=1&timeout=3"
        broker = await connect(url, namespace=f"t-{uuid.uuid4().hex[:8]}")
        try:
            spec = await broker.declare(DestinationSpec("billing.refund", "command"))
            [view] = await broker.subscribe(spec, "billing")
            await broker.publish([_command(spec.name, 1)])
            [held] = await broker.read(view, "a", 10, 2000)
            proxy.stall()
            started = time.monotonic()
            with pytest.raises(Exception) as caught:  # any connection error: checked below
                with anyio.fail_after(20):
                    await broker.publish([_command(spec.name, 2)])
            assert is_connection_error(caught.value), f"a stalled publish raised {caught.value!r}"
            assert time.monotonic() - started < 10, "a stalled publish was not bounded by its timeout"
            proxy.resume()
            got: list = []
            with anyio.fail_after(60):
                while not got:
                    try:
                        got = await broker.read(view, "a", 10, 1000)
                    except Exception as exc:
                        assert is_connection_error(exc), f"reading after the stall raised {exc!r}"
                        await anyio.sleep(0.2)
            assert [d.message_id for d in got] == [held.message_id], "the held message did not come back"
            assert got[0].delivery_count == 2
        finally:
            await broker.close()
    finally:
        proxy.close()


async def test_a_message_over_the_servers_size_limit_is_one_line_and_the_connection_goes_on(rabbitmq_url: str) -> None:
    """A body under our limit (raised here) but over RabbitMQ's ``max_message_size`` (128 MiB on 3.10):
    the server closes the channel; the publish raises MessageTooLarge naming both sizes, the next works."""
    from broker import MessageTooLarge
    from broker.envelope import Envelope

    broker = await connect(f"{rabbitmq_url}?inbox=none&timeout=30", namespace=f"big-{uuid.uuid4().hex[:8]}")
    try:
        spec = await broker.declare(DestinationSpec("big.jobs", "command"))
        await broker.subscribe(spec, "big")
        broker.max_body_bytes = 256 * 2**20
        huge = Envelope(destination="big.jobs", kind="command", type="x", body=b"x" * (129 * 2**20))
        with pytest.raises(MessageTooLarge) as caught:
            await broker.publish([huge])
        message = str(caught.value)
        assert "\n" not in message and "135,266,304" in message and "134,217,728" in message, message
        assert "RabbitMQ" in message and "FRAMEWORK_MAX_BODY_BYTES" in message, message
        del huge
        small = Envelope(destination="big.jobs", kind="command", type="x", body=b"{}")
        assert await broker.publish([small]) == [small.id]
    finally:
        await broker.close()
