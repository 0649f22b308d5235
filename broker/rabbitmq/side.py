"""What the RabbitMQ broker asks of a schedule kept beside the server: :class:`SideSchedule`.

RabbitMQ can delay a message (the delay chain) but not list, cancel or fire a tick once across
processes; a store beside it does (:class:`broker.redis.side_schedule.RedisSchedule`, given by
:func:`broker.connect` with the Redis inbox). ``forward`` is the broker's own confirmed publish: the
store hands due messages and fired ticks to it and forgets them only after it returned.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Protocol

from broker.envelope import Envelope
from broker.operators import WorkerBeat
from broker.protocol import GroupPartition
from broker.scheduling import MoveResult, ScheduledMessage
from broker.topology import DestinationSpec

__all__ = ["Forward", "SideCounters", "SideLeases", "SideSchedule", "SideWorkers"]

Forward = Callable[[Sequence[Envelope]], Awaitable[None]]
"""Publishes envelopes to the server, confirmed (raises when it could not)."""


class SideSchedule(Protocol):
    """Scheduled messages and recurring jobs' ticks kept beside the server (at least once to the server,
    so a handler sees each once through its inbox)."""

    def describe(self) -> str:
        """Where it lives (no password), for messages."""
        ...

    async def store(
        self, spec: DestinationSpec, envelopes: Sequence[Envelope], dedup_window_ms: int | None
    ) -> list[str | None]:
        """Keep ``envelopes`` of ``spec`` (due later) until due: their ids, None for one whose idempotency
        key was stored within ``dedup_window_ms`` (not kept again)."""
        ...

    async def move(self, now_ms: int, limit: int, sweep: bool, forward: Forward) -> MoveResult:
        """Forward what is due (``sweep``: also what a dead mover left half-forwarded)."""
        ...

    async def fire_tick(self, spec: DestinationSpec, tick_ms: int, envelope: Envelope, forward: Forward) -> int:
        """Fire a recurring job's tick once across processes: 1 fired, 0 fired before, -1 first seen."""
        ...

    async def cancel(self, message_ids: Sequence[str], destination: str | None) -> int:
        """Cancel scheduled messages by id; how many were still scheduled."""
        ...

    async def messages(self, destination: str | None, limit: int, message_ids: Sequence[str]) -> list[ScheduledMessage]:
        """Scheduled messages, earliest due first."""
        ...

    async def count(self, destination: str | None) -> int:
        """How many messages wait for their due time."""
        ...

    async def counts(self, destination: str) -> dict[int, int]:
        """How many messages of ``destination`` wait, per partition (partitions with none may be missing)."""
        ...


class SideLeases(Protocol):
    """Heartbeats and partition leases kept beside the server (they decide who reads; they do not fence)."""

    def describe(self) -> str:
        """Where they live (no password), for messages."""
        ...

    async def heartbeat(self, destination: str, group: str, instance: str, ttl_ms: int, leave: bool) -> list[str]:
        """Beat ``instance``'s heartbeat in the group (or leave it); the live instances, sorted."""
        ...

    async def acquire(self, source: GroupPartition, instance: str, ttl_ms: int) -> int:
        """Take the partition's lease if free or expired: a new token, or 0."""
        ...

    async def renew(self, held: Sequence[tuple[GroupPartition, int]], instance: str, ttl_ms: int) -> list[bool]:
        """Renew (partition, token) leases in one round trip; False for each taken over meanwhile."""
        ...

    async def release(self, source: GroupPartition, instance: str, token: int) -> bool:
        """Free the lease; False when the token is not current."""
        ...


class SideCounters(Protocol):
    """Named counters kept beside the server: the registry's version, so a broker re-reads the registry
    stream only after some process changed it (a read of the stream appends a marker record to it)."""

    async def counter(self, name: str) -> int:
        """The counter's value (0 when never bumped)."""
        ...

    async def bump(self, name: str) -> int:
        """Raise the counter by one; its new value."""
        ...


class SideWorkers(Protocol):
    """Worker processes' heartbeats kept beside the server (``framework status``'s live workers)."""

    async def beat_worker(
        self, name: str, groups: Sequence[tuple[str, str]], ttl_ms: int, info: Mapping[str, str]
    ) -> None:
        """Record that worker ``name`` runs now, consuming ``groups``."""
        ...

    async def leave_worker(self, name: str) -> None:
        """Mark worker ``name`` gone now."""
        ...

    async def workers(self) -> list[WorkerBeat]:
        """Every worker recorded, by name."""
        ...
