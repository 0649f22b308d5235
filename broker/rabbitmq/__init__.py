"""The RabbitMQ transport: the Broker contract on RabbitMQ 3.10+ quorum queues, with no plugin.

``broker.connect("amqp://user:password@host:5672/vhost")`` (or ``amqps://``, or
``BROKER_URL=amqp://...``) gives a :class:`RabbitBroker`; query parameters ``prefetch`` (unacknowledged
messages per consumed queue, default 1000), ``delivery_limit`` (the quorum queues' crash-loop net,
default 50), ``timeout`` (seconds, every call's bound, default 10) and ``heartbeat`` (seconds, default 10)
tune it. A lost connection is opened again on the next call; what it held goes back to its queues. The layout is in
:mod:`broker.rabbitmq.names`.

What it keeps:

* **Commands** go to a durable quorum queue per partition of the destination (its one group reads it),
  with ``x-delivery-limit``, at-least-once dead-lettering to the group's DLQ and ``reject-publish``
  overflow: a message that kills its worker over and over ends in the DLQ, not in a loop.
* **Events** go to the namespace's topic exchange; each subscribing group has a quorum queue per
  partition bound to it, so every group gets every event published after it subscribed.
* **Publishes** are confirmed, ``mandatory`` with returns raised, with a ``message_id``; one key goes
  to one partition (the CRC-32 of :meth:`DestinationSpec.partition_for`, as on Redis).
* **Acks** are manual, after processing; per consumed queue at most ``prefetch`` are unacknowledged.
* **Retries** wait in a chain of fixed-TTL quorum queues (power-of-two delays, 100 ms resolution)
  that dead-letter them to the group's own queue when due. **Scheduled messages** (``send(delay=)``)
  and recurring jobs' ticks are kept in the Redis beside the server (:mod:`broker.rabbitmq.scheduling`:
  listed and cancelled by ``framework schedule``, published by every runtime's mover when due);
  with ``?inbox=none`` scheduled messages take the delay chain too, unlisted, and recurring jobs are
  refused.
* **Dead letters** are republished, with the reason as headers, to the group's DLQ, then acked;
  listed, redriven and purged through ``framework dlq``.

What it does not keep (``docs/transports.md`` has the table):

* **No retention or replay**: a group gets only events published after it subscribed; ``start`` and
  ``trim`` change nothing.
* **Retry and dead letter are two steps** (a confirmed copy, then the ack): a crash between them
  runs the message again (a duplicate, never a loss).
* **No claim by idle time, no lease to extend, no fencing**: the server requeues what a closed
  channel held; a handler past the server's ``consumer_timeout`` (30 min on 3.10) loses its channel.
* **The inbox is kept beside the server**, in Redis (:mod:`broker.rabbitmq.inbox`; ``?inbox=`` of the
  URL, ``$FRAMEWORK_INBOX_URL``, else ``$REDIS_URL`` or the embedded Valkey: see :func:`broker.connect`).
* **No state store, no idempotency keys** (except for scheduled messages, kept in Redis): the runtime
  stops at start naming what is missing (a saga keeps its state in SQL instead: ``sql=``).
* **Partitions** are ordered per queue by single active consumer: one worker at a time reads a
  partition. Which one is decided by leases in the Redis beside the server
  (:mod:`broker.rabbitmq.ownership`: balance, not fencing); with ``?inbox=none`` the server picks.
"""

from __future__ import annotations

import aiormq.exceptions
import anyio

from broker.errors import BrokerUnavailable, register_transport_errors
from broker.rabbitmq.broker import RabbitBroker
from broker.rabbitmq.connection import open_connection, split_url
from broker.rabbitmq.core import is_closed_error
from broker.rabbitmq.inbox import SideInbox
from broker.rabbitmq.names import Layout
from broker.rabbitmq.side import SideCounters, SideLeases, SideSchedule, SideWorkers
from broker.urls import default_namespace, redact

__all__ = ["RabbitBroker", "connect_rabbitmq"]

register_transport_errors(
    connection=(
        aiormq.exceptions.AMQPConnectionError,
        aiormq.exceptions.ChannelInvalidStateError,
        aiormq.exceptions.ConnectionClosed,
    ),
    closed=is_closed_error,
    any_error=(aiormq.exceptions.AMQPError,),
)


async def connect_rabbitmq(
    url: str,
    *,
    namespace: str | None = None,
    inbox: SideInbox | None = None,
    schedule: SideSchedule | None = None,
    leases: SideLeases | None = None,
    counters: SideCounters | None = None,
    workers: SideWorkers | None = None,
) -> RabbitBroker:
    """Connect to the RabbitMQ server ``url`` names and declare the namespace's exchanges; raise
    :class:`BrokerUnavailable` in one line saying what to do (never hang: every step is bounded).
    ``inbox``: the inbox's store (the broker then declares ``inbox``; it closes the store with itself);
    ``schedule``: the scheduled messages' store (the broker then declares ``scheduling``); ``leases``: the
    partition leases' store (``ownership``: balance over workers); ``counters``: named counters beside the
    server (the registry's version: the registry stream is re-read only after a change); ``workers``: worker
    heartbeats beside the server (``workers``: live workers in ``framework status``)."""
    client_url, options = split_url(url)
    timeout = float(options.get("timeout", 10.0))
    where = redact(url)
    connection = await open_connection(url, client_url, timeout)
    broker = RabbitBroker(
        connection,
        url=url,
        client_url=client_url,
        namespace=namespace or default_namespace(),
        inbox=inbox,
        schedule=schedule,
        leases=leases,
        counters=counters,
        workers=workers,
        **options,
    )
    try:
        if broker.server_version and tuple(int(x) for x in broker.server_version.split(".")[:2]) < (3, 10):
            raise BrokerUnavailable(
                f"RabbitMQ at {where} is {broker.server_version}: the transport needs 3.10 or newer "
                "(quorum queues with message TTL and at-least-once dead-lettering)"
            )
        layout = Layout(broker.namespace)
        with anyio.fail_after(timeout):
            await broker._exchange(layout.events)
            await broker._exchange(layout.delivery)
    except BaseException:
        await broker.close()
        raise
    return broker
