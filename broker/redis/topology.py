"""The broker's topology role: the destination registry, declare on first use, and subscriptions."""

from __future__ import annotations

from typing import cast

import orjson
from redis.exceptions import ResponseError

from broker.envelope import Kind
from broker.errors import ConfigurationError
from broker.protocol import GroupPartition, Start
from broker.redis.core import RedisCore, text
from broker.topology import DestinationSpec, kind_mismatch, validate_name

__all__ = ["Topology"]

_NOUN = {"command": "a queue (commands: use send)", "event": "a topic (events: use publish)"}


class Topology(RedisCore):
    """Declares destinations, routes messages to them and creates consumer groups."""

    async def declare(self, spec: DestinationSpec) -> DestinationSpec:
        """Register ``spec``; an existing registration wins unless it conflicts (then raise)."""
        key = self.keyspace.destinations
        await self.redis.hsetnx(key, spec.name, orjson.dumps(spec.to_json()))
        stored = DestinationSpec.from_json(orjson.loads(await self.redis.hget(key, spec.name)))
        if stored.kind != spec.kind:
            raise ConfigurationError(f"{spec.name!r} is already declared as {_NOUN[stored.kind]}, not as {spec.kind}s")
        if stored.partitions != spec.partitions:
            raise ConfigurationError(
                f"{spec.name!r} already has {stored.partitions} partition(s); it cannot be declared with "
                f"{spec.partitions}. Changing a destination's partition count is not supported: "
                "use a new destination name, or declare it with the existing count."
            )
        if (stored.retention_ms, stored.max_length) != (spec.retention_ms, spec.max_length):
            # Retention may change over time; the latest declaration wins.
            await self.redis.hset(key, spec.name, orjson.dumps(spec.to_json()))
            stored = spec
        self._specs[spec.name] = stored
        return stored

    async def ensure_declared(self, spec: DestinationSpec) -> DestinationSpec:
        """:meth:`declare` ``spec`` unless this broker already holds exactly it; return the stored spec.

        The one "declare on first use" for producers holding a full spec (a ``Queue``/``Topic``
        object, an outbox row's stored spec): the first call per broker costs a registry round
        trip, later ones with the same spec none. A spec differing from the cached one is declared
        again (so a retention change is written; kind or partition conflicts raise
        ``ConfigurationError``).
        """
        cached = self._specs.get(spec.name)
        if cached == spec:
            return cached
        return await self.declare(spec)

    async def route(self, destination: str, kind: Kind, *, partitions: int = 1) -> DestinationSpec:
        """The spec to publish a ``kind`` message to ``destination`` with, declaring it if needed.

        The one "declare on first use" by name: the declared spec (cached per broker), else a new
        declaration ``DestinationSpec(destination, kind, partitions=partitions)`` with default
        retention (``partitions`` is used only then: an existing destination keeps its own).
        Raises ``ConfigurationError`` when ``destination`` is declared with the other kind, or the
        name is invalid. :meth:`publish` and :meth:`commit_effects` route every envelope this way.
        """
        spec = self._specs.get(destination)
        if spec is not None and spec.kind == kind:
            return spec
        if spec is None:
            spec = await self.get_destination(destination)
            if spec is None:
                return await self.declare(DestinationSpec(name=destination, kind=kind, partitions=partitions))
        if spec.kind != kind:
            raise kind_mismatch(destination, kind)
        return spec

    async def get_destination(self, name: str) -> DestinationSpec | None:
        """The declared spec of ``name``, or None (cached after the first look-up)."""
        spec = self._specs.get(name)
        if spec is None:
            raw = await self.redis.hget(self.keyspace.destinations, name)
            if raw is None:
                return None
            spec = self._specs[name] = DestinationSpec.from_json(orjson.loads(raw))
        return spec

    async def list_destinations(self) -> list[DestinationSpec]:
        """Every declared destination, sorted by name."""
        raw = await self.redis.hgetall(self.keyspace.destinations)
        specs = [DestinationSpec.from_json(orjson.loads(v)) for v in raw.values()]
        return sorted(specs, key=lambda s: s.name)

    async def list_subscriptions(self) -> list[tuple[str, str]]:
        """Every (destination, group) pair that has subscribed, sorted."""
        raw = await self.redis.hkeys(self.keyspace.subscriptions)
        return cast("list[tuple[str, str]]", sorted(tuple(text(k).split("|", 1)) for k in raw))

    def group_partition(self, spec: DestinationSpec, partition: int, group: str) -> GroupPartition:
        """The view of ``group`` on one partition (no server call)."""
        keys = self.keyspace.partition(spec.name, partition).group(group)
        return GroupPartition(spec=spec, partition=partition, group=group, stream=keys.partition.stream, keys=keys)

    async def subscribe(self, spec: DestinationSpec, group: str, start: Start = "earliest") -> list[GroupPartition]:
        """Create ``group`` on every partition stream and its redeliver stream (idempotent)."""
        validate_name("group", group)
        spec = await self.declare(spec)
        if not spec.is_topic:
            owners = {text(g["name"]) for g in await self.stream_groups(self.keyspace.partition(spec.name, 0).stream)}
            if owners - {group}:
                raise ConfigurationError(
                    f"queue {spec.name!r} is already consumed by {', '.join(sorted(owners))}; a queue has one "
                    f"owning service. Use a topic (events) if {group!r} should also get these messages."
                )
        first = "0" if (start == "earliest" or not spec.is_topic) else "$"
        views = [self.group_partition(spec, p, group) for p in range(spec.partitions)]
        for view in views:
            for stream, at in ((view.stream, first), (view.keys.redeliver, "0")):
                try:
                    await self.redis.xgroup_create(stream, group, id=at, mkstream=True)
                except ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise
        await self.redis.hsetnx(self.keyspace.subscriptions, f"{spec.name}|{group}", orjson.dumps({"start": start}))
        return views
