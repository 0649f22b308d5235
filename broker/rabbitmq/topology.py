"""The RabbitMQ broker's topology role: the destination registry, queues and bindings, subscriptions.

The registry is a journal (:mod:`broker.rabbitmq.journals`: a stream, ``{ns}/registry``) of
declare, subscribe, unsubscribe and delete records, read whole by every broker that needs it
(looked-up specs are cached). Two processes declaring one new destination at once both append a
record; the first one wins on reading.
"""

from __future__ import annotations

import logging
from typing import Any

import aio_pika

from broker.errors import ConfigurationError
from broker.protocol import GroupPartition, Start
from broker.rabbitmq.core import RabbitKeys
from broker.rabbitmq.journals import Journals
from broker.rabbitmq.names import DELAY_LEVELS, DELAY_UNIT_MS
from broker.rabbitmq.side import SideCounters
from broker.routing import Routing
from broker.topology import DestinationSpec, validate_name

__all__ = ["Registry", "Topology"]

_REGISTRY_VERSION = "rabbitmq-registry"
_log = logging.getLogger("broker.rabbitmq")

_NOUN = {"command": "a queue (commands: use send)", "event": "a topic (events: use publish)"}


class Registry:
    """What the registry stream says now: destinations and (destination, group) -> start."""

    def __init__(self) -> None:
        self.destinations: dict[str, DestinationSpec] = {}
        self.subscriptions: dict[tuple[str, str], str] = {}

    def apply(self, record: dict[str, Any]) -> None:
        """Apply one record (the first declaration of a name wins its kind and partitions)."""
        op = record.get("op")
        if op == "declare":
            spec = DestinationSpec.from_json(record["spec"])
            stored = self.destinations.get(spec.name)
            if stored is None or (stored.kind, stored.partitions) == (spec.kind, spec.partitions):
                self.destinations[spec.name] = spec
        elif op == "subscribe":
            self.subscriptions.setdefault((record["destination"], record["group"]), record.get("start", "earliest"))
        elif op == "unsubscribe":
            self.subscriptions.pop((record["destination"], record["group"]), None)
        elif op == "delete":
            self.destinations.pop(record["name"], None)
            for sub in [s for s in self.subscriptions if s[0] == record["name"]]:
                del self.subscriptions[sub]


class Topology(Journals, Routing):
    """Declares destinations (their queues and bindings), routes messages to them, creates groups."""

    _ready: set[str]
    _chain_ready: bool
    side_counters: SideCounters | None = None
    _registry_seen: tuple[int, Registry] | None = None  # (version, registry) of the last read

    async def _record(self, record: dict[str, Any]) -> None:
        """Append a record to the registry stream (confirmed), then raise the registry's version."""
        await self._declare_journal(self.layout.registry)
        await self._append(self.layout.registry, [record])
        if self.side_counters is not None:
            try:
                await self.side_counters.bump(_REGISTRY_VERSION)
            except Exception as exc:  # publishing needs no store beside the server: say what it costs
                _log.warning(
                    "could not raise the registry's version beside RabbitMQ: other processes see this change "
                    "at their next registry change (%s: %s)",
                    type(exc).__name__,
                    exc,
                )

    async def read_registry(self) -> Registry:
        """Every record of the registry stream up to now, applied in order. With counters beside the
        server, the stream is read again only when its version moved since this broker's last read
        (each read appends a marker to the stream: reads that change nothing must not make it grow)."""
        version: int | None = None
        if self.side_counters is not None:
            try:
                version = await self.side_counters.counter(_REGISTRY_VERSION)
            except Exception:  # the store beside the server is away: read the stream as without it
                version = None
        seen = self._registry_seen
        if version is not None and seen is not None and seen[0] == version:
            return seen[1]
        await self._declare_journal(self.layout.registry)
        registry = Registry()
        for record in await self._read_journal(self.layout.registry):
            registry.apply(record)
        if version is not None:  # read before the stream: a change since makes the next call read again
            self._registry_seen = (version, registry)
        return registry

    async def declare(self, spec: DestinationSpec) -> DestinationSpec:
        """Register ``spec`` and declare its queues; an existing registration wins unless it conflicts."""
        stored = self._specs.get(spec.name) or (await self.read_registry()).destinations.get(spec.name)
        if stored is None:
            await self._record({"op": "declare", "spec": spec.to_json()})
            stored = spec
        if stored.kind != spec.kind:
            raise ConfigurationError(f"{spec.name!r} is already declared as {_NOUN[stored.kind]}, not as {spec.kind}s")
        if stored.partitions != spec.partitions:
            raise ConfigurationError(
                f"{spec.name!r} already has {stored.partitions} partition(s); it cannot be declared with "
                f"{spec.partitions}. Changing a destination's partition count is not supported: "
                "use a new destination name, or declare it with the existing count."
            )
        if (stored.retention_ms, stored.max_length) != (spec.retention_ms, spec.max_length):
            await self._record({"op": "declare", "spec": spec.to_json()})  # the latest retention wins
            stored = spec
        if not spec.is_topic:
            for p in range(spec.partitions):
                await self._declare_queue(self.layout.queue(spec.name, p), exclusive=spec.partitions > 1)
        self._specs[spec.name] = stored
        return stored

    async def get_destination(self, name: str) -> DestinationSpec | None:
        """The declared spec of ``name``, or None (cached after the first look-up)."""
        spec = self._specs.get(name)
        if spec is None:
            spec = (await self.read_registry()).destinations.get(name)
            if spec is not None:
                self._specs[name] = spec
        return spec

    async def list_destinations(self) -> list[DestinationSpec]:
        """Every declared destination, sorted by name (read from the registry)."""
        return sorted((await self.read_registry()).destinations.values(), key=lambda s: s.name)

    async def list_subscriptions(self) -> list[tuple[str, str]]:
        """Every (destination, group) pair that has subscribed, sorted."""
        return sorted((await self.read_registry()).subscriptions)

    def group_partition(self, spec: DestinationSpec, partition: int, group: str) -> GroupPartition:
        """The view of ``group`` on one partition: its queue (a topic's: the group's own) and DLQ."""
        layout = self.layout
        queue = layout.group_queue(spec.name, partition, group) if spec.is_topic else layout.queue(spec.name, partition)
        stream = layout.event_key(spec.name, partition) if spec.is_topic else queue
        return GroupPartition(spec, partition, group, stream, RabbitKeys(queue, layout.dlq(queue)))

    async def subscribe(self, spec: DestinationSpec, group: str, start: Start = "earliest") -> list[GroupPartition]:
        """Declare ``spec`` and ``group``'s queues (a topic's: bound to its partitions' events).

        ``start`` is recorded but changes nothing: a new group gets only what is published after
        it subscribed (a queue keeps no history); queues keep what was sent before any group.
        ``ConfigurationError`` when another group already consumes the queue.
        """
        validate_name("group", group)
        spec = await self.declare(spec)
        registry = await self.read_registry()
        if not spec.is_topic:
            owners = {g for d, g in registry.subscriptions if d == spec.name} - {group}
            if owners:
                raise ConfigurationError(
                    f"queue {spec.name!r} is already consumed by {', '.join(sorted(owners))}; a queue has one "
                    f"owning service. Use a topic (events) if {group!r} should also get these messages."
                )
        views = [self.group_partition(spec, p, group) for p in range(spec.partitions)]
        if spec.is_topic:
            for view in views:
                await self._declare_queue(
                    view.keys.queue, exclusive=spec.partitions > 1, topic=(spec.name, view.partition)
                )
        if (spec.name, group) not in registry.subscriptions:
            await self._record({"op": "subscribe", "destination": spec.name, "group": group, "start": start})
        return views

    async def queue_counts(self, queue: str) -> tuple[int, int] | None:
        """(messages ready, consumers) of ``queue`` from a passive declare, None when it does not exist.

        On a channel of its own: a missing queue closes the channel that asked, which must not be one
        other tasks share."""
        channel = await (await self.live()).channel()
        try:
            found = await channel.declare_queue(queue, passive=True, timeout=self.timeout)
        except aio_pika.exceptions.ChannelNotFoundEntity:
            return None
        finally:
            if not channel.is_closed:
                await channel.close()
        result = found.declaration_result
        return result.message_count or 0, result.consumer_count or 0

    async def _declare_view(self, view: GroupPartition) -> None:
        """Declare the queue ``view``'s group reads (with its DLQ and bindings)."""
        spec = view.spec
        topic = (spec.name, view.partition) if spec.is_topic else None
        await self._declare_queue(view.keys.queue, exclusive=spec.partitions > 1, topic=topic)

    def queue_arguments(self, *, exclusive: bool = False) -> dict[str, Any]:
        """A group queue's arguments: quorum, the delivery limit, at-least-once dead-lettering to its DLQ;
        ``exclusive`` (a partition of several): single active consumer, so one reader keeps its order."""
        return {
            "x-single-active-consumer": exclusive,
            "x-queue-type": "quorum",
            "x-delivery-limit": self.delivery_limit,
            "x-dead-letter-exchange": "",
            "x-dead-letter-strategy": "at-least-once",
            "x-overflow": "reject-publish",
        }

    async def _declare_queue(self, queue: str, *, exclusive: bool, topic: tuple[str, int] | None = None) -> None:
        """Declare a group's queue with its DLQ and bindings (once per broker): the delivery exchange's
        binding for its own retries, and with ``topic`` its partition's events (live and scheduled)."""
        if queue in self._ready:
            return
        channel = await self._channel()
        layout = self.layout
        dlq = layout.dlq(queue)
        await channel.declare_queue(dlq, durable=True, arguments={"x-queue-type": "classic"}, timeout=self.timeout)
        args = {**self.queue_arguments(exclusive=exclusive), "x-dead-letter-routing-key": dlq}
        try:
            declared = await channel.declare_queue(queue, durable=True, arguments=args, timeout=self.timeout)
        except aio_pika.exceptions.ChannelPreconditionFailed as exc:
            raise ConfigurationError(
                f"queue {queue!r} exists with other arguments ({exc}); delete it (framework delete) or use "
                "another namespace"
            ) from None
        delivery = await self._exchange(layout.delivery)
        await declared.bind(delivery, layout.delivery_binding(queue), timeout=self.timeout)
        if topic is not None:
            events = await self._exchange(layout.events)
            await declared.bind(events, layout.event_key(*topic), timeout=self.timeout)
            await declared.bind(delivery, layout.delivery_binding(layout.topic_target(*topic)), timeout=self.timeout)
        self._ready.add(queue)

    async def _exchange(self, name: str) -> aio_pika.abc.AbstractExchange:
        """A durable topic exchange of this namespace (declared once per broker)."""
        channel = await self._channel()
        exchange = await channel.declare_exchange(name, aio_pika.ExchangeType.TOPIC, durable=True, timeout=self.timeout)
        self._ready.add(name)
        return exchange

    async def _ensure_delay_chain(self) -> None:
        """Declare the delay chain (see :mod:`broker.rabbitmq.names`) once per broker."""
        if self._chain_ready:
            return
        layout = self.layout
        channel = await self._channel()
        below = await self._exchange(layout.delivery)
        for level in range(DELAY_LEVELS):
            exchange = await self._exchange(layout.delay_exchange(level))
            queue = await channel.declare_queue(
                layout.delay_queue(level),
                durable=True,
                arguments={
                    "x-queue-type": "quorum",
                    "x-message-ttl": DELAY_UNIT_MS * 2**level,
                    "x-dead-letter-exchange": below.name,
                    "x-dead-letter-strategy": "at-least-once",
                    "x-overflow": "reject-publish",
                },
                timeout=self.timeout,
            )
            skip = "*." * (DELAY_LEVELS - 1 - level)
            await queue.bind(exchange, f"{skip}1.#", timeout=self.timeout)
            await below.bind(exchange, f"{skip}0.#", timeout=self.timeout)
            below = exchange
        self._chain_ready = True
