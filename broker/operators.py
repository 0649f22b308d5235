"""Two optional capabilities for operators' tools: live workers from heartbeats, and dead letters by page.

* ``workers`` (:class:`WorkerRegistry`): every worker process beats a heartbeat (server time) naming
  the (destination, group) pairs it consumes; ``framework status`` and the dashboard count the live
  ones and show when each was last seen. A worker that stopped is marked gone at once; one that was
  killed is shown as gone once its heartbeat is older than its ``ttl_ms``; both are forgotten an
  hour after their last beat. Unlike the server's consumer
  list (``XINFO CONSUMERS``: every name that ever read, with idle times an AOF reload resets), a
  heartbeat says who runs now.
* ``dead_letter_pages`` (:class:`DeadLetterPages`): one group's dead letters on one partition,
  newest first, from a cursor, so a DLQ of 100,000 entries opens as fast as one of 10.

Redis declares both; a transport without them is served by the fallbacks in
``framework.operations`` (consumer counts, whole-DLQ reads).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, cast, runtime_checkable

import attrs

from broker.protocol import Broker, GroupPartition

__all__ = [
    "DEAD_LETTER_PAGES",
    "WORKERS",
    "DeadLetterPages",
    "WorkerBeat",
    "WorkerRegistry",
    "as_dead_letter_pages",
    "as_workers",
]

WORKERS = "workers"
"""Heartbeats of worker processes with the groups they consume (:class:`WorkerRegistry`)."""
DEAD_LETTER_PAGES = "dead_letter_pages"
"""Dead letters newest first from a cursor (:class:`DeadLetterPages`)."""


@attrs.frozen
class WorkerBeat:
    """A worker process as its last heartbeat described it.

    ``seen_ms`` is the server time of the last heartbeat, ``now_ms`` the server time of the read;
    ``ttl_ms`` how long the worker promised to beat again within; ``groups`` the (destination,
    group) pairs it consumes; ``info`` free text fields (host, pid, services, started).
    """

    name: str
    seen_ms: int
    now_ms: int
    ttl_ms: int
    groups: tuple[tuple[str, str], ...]
    info: Mapping[str, str] = attrs.field(factory=dict)

    @property
    def ago_ms(self) -> int:
        """Milliseconds since the last heartbeat (by the server's clock)."""
        return max(self.now_ms - self.seen_ms, 0)

    @property
    def alive(self) -> bool:
        """Whether the worker beat within its promised interval (a stopped one leaves at once)."""
        return self.ago_ms <= self.ttl_ms


@runtime_checkable
class WorkerRegistry(Protocol):
    """Worker processes' heartbeats (the ``workers`` capability)."""

    async def beat_worker(
        self, name: str, groups: Sequence[tuple[str, str]], ttl_ms: int, info: Mapping[str, str]
    ) -> None:
        """Record that worker ``name`` runs now, consuming ``groups``; it beats again within ``ttl_ms``."""
        ...

    async def leave_worker(self, name: str) -> None:
        """Mark worker ``name`` gone now (a graceful stop: listed as gone, not counted)."""
        ...

    async def workers(self) -> list[WorkerBeat]:
        """Every worker recorded (live or gone, gone ones forgotten an hour after their last beat), by name."""
        ...


@runtime_checkable
class DeadLetterPages(Protocol):
    """Dead letters newest first (the ``dead_letter_pages`` capability)."""

    async def dead_letter_page(
        self, view: GroupPartition, *, end: str = "+", start: str = "-", count: int = 100
    ) -> list[tuple[str, dict[bytes, bytes]]]:
        """At most ``count`` dead letters of ``view`` with ids from ``end`` down to ``start`` (both
        inclusive; ``(id`` exclusive, as XREVRANGE takes them), newest first: (DLQ entry id, fields)."""
        ...


def as_workers(broker: Broker) -> WorkerRegistry:
    """``broker`` as a :class:`WorkerRegistry`; ``TypeError`` naming the transport when it has none."""
    if WORKERS not in broker.capabilities:
        raise TypeError(f"the {broker.transport} transport has no {WORKERS!r} capability")
    return cast("WorkerRegistry", broker)


def as_dead_letter_pages(broker: Broker) -> DeadLetterPages:
    """``broker`` as a :class:`DeadLetterPages`; ``TypeError`` naming the transport when it has none."""
    if DEAD_LETTER_PAGES not in broker.capabilities:
        raise TypeError(f"the {broker.transport} transport has no {DEAD_LETTER_PAGES!r} capability")
    return cast("DeadLetterPages", broker)
