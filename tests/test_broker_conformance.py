"""The Broker contract (broker/protocol.py) checked on every transport by the conformance kit.

Runs each check of :data:`broker.conformance.CHECKS` against each transport of :data:`TRANSPORTS`
(as Watermill's ``pubsub/tests`` run every test against each Pub/Sub's constructor and its
``Features``): a check needing a feature the transport does not claim is skipped with the reason.
What only the Redis transport offers or stores (keys, Lua scripts, ``commit_effects`` of Redis
commands, typed state operations as the commands they become) is checked in
``tests/test_redis_transport.py``.
"""

from __future__ import annotations

import importlib.util
import uuid
from collections.abc import Callable, Mapping
from typing import Any, cast
from urllib.parse import quote

import anyio
import pytest

from broker import Broker, GroupPartition, connect
from broker.capabilities import as_redis
from broker.conformance import CHECKS, BrokerFactory, Check, Features
from broker.redis import RedisBroker

pytestmark = pytest.mark.anyio

MEMORY_BUILT = importlib.util.find_spec("broker.memory") is not None


async def redis_store_raw(broker: Broker, view: GroupPartition, fields: Mapping[bytes, bytes]) -> None:
    """An entry appended past the codec, straight into the partition's stream."""
    await as_redis(broker).redis.xadd(view.stream, dict(fields))


def redis_streams(request: pytest.FixtureRequest) -> tuple[BrokerFactory, Features]:
    """:class:`~broker.redis.RedisBroker` on the session's server (embedded Valkey unless REDIS_URL is
    set), in the test's own namespace."""
    url, namespace = request.getfixturevalue("redis_url"), request.getfixturevalue("namespace")
    return (lambda: connect(url, namespace=namespace)), Features.of(RedisBroker.capabilities, store_raw=redis_store_raw)


async def memory_store_raw(broker: Broker, view: GroupPartition, fields: Mapping[bytes, bytes]) -> None:
    """An entry appended past the codec, straight into the memory server's log of the partition."""
    server = cast(Any, broker).server  # the memory broker's own state, beyond the contract
    server.stream(view.stream).add([part for pair in fields.items() for part in pair])


def memory(request: pytest.FixtureRequest) -> tuple[BrokerFactory, Features]:
    """The in-process transport (``broker.memory``) on a server of its own per test, dropped after it."""
    from broker.memory import MemoryBroker, reset

    url = f"memory://conf-{uuid.uuid4().hex}"
    request.addfinalizer(lambda: reset(url))
    return (lambda: connect(url)), Features.of(MemoryBroker.capabilities, store_raw=memory_store_raw)


async def rabbitmq_store_raw(broker: Broker, view: GroupPartition, fields: Mapping[bytes, bytes]) -> None:
    """A message published past the codec, straight into the group's queue: headers only, no id."""
    import aio_pika

    channel = await cast(Any, broker)._channel("publish", confirms=True)  # the broker's own channel
    headers = {name.decode(): bytearray(value) for name, value in fields.items()}  # AMQP byte arrays
    await channel.default_exchange.publish(aio_pika.Message(b"", headers=headers), view.keys.queue)


def rabbitmq(request: pytest.FixtureRequest) -> tuple[BrokerFactory, Features]:
    """:class:`~broker.rabbitmq.RabbitBroker` on the local RabbitMQ, in the session's own virtual host and
    the test's own namespace (skipped when the server is unreachable, failed under CI), with the Redis
    inbox on the session's Redis server (``?inbox=``)."""
    from broker.rabbitmq import RabbitBroker

    url, namespace = request.getfixturevalue("rabbitmq_url"), f"conf-{uuid.uuid4().hex[:8]}"
    url += "?inbox=" + quote(request.getfixturevalue("redis_url"), safe="")
    return (lambda: connect(url, namespace=namespace)), rabbitmq_features(RabbitBroker.capabilities)


def rabbitmq_features(capabilities: frozenset[str]) -> Features:
    """What the RabbitMQ transport claims: its capabilities and the Redis inbox and schedule beside it, minus
    the promises docs/transports.md lists as gaps."""
    return Features.of(
        capabilities | {"scheduling", "ownership"},
        inbox=True,
        retention=False,
        idempotency_keys=False,
        parked_retries=False,
        atomic_settlement=False,
        fencing=False,
        store_raw=rabbitmq_store_raw,
    )


TRANSPORTS: dict[str, Callable[[pytest.FixtureRequest], tuple[BrokerFactory, Features]]] = {
    "redis": redis_streams,
    "memory": memory,
    "rabbitmq": rabbitmq,
}
"""Each transport: its factory and the features it claims (a new transport is one more entry)."""

NOT_BUILT = {"memory": "broker.memory (the in-process transport) is not built yet"} if not MEMORY_BUILT else {}


@pytest.fixture(
    params=[
        pytest.param(name, marks=pytest.mark.skip(reason=NOT_BUILT[name])) if name in NOT_BUILT else name
        for name in TRANSPORTS
    ]
)
def transport(request: pytest.FixtureRequest) -> tuple[BrokerFactory, Features]:
    return TRANSPORTS[request.param](request)


@pytest.mark.parametrize("check", list(CHECKS.values()), ids=str)
async def test_conformance(transport: tuple[BrokerFactory, Features], check: Check) -> None:
    make, features = transport
    reason = check.skip_reason(features)
    if reason is not None:
        pytest.skip(reason)
    with anyio.fail_after(120):  # each check closes the brokers it made, however it ends
        await check(make, features)


def test_every_check_says_what_it_checks() -> None:
    undocumented = [c.name for c in CHECKS.values() if not c.fn.__doc__]
    assert not undocumented, f"checks without a docstring: {undocumented}"
