"""The memory broker's topology role: the destination registry, declare on first use, and subscriptions."""

from __future__ import annotations

from broker.errors import ConfigurationError
from broker.memory.core import MemoryCore, MemoryKeys
from broker.protocol import GroupPartition, Start
from broker.routing import Routing
from broker.topology import DestinationSpec, validate_name

__all__ = ["Topology"]

_NOUN = {"command": "a queue (commands: use send)", "event": "a topic (events: use publish)"}


class Topology(MemoryCore, Routing):
    """Declares destinations, routes messages to them and creates consumer groups."""

    async def declare(self, spec: DestinationSpec) -> DestinationSpec:
        """Register ``spec``; an existing registration wins unless it conflicts (then raise)."""
        await self._checkpoint()
        destinations = self.registry.destinations
        stored = destinations.setdefault(spec.name, spec)
        if stored.kind != spec.kind:
            raise ConfigurationError(f"{spec.name!r} is already declared as {_NOUN[stored.kind]}, not as {spec.kind}s")
        if stored.partitions != spec.partitions:
            raise ConfigurationError(
                f"{spec.name!r} already has {stored.partitions} partition(s); it cannot be declared with "
                f"{spec.partitions}. Changing a destination's partition count is not supported: "
                "use a new destination name, or declare it with the existing count."
            )
        if (stored.retention_ms, stored.max_length) != (spec.retention_ms, spec.max_length):
            destinations[spec.name] = stored = spec  # retention may change over time; the latest declaration wins
        self._specs[spec.name] = stored
        return stored

    async def get_destination(self, name: str) -> DestinationSpec | None:
        """The declared spec of ``name``, or None (cached after the first look-up)."""
        spec = self._specs.get(name)
        if spec is None:
            await self._checkpoint()
            spec = self.registry.destinations.get(name)
            if spec is None:
                return None
            self._specs[name] = spec
        return spec

    async def list_destinations(self) -> list[DestinationSpec]:
        """Every declared destination, sorted by name (not cached)."""
        await self._checkpoint()
        return sorted(self.registry.destinations.values(), key=lambda s: s.name)

    async def list_subscriptions(self) -> list[tuple[str, str]]:
        """Every (destination, group) pair that has subscribed, sorted."""
        await self._checkpoint()
        return sorted(self.registry.subscriptions)

    def group_partition(self, spec: DestinationSpec, partition: int, group: str) -> GroupPartition:
        """The view of ``group`` on one partition (no server call; the group need not exist)."""
        stream = self.partition_stream(spec.name, partition)
        base = f"{stream}:g:{group}"
        keys = MemoryKeys(stream=stream, group=group, redeliver=f"{base}:redeliver", dlq=f"{base}:dlq")
        return GroupPartition(spec=spec, partition=partition, group=group, stream=stream, keys=keys)

    async def subscribe(self, spec: DestinationSpec, group: str, start: Start = "earliest") -> list[GroupPartition]:
        """Declare ``spec`` and create ``group`` on every partition stream and its redeliver stream (idempotent).

        ``start`` applies to a new group of a topic (``latest``: only what is published afterwards);
        queues start at the earliest entry and have one owning group (``ConfigurationError`` otherwise).
        """
        validate_name("group", group)
        spec = await self.declare(spec)
        if not spec.is_topic:
            first = self.server.streams.get(self.partition_stream(spec.name, 0))
            owners = set(first.groups) if first is not None else set()
            if owners - {group}:
                raise ConfigurationError(
                    f"queue {spec.name!r} is already consumed by {', '.join(sorted(owners))}; a queue has one "
                    f"owning service. Use a topic (events) if {group!r} should also get these messages."
                )
        at = "0" if (start == "earliest" or not spec.is_topic) else "$"
        views = [self.group_partition(spec, p, group) for p in range(spec.partitions)]
        for view in views:
            self.server.stream(view.stream).create_group(group, at)
            self.server.stream(view.keys.redeliver).create_group(group, "0")
        self.registry.subscriptions.setdefault((spec.name, group), start)
        return views
