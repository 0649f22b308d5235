"""The in-memory server: every namespace's registry, streams and group state, and the process-wide servers by name."""

from __future__ import annotations

import heapq
from typing import Any

import attrs

from broker.errors import ConfigurationError
from broker.memory.inbox import Inbox
from broker.memory.streams import Stream, wall_ms
from broker.topology import DestinationSpec

__all__ = [
    "GroupState",
    "Lease",
    "MemoryServer",
    "PartitionState",
    "Registry",
    "get_server",
    "reset",
    "server_name",
]


@attrs.define(slots=True)
class Lease:
    """A group's lease on one partition (``lease.lua``): ``owner`` '' when released; ``token`` never goes back."""

    owner: str = ""
    token: int = 0
    until: int = 0  # mono_ms the lease ends
    since: int = 0  # mono_ms it was acquired


@attrs.define(slots=True)
class GroupState:
    """What one group keeps for one partition besides its stream group: delayed retries, inbox, attempt counters."""

    delayed: dict[tuple[bytes, ...], int] = attrs.field(factory=dict)  # entry fields -> due ms (a zset: one per member)
    inbox: Inbox = attrs.field(factory=Inbox)
    attempts: dict[str, int] = attrs.field(factory=dict)  # message id -> redelivered runs started


@attrs.define(slots=True)
class PartitionState:
    """What one partition keeps besides its stream: producer idempotency keys, scheduled messages, a job's ticks."""

    published: dict[str, int] = attrs.field(factory=dict)  # idempotency key -> expiry (Unix ms)
    expiries: list[tuple[int, str]] = attrs.field(factory=list)  # heap of (expiry, key), checked against published
    scheduled: dict[str, tuple[int, list[bytes]]] = attrs.field(factory=dict)  # message id -> (due ms, fields)
    job_last: int | None = None  # the latest tick fired (job_tick.lua), None: no record
    job_fired: int = 0

    def forget_expired(self, now: int, limit: int | None = None) -> int:
        """Drop idempotency keys whose expiry is ``now`` or earlier (at most ``limit``); return how many went."""
        dropped = 0
        heap = self.expiries
        while heap and heap[0][0] <= now and (limit is None or dropped < limit):
            expiry, key = heapq.heappop(heap)
            if self.published.get(key) == expiry:
                del self.published[key]
                dropped += 1
        return dropped

    def seen(self, key: str, now: int) -> bool:
        """Whether ``key`` was stored and its window has not ended."""
        expiry = self.published.get(key)
        return expiry is not None and expiry > now

    def remember(self, key: str, now: int, window: int) -> None:
        """Record ``key`` until ``now + window`` (nothing when ``window`` <= 0)."""
        if window > 0:
            self.published[key] = now + window
            heapq.heappush(self.expiries, (now + window, key))

    def __bool__(self) -> bool:
        return bool(self.published or self.scheduled or self.job_last is not None)


@attrs.define(slots=True)
class Registry:
    """One namespace's registry: destinations, subscriptions and the live instances of each group."""

    destinations: dict[str, DestinationSpec] = attrs.field(factory=dict)
    subscriptions: dict[tuple[str, str], str] = attrs.field(factory=dict)  # (destination, group) -> start
    members: dict[tuple[str, str], dict[str, int]] = attrs.field(factory=dict)  # -> instance: heartbeat end (mono)
    scheduled: dict[tuple[str, int], None] = attrs.field(factory=dict)  # partitions ever scheduled to (the index)


class MemoryServer:
    """The state of one ``memory://NAME`` server, shared by every broker connected to it in this process.

    Everything is keyed by full names that start with the namespace (streams ``<ns>:<destination>:<p>``
    and the group streams under them), so namespaces separate deployments as key prefixes do on Redis.
    Nothing here is thread-safe or survives the process.
    """

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.streams: dict[str, Stream] = {}
        self.partitions: dict[str, PartitionState] = {}  # partition stream -> its other state
        self.groups: dict[tuple[str, str], GroupState] = {}  # (partition stream, group) -> its other state
        self.leases: dict[tuple[str, str], Lease] = {}  # (partition stream, group) -> lease (tokens kept)
        self.registries: dict[str, Registry] = {}
        self.hashes: dict[str, dict[bytes, bytes]] = {}  # states: guarded writes (GuardedWrite.key), commits
        self.expiries: dict[str, int] = {}  # hash key -> when it expires (Unix ms; ExpireKey)
        self.replies: dict[str, Any] = {}  # "<ns>:reply:<name>" -> its broker.memory.replies.ReplyBox

    def __repr__(self) -> str:
        return f"MemoryServer({self.name!r}, {len(self.streams)} streams)"

    def stream(self, name: str) -> Stream:
        """The stream ``name``, created empty if needed."""
        stream = self.streams.get(name)
        if stream is None:
            stream = self.streams[name] = Stream(name)
        return stream

    def registry(self, namespace: str) -> Registry:
        """The registry of ``namespace``, created empty if needed."""
        registry = self.registries.get(namespace)
        if registry is None:
            registry = self.registries[namespace] = Registry()
        return registry

    def partition(self, stream: str) -> PartitionState:
        """The state kept beside partition stream ``stream``, created empty if needed."""
        state = self.partitions.get(stream)
        if state is None:
            state = self.partitions[stream] = PartitionState()
        return state

    def group(self, stream: str, group: str) -> GroupState:
        """The state ``group`` keeps for partition stream ``stream``, created empty if needed."""
        state = self.groups.get((stream, group))
        if state is None:
            state = self.groups[(stream, group)] = GroupState()
        return state

    def lease(self, stream: str, group: str) -> Lease:
        """``group``'s lease on partition stream ``stream`` (never held yet: owner '', token 0)."""
        lease = self.leases.get((stream, group))
        if lease is None:
            lease = self.leases[(stream, group)] = Lease()
        return lease

    def hash(self, key: str) -> dict[bytes, bytes]:
        """A copy of the hash ``key`` that guarded writes (``Delivery.settle_write``) and state commits
        wrote ({} when none, or expired)."""
        return dict(self.live_hash(key, wall_ms()) or {})

    def live_hash(self, key: str, now: int) -> dict[bytes, bytes] | None:
        """The hash ``key`` itself (None when there is none), dropped first if it expired by ``now``."""
        expiry = self.expiries.get(key)
        if expiry is not None and expiry <= now:
            del self.expiries[key]
            self.hashes.pop(key, None)
            return None
        return self.hashes.get(key)

    def delete_hash(self, key: str) -> None:
        """Delete the hash ``key`` with its expiry."""
        self.hashes.pop(key, None)
        self.expiries.pop(key, None)


_SERVERS: dict[str, MemoryServer] = {}


def server_name(url: str) -> str:
    """The server name of ``memory://NAME`` (``memory://`` and ``memory:///``: '', the default server)."""
    head, sep, rest = url.partition("://")
    if not sep:
        return url.strip("/")  # a bare name
    if head.lower() != "memory":
        raise ConfigurationError(f"not a memory:// URL: {url!r}")
    return rest.split("?", 1)[0].strip("/")


def get_server(url: str) -> MemoryServer:
    """The process's server for ``memory://NAME`` (or a bare NAME), created on first use."""
    name = server_name(url)
    server = _SERVERS.get(name)
    if server is None:
        server = _SERVERS[name] = MemoryServer(name)
    return server


def reset(name: str | None = None) -> None:
    """Drop one server (``name``: ``"x"`` or ``"memory://x"``; ``""`` the default one), or every server
    (``None``). Brokers connected before keep the old state; the next connect starts empty."""
    if name is None:
        _SERVERS.clear()
    else:
        _SERVERS.pop(server_name(name), None)
