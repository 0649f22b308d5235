"""Subscribing: which topics each service's handlers read, at start and, for patterns, while running.

A handler declared on a name reads that destination. A handler declared on a topic pattern
(``"orders.*"``) reads every topic of the destination registry whose name it matches: the ones
there at start, and the ones created later, found by :meth:`Subscriptions.wire` run again every
``RuntimeSettings.pattern_refresh`` seconds (Redis has no server-side patterns; this is how
Kafka clients refresh metadata). Handlers of one service that fall on one topic share its group:
one consumer reads it and dispatches each message to the handler its filter picks
(:mod:`framework.runtime.dispatch`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta

import attrs

from broker import Broker, DestinationSpec, GroupPartition
from framework.handlers import Handler, Topic
from framework.logs import get_logger
from framework.runtime.consumer import Consumer
from framework.service import Service

__all__ = ["Subscriptions", "bound"]

log = get_logger("framework.runtime")

MakeConsumer = Callable[[Service, Handler, list[GroupPartition]], Consumer]
"""Builds the consumer of one handler on one topic's partitions (no partitions: a member of a shared group)."""


def bound(handler: Handler, spec: DestinationSpec) -> Handler:
    """A pattern handler as the handler of one matching topic ``spec``."""
    retention = None if spec.retention_ms is None else timedelta(milliseconds=spec.retention_ms)
    topic = Topic(spec.name, partitions=spec.partitions, retention=retention, max_length=spec.max_length)
    return attrs.evolve(handler, destination=topic)


class Subscriptions:
    """The topics each service reads, wired once each; patterns matched against the registry."""

    def __init__(self, broker: Broker, services: Sequence[Service], make: MakeConsumer) -> None:
        self.broker = broker
        self.services = list(services)
        self.make = make
        self.wired: dict[str, set[str]] = {s.name: set() for s in self.services}  # service -> destinations
        self.patterns = any(h.pattern is not None for s in self.services for h in s.handlers)
        self._built: list[Consumer] = []  # wired, not yet taken by the runtime

    def handles(self, service: Service, destination: str) -> bool:
        """Whether a handler of ``service`` reads ``destination`` (by its name or a pattern)."""
        return any(
            h.destination.name == destination if h.pattern is None else h.pattern.matches(destination)
            for h in service.handlers
        )

    async def unwired(self) -> bool:
        """Whether the registry holds a topic a pattern matches that is not wired yet."""
        if not self.patterns:
            return False
        registry = [spec.name for spec in await self.broker.list_destinations() if spec.is_topic]
        return any(
            name not in self.wired[s.name] and h.pattern.matches(name)
            for s in self.services
            for h in s.handlers
            if h.pattern is not None
            for name in registry
        )

    async def wire(self) -> list[Consumer]:
        """Subscribe what is not wired yet; return the new consumers (leads and members). When a
        subscription fails, the error is raised and the consumers wired before it wait for :meth:`take`."""
        registry = await self.broker.list_destinations() if self.patterns else []
        for service in self.services:
            await self._wire_service(service, registry)
        return self.take()

    def take(self) -> list[Consumer]:
        """The consumers wired since the last call (so none is lost when a later subscription failed)."""
        built, self._built = self._built, []
        return built

    async def _wire_service(self, service: Service, registry: list[DestinationSpec]) -> None:
        wired = self.wired[service.name]
        named = {h.destination.name: h.spec for h in service.handlers if h.pattern is None}
        topics = {spec.name: spec for spec in registry if spec.is_topic}
        targets: dict[str, tuple[DestinationSpec, list[Handler]]] = {}
        for handler in service.handlers:
            if handler.pattern is None:
                name = handler.destination.name
                if name not in wired:
                    targets.setdefault(name, (named[name], []))[1].append(handler)
                continue
            candidates = {**topics, **{n: s for n, s in named.items() if s.is_topic}}
            for name, spec in candidates.items():
                if name not in wired and handler.pattern.matches(name):
                    targets.setdefault(name, (spec, []))[1].append(bound(handler, spec))
        for name, (spec, handlers) in targets.items():
            lead = handlers[0]
            views = await self.broker.subscribe(spec, service.name, lead.start)
            group = [self.make(service, lead, views)] + [self.make(service, h, []) for h in handlers[1:]]
            if len(group) > 1 or lead.filter is not None:
                group[0].route(group)
            wired.add(name)
            self._built += group
            if any(h.pattern is not None for h in handlers):
                log.info(
                    "pattern subscription wired", service=service.name, topic=name, handlers=[h.name for h in handlers]
                )
