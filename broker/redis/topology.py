"""The broker's topology role: the destination registry, declare on first use, and subscriptions."""

from __future__ import annotations

from typing import cast

import orjson
from redis.exceptions import ResponseError

from broker.errors import ConfigurationError
from broker.protocol import GroupPartition, Start
from broker.redis.core import RedisCore, text
from broker.redis.keys import inbox_layout_fields
from broker.routing import Routing
from broker.topology import DestinationSpec, validate_name

__all__ = ["Topology"]

_NOUN = {"command": "a queue (commands: use send)", "event": "a topic (events: use publish)"}


class Topology(RedisCore, Routing):
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
        layout = inbox_layout_fields()  # the bucket layouts the operator turned on or off (keys.py)
        if layout:
            for view in views:
                await self.redis.hset(f"{view.keys.inbox}:info", mapping=layout)
        return views
