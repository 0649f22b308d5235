"""The RabbitMQ transport's broker: the Broker contract over quorum queues, one facade over its roles.

As :class:`broker.redis.RedisBroker`, :class:`RabbitBroker` is made of role mixins over
:class:`~broker.rabbitmq.core.RabbitCore`: topology (registry stream, queues, bindings), reading
(consumers and what they hold), publishing (confirms, the delay chain), settlement, administration
(dead letters) and introspection (passive declares), each in its module of ``broker/rabbitmq/``.
"""

from __future__ import annotations

from typing import Any

import aio_pika.abc

from broker.capabilities import DEAD_LETTER_ADMIN, INBOX, INTROSPECTION, OWNERSHIP, REPLIES, SCHEDULING
from broker.operators import WORKERS
from broker.rabbitmq.inbox import SideInbox
from broker.rabbitmq.presence import Presence
from broker.rabbitmq.replies import Replies
from broker.rabbitmq.side import SideCounters, SideLeases, SideSchedule, SideWorkers

__all__ = ["RabbitBroker"]


class RabbitBroker(Presence, Replies):
    """Broker on a RabbitMQ server (3.10 or newer). Use :func:`broker.rabbitmq.connect_rabbitmq` (or
    ``broker.connect("amqp://...")``) to build one.

    Keeps the :class:`~broker.Broker` contract with the degraded promises written in
    :mod:`broker.rabbitmq` and declares ``dead_letter_admin``, ``introspection`` and ``replies``, and ``inbox`` when
    it was given an inbox store (``inbox``, a :class:`~broker.rabbitmq.inbox.SideInbox`: the Redis
    inbox from :func:`broker.connect`), and ``scheduling`` when it was given a schedule store (``schedule``,
    a :class:`~broker.rabbitmq.side.SideSchedule`: the Redis one beside the inbox), and ``ownership`` when
    it was given partition leases (``leases``: the Redis ones beside the inbox; they balance, not fence), and
    ``workers`` when it was given a heartbeat store (``workers``);
    no ``state`` or ``redis``.
    """

    transport = "rabbitmq"
    capabilities = frozenset({DEAD_LETTER_ADMIN, INTROSPECTION, REPLIES})
    exclusive_partitions = True
    """The server delivers each partition of several to one consumer at a time (single active consumer), so
    per-key order across processes holds without leases; with the ``ownership`` capability the runtime uses
    leases too, to balance partitions over workers (without it, it reads every partition and the server
    picks the one reader)."""

    def __init__(
        self,
        connection: aio_pika.abc.AbstractConnection,
        *,
        inbox: SideInbox | None = None,
        schedule: SideSchedule | None = None,
        leases: SideLeases | None = None,
        counters: SideCounters | None = None,
        workers: SideWorkers | None = None,
        **options: Any,
    ) -> None:
        super().__init__(connection, **options)
        self.side_inbox = inbox
        self.side_schedule = schedule
        self.side_leases = leases
        self.side_counters = counters
        self.side_workers = workers
        extra = {INBOX} if inbox is not None else set()  # per instance: the class declares what every one has
        if schedule is not None:
            extra.add(SCHEDULING)
        if leases is not None:
            extra.add(OWNERSHIP)
        if workers is not None:
            extra.add(WORKERS)
        self.capabilities = frozenset({*self.capabilities, *extra})
        self._ready = set()
        self._chain_ready = False
        self._feeds = {}
        self._held = {}
        self._seen = {}
        self._starting = {}
        self._attempts = {}
