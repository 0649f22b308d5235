"""Read-only views of destinations, partitions and groups (depth, pending, lag) for status and tests."""

from __future__ import annotations

from typing import Any

import attrs
from redis.exceptions import NoPermissionError, ResponseError

from broker.protocol import GroupPartition
from broker.redis_broker import RedisBroker
from broker.topology import DestinationSpec

__all__ = ["DestinationState", "GroupState", "PartitionState", "describe", "group_state"]

_LAG_SCAN_LIMIT = 100_000  # when the server cannot tell the lag, count at most this many entries


@attrs.frozen
class GroupState:
    """A consumer group on one partition.

    ``lag`` counts entries not yet delivered to the group (including its redeliver stream);
    ``pending`` counts delivered, unacknowledged ones; ``delayed`` waits in the retry path.
    """

    group: str
    consumers: int
    pending: int
    lag: int
    delayed: int
    dead_letters: int

    @property
    def idle(self) -> bool:
        """Nothing left to deliver or settle (delayed retries aside)."""
        return self.pending == 0 and self.lag == 0


@attrs.frozen
class PartitionState:
    """One partition stream: its length and its groups."""

    partition: int
    length: int
    groups: list[GroupState]


@attrs.frozen
class DestinationState:
    """A destination and all its partitions."""

    spec: DestinationSpec
    partitions: list[PartitionState]

    @property
    def depth(self) -> int:
        """Entries stored over all partitions (for topics: retained, not only unread)."""
        return sum(p.length for p in self.partitions)

    def to_json(self) -> dict[str, Any]:
        """Plain data for ``framework status --json``."""
        return {
            "name": self.spec.name,
            "kind": self.spec.kind,
            "partitions": self.spec.partitions,
            "retention_ms": self.spec.retention_ms,
            "max_length": self.spec.max_length,
            "depth": self.depth,
            "groups": _group_totals(self),
            "per_partition": [attrs.asdict(p) for p in self.partitions],
        }


def _group_totals(state: DestinationState) -> list[dict[str, Any]]:
    totals: dict[str, dict[str, Any]] = {}
    for p in state.partitions:
        for g in p.groups:
            t = totals.setdefault(
                g.group, {"group": g.group, "consumers": 0, "pending": 0, "lag": 0, "delayed": 0, "dead_letters": 0}
            )
            t["consumers"] = max(t["consumers"], g.consumers)
            for k in ("pending", "lag", "delayed", "dead_letters"):
                t[k] += getattr(g, k)
    return sorted(totals.values(), key=lambda t: t["group"])


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


async def _lag(broker: RedisBroker, stream: str, info: dict[str, Any]) -> int:
    lag = info.get("lag")
    if lag is not None:
        return int(lag)
    last = _text(info.get("last-delivered-id", "0-0"))  # the server could not tell: count
    rows = await broker.redis.execute_command("XRANGE", stream, f"({last}", "+", "COUNT", _LAG_SCAN_LIMIT)
    return len(rows)


async def group_state(broker: RedisBroker, view: GroupPartition) -> GroupState:
    """Depth figures of ``view``'s group on its partition (main and redeliver streams)."""
    consumers = pending = lag = 0
    for stream in (view.stream, view.keys.redeliver):
        for info in await broker.stream_groups(stream):
            if _text(info["name"]) != view.group:
                continue
            consumers = max(consumers, int(info.get("consumers") or 0))
            pending += int(info.get("pending") or 0)
            lag += await _lag(broker, stream, info)
    pipe = broker.redis.pipeline(transaction=False)
    pipe.zcard(view.keys.delayed)
    pipe.xlen(view.keys.dlq)
    delayed, dead = await pipe.execute()
    return GroupState(view.group, consumers, pending, lag, int(delayed), int(dead))


async def describe(broker: RedisBroker, names: list[str] | None = None) -> list[DestinationState]:
    """State of every declared destination (or of ``names``), with all groups that subscribed."""
    specs = await broker.list_destinations()
    if names:
        wanted = set(names)
        unknown = wanted - {s.name for s in specs}
        if unknown:
            raise ValueError(f"unknown destination(s): {', '.join(sorted(unknown))}")
        specs = [s for s in specs if s.name in wanted]
    subs = await broker.list_subscriptions()
    out = []
    for spec in specs:
        groups = sorted({g for d, g in subs if d == spec.name})
        parts = []
        for p in range(spec.partitions):
            stream = broker.keyspace.partition(spec.name, p).stream
            try:
                length = int(await broker.redis.xlen(stream))
            except NoPermissionError:  # an ACL refusal is not "no such stream": say it
                raise
            except ResponseError:
                length = 0
            states = [await group_state(broker, broker.group_partition(spec, p, g)) for g in groups]
            parts.append(PartitionState(p, length, states))
        out.append(DestinationState(spec, parts))
    return out
