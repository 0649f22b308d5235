"""The Broker contract: what every transport's publishing, reading, acknowledging and retention promise.

Any transport must keep these promises (the conformance kit, :mod:`broker.conformance`, checks
them through this contract alone, for any transport factory and its features). :class:`Broker`
is what the framework may call on every transport, grouped by role: :class:`Destinations`,
:class:`Publisher`, :class:`GroupReader`, :class:`Settler` and :class:`Connection`. What only some
transports offer (an inbox store, partition ownership, scheduled messages, dead-letter
administration, the state store, the Redis data store) is an optional capability in
:mod:`broker.capabilities`, declared in ``capabilities`` and checked when a service is wired.

* **Publish.** ``publish`` returns once every envelope is durable on the server (as durable as the
  server's persistence makes it). Envelopes with one key go to one partition and are stored in
  the order given. A publish with an idempotency key is stored at most once per dedup window; the
  key is checked in the partition the message goes to (by its key, else by its idempotency key).
* **Read.** A group sees every message of a destination once per delivery: a queue has one group
  (its owning service); a topic has one group per subscribing service and each gets every event.
  Within a group, an entry is delivered to one consumer at a time.
* **Ack.** Until ``ack`` returns, a delivered entry stays pending for its consumer; a consumer
  that comes back under the same name re-reads its own pending entries first, and entries idle
  longer than the visibility timeout are claimed by another consumer (``claim_idle``), which
  raises their delivery count. Nothing is lost when a consumer dies; it may be delivered again.
* **Settle.** ``dead_letter``, ``retry_later`` and ``commit_effects`` (the state store's) move an
  entry and acknowledge it in one atomic step, and do nothing if the entry is no longer pending
  (another consumer settled it): settling twice is harmless.
* **Order.** Entries of one partition are delivered in stream order. Redeliveries (retries,
  claims) may come after later entries; per-key order across failures is the runtime's job.
* **Retention.** Queue entries are deleted when acknowledged. Topic entries are kept for the
  destination's retention and trimmed only below the oldest entry some group has not yet
  acknowledged or not yet been delivered, so trimming never drops an unprocessed event.
* **Concurrency.** A broker belongs to the event loop that connected it; any number of tasks of
  that loop may call any method concurrently (every call is self-contained: no method relies on
  another call's ordering except as stated). A *channel* (``channel()``) serves one task at a
  time. Brokers are not thread-safe: one per thread or process. ``close`` is called last.
* **Failures.** A lost connection raises the transport's connection error, a call that ran out of
  time its timeout error; neither leaves anything half-done that a retry of the same call would
  repeat (appends and settlements are single atomic steps). ACL refusals raise
  :class:`~broker.errors.PermissionDenied`, registry conflicts :class:`~broker.errors.ConfigurationError`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal, Protocol

import attrs

from broker.envelope import Envelope, Kind
from broker.topology import DestinationSpec

__all__ = [
    "Broker",
    "Connection",
    "Delivery",
    "Destinations",
    "Extension",
    "GroupPartition",
    "GroupReader",
    "GuardedWrite",
    "Publisher",
    "Settler",
    "Start",
]

Start = Literal["earliest", "latest"]


@attrs.frozen
class GroupPartition:
    """One consumer group's view of one partition of a destination.

    ``stream`` names the partition's log (shared by every group of a topic); ``keys`` is the
    transport's own addressing of this view (Redis: :class:`broker.redis.keys.GroupKeys`), which
    only that transport reads.
    """

    spec: DestinationSpec
    partition: int
    group: str
    stream: str
    keys: Any = attrs.field(eq=False, repr=False)

    def deletes_on_ack(self, stream: str) -> bool:
        """Whether acknowledged entries of ``stream`` are deleted (queues and redeliver streams)."""
        return stream != self.stream or not self.spec.is_topic


class GuardedWrite:
    """Hash fields written atomically with a delivery's ack (:meth:`Settler.ack`), only if the
    hash's ``guard`` field still holds ``expected`` ('' = absent) and the message was neither
    processed before nor settled already: ``names`` are the fields to set, ``values`` their
    values (writes with the same guard and names share one description in the ack call).

    ``outcome`` is set by the ack: :data:`APPLIED`, :data:`SKIPPED` (a duplicate, or the entry no
    longer pending: nothing written, the entry acknowledged as usual), :data:`CONFLICT` (the guard
    failed) or :data:`FAILED` (the server refused the write: ``error`` says why); on the last two
    nothing is written and the entry is **not** acknowledged (it stays pending). ``note`` is the
    caller's own (the broker never reads it).
    """

    __slots__ = ("error", "expected", "guard", "key", "names", "note", "outcome", "values")

    APPLIED = 1
    SKIPPED = 0
    CONFLICT = -2
    FAILED = -3

    def __init__(
        self,
        key: str,
        guard: str,
        expected: str,
        names: tuple[str, ...],
        values: Sequence[Any],
        note: Any = None,
    ) -> None:
        if len(names) != len(values):
            raise ValueError(f"a guarded write of {key!r} names {len(names)} fields for {len(values)} values")
        self.key = key
        self.guard = guard
        self.expected = expected
        self.names = names
        self.values = values
        self.note = note
        self.outcome: int | None = None  # None until an ack call ran it
        self.error = ""


@attrs.define(slots=True)
class Delivery:
    """One delivery of a stream entry to a consumer of a group.

    ``envelope`` is None when the entry could not be decoded; ``error`` then says why, and the
    raw fields are kept for the dead-letter entry. ``delivery_count`` counts deliveries of
    this entry (1 on first read; raised by redelivery after a crash or claim).
    """

    source: GroupPartition
    stream: str
    entry_id: str
    raw: list[bytes]  # the entry's field/value list as stored
    envelope: Envelope | None
    error: str | None = None
    delivery_count: int = 1
    settle_write: GuardedWrite | None = None  # written with the ack (see GuardedWrite), set by the runtime
    inbox_status: int | None = None
    """Set by a read that took the inbox lease (:meth:`broker.capabilities.InboxStore.read_leased`):
    what :meth:`~broker.capabilities.InboxStore.inbox_claim` would have said; None: not checked."""

    @property
    def fields(self) -> dict[bytes, bytes]:
        """The entry's fields as a dict (built on demand: only failure paths need it)."""
        it = iter(self.raw)
        return dict(zip(it, it, strict=False))

    def field(self, name: bytes) -> bytes | None:
        """One field of the entry (its first occurrence), or None: no dict of every field built."""
        raw = self.raw
        return next((raw[i + 1] for i in range(0, len(raw) - 1, 2) if raw[i] == name), None)

    @property
    def attempt(self) -> int:
        """How many times this message has been attempted, counting retries and redeliveries."""
        base = self.envelope.attempt if self.envelope is not None else 1
        return base + self.delivery_count - 1

    @property
    def message_id(self) -> str:
        """The envelope's id, or ``""`` for an undecodable entry."""
        return self.envelope.id if self.envelope is not None else ""


class Extension(frozenset[str]):
    """What :meth:`Broker.extend` found: the entry ids still owned (the set itself, now touched)
    and ``taken``, those pending under another consumer (claimed away). Entries in neither were
    settled meanwhile (acked, retried, dead-lettered): not a take-over."""

    __slots__ = ("taken",)
    taken: frozenset[str]

    def __new__(cls, owned: Iterable[str] = (), taken: Iterable[str] = ()) -> Extension:
        self = super().__new__(cls, owned)
        self.taken = frozenset(taken)
        return self


class Destinations(Protocol):
    """The registry of destinations and subscriptions. Any task may call these at any time."""

    async def declare(self, spec: DestinationSpec) -> DestinationSpec:
        """Register a destination; return the stored spec (an existing one wins if compatible).

        Idempotent. Raises ``ConfigurationError`` if the destination exists with another kind or
        partition count; a different retention replaces the stored one (the latest wins).
        """
        ...

    async def ensure_declared(self, spec: DestinationSpec) -> DestinationSpec:
        """:meth:`declare` ``spec`` once per broker: later calls with the same spec cost nothing.

        What producers holding a full spec (``Queue``/``Topic`` objects, an outbox row's spec)
        call before publishing. Same errors as :meth:`declare`.
        """
        ...

    async def route(self, destination: str, kind: Kind, *, partitions: int = 1) -> DestinationSpec:
        """The spec a ``kind`` message to ``destination`` goes by: the declared one, else a new
        declaration with default retention and ``partitions`` (declare on first use).

        Cached per broker. Raises ``ConfigurationError`` when ``destination`` is declared with
        the other kind or its name is invalid; :meth:`Publisher.publish` routes every envelope so.
        """
        ...

    async def get_destination(self, name: str) -> DestinationSpec | None:
        """The declared spec of ``name``, or None (cached per broker once found)."""
        ...

    async def list_destinations(self) -> list[DestinationSpec]:
        """Every declared destination, sorted by name (not cached)."""
        ...

    async def list_subscriptions(self) -> list[tuple[str, str]]:
        """Every (destination, group) pair that has subscribed, sorted."""
        ...

    def group_partition(self, spec: DestinationSpec, partition: int, group: str) -> GroupPartition:
        """The view of ``group`` on one partition (no server call; the group need not exist)."""
        ...

    async def subscribe(self, spec: DestinationSpec, group: str, start: Start = "earliest") -> list[GroupPartition]:
        """Declare ``spec``, create ``group`` on every partition (idempotent) and return its views.

        ``start`` applies when the group is new: ``earliest`` reads a topic's retained history,
        ``latest`` only what is published afterwards. Queues always start at the earliest entry.
        Raises ``ConfigurationError`` when another group already consumes the queue.
        """
        ...


class Publisher(Protocol):
    """Producing messages. Safe to call from any number of tasks at once."""

    max_body_bytes: int
    """Largest body :meth:`publish` accepts and consumers read; a producer may lower or raise it."""

    async def publish(self, envelopes: Sequence[Envelope], *, dedup_window_ms: int | None = None) -> list[str | None]:
        """Store envelopes (pipelined); return each entry id, or None for a deduplicated repeat.

        Destinations are routed with :meth:`Destinations.route` (declared on first use). The
        call is all or nothing for size: a body over :attr:`max_body_bytes` raises
        ``MessageTooLarge`` before anything is stored. Envelopes with an ``idempotency-key``
        header are stored at most once per ``dedup_window_ms`` (default one day).
        """
        ...


class GroupReader(Protocol):
    """Delivering a group's entries to its consumers, and keeping them owned while they run."""

    def channel(self) -> Any:
        """A connection of one task's own for its hot path, or None (then calls use the shared pool).

        Pass it as ``channel=`` to :meth:`read`, :meth:`inbox_claim` and :meth:`Settler.ack`; it
        serves one task at a time, and a failed call on it drops its connection (the next opens
        a fresh one), so it stays usable after errors.
        """
        ...

    async def read(
        self,
        source: GroupPartition,
        consumer: str,
        count: int,
        block_ms: int,
        *,
        channel: Any = None,
        token: int | None = None,
    ) -> list[Delivery]:
        """Deliver up to ``count`` new entries to ``consumer``, waiting up to ``block_ms`` for one.

        Bounded in time: at most ``block_ms`` plus the command timeout. Entries stay pending for
        ``consumer`` until settled. ``token`` (an owned partition, ``consumer`` its lease's holder):
        fenced, nothing is taken once another instance acquired the partition (``LeaseLost``).
        """
        ...

    async def read_own_pending(
        self, source: GroupPartition, consumer: str, count: int, after: dict[str, str] | None = None
    ) -> list[Delivery]:
        """Deliver again the entries pending for ``consumer`` itself (after a restart), oldest first,
        after the entry ids in ``after`` (per stream); delivery counts are raised."""
        ...

    async def claim_idle(
        self, source: GroupPartition, consumer: str, min_idle_ms: int, count: int, *, token: int | None = None
    ) -> list[Delivery]:
        """Take over entries idle for at least ``min_idle_ms`` from any consumer of the group
        (``token``: fenced like :meth:`read`)."""
        ...

    async def release_own_pending(
        self, source: GroupPartition, consumer: str, idle_ms: int, *, keep: Iterable[str] = ()
    ) -> int:
        """Make ``consumer``'s pending entries (except ``keep``) claimable by others at once (shutdown).

        Nothing is lost: they stay pending; return how many were released.
        """
        ...

    async def prune_consumers(self, source: GroupPartition, min_idle_ms: int, *, keep: str = "") -> int:
        """Forget consumers that hold nothing and were idle ``min_idle_ms`` or longer (never ``keep``,
        never one with pending entries); return how many consumer records went."""
        ...

    async def extend(
        self, source: GroupPartition, consumer: str, deliveries: Sequence[Delivery], *, lease_ms: int = 60_000
    ) -> Extension:
        """Reset the idle time of every delivery ``consumer`` still owns and extend its inbox lease
        by ``lease_ms``; return their entry ids, with ``.taken``: those another consumer claimed."""
        ...


class Settler(Protocol):
    """Settling deliveries (each step atomic, and a no-op for entries no longer pending), and retention.

    Fencing: ``ack``, ``commit_effects``, ``dead_letter`` and ``retry_later`` take the caller's
    ``token`` for the partition's lease (:class:`PartitionOwnership`); when another instance has
    acquired the partition since, they change nothing and raise ``LeaseLost``. ``None``: no check.
    """

    async def ack(
        self,
        source: GroupPartition,
        deliveries: Sequence[Delivery],
        *,
        inbox: bool = False,
        channel: Any = None,
        token: int | None = None,
    ) -> int:
        """Acknowledge deliveries (one round trip); with ``inbox``, record their ids as processed.

        A delivery with a ``settle_write`` has it applied in the same atomic step, guarded (see
        :class:`GuardedWrite`; its ``outcome`` is set); one whose guard fails is not acknowledged.
        Returns how many were still pending (acknowledged now).
        """
        ...

    async def count_attempt(self, delivery: Delivery) -> int:
        """Record that a redelivered message is about to run; return how many such runs it had."""
        ...

    async def count_first_redeliveries(self, deliveries: Sequence[Delivery]) -> list[bool]:
        """Count the first redelivered run of each message, in one round trip; False marks a suspect
        (an earlier redelivered run started and did not complete)."""
        ...

    async def dead_letter(self, delivery: Delivery, reason: dict[str, str], *, token: int | None = None) -> str | None:
        """Move a delivery to its group's DLQ with ``reason`` fields, atomically with its ack.

        Returns the dead letter's id, or None when the entry was no longer pending (nothing written).
        """
        ...

    async def retry_later(
        self, delivery: Delivery, due_ms: int, *, attempt: int | None = None, token: int | None = None
    ) -> bool:
        """Park a delivery for redelivery to its group only at ``due_ms``, atomically with its ack.

        False when the entry was no longer pending. Undecodable deliveries raise ``ValueError``.
        """
        ...

    async def move_due(self, source: GroupPartition, now_ms: int, limit: int = 500) -> int:
        """Deliver the group's delayed retries that are due; each moves exactly once, even with
        several consumers calling at once."""
        ...

    async def trim(self, spec: DestinationSpec, partition: int, now_ms: int) -> int:
        """Apply retention to one partition without dropping unacknowledged entries; also forget
        producer idempotency keys whose window ended. Returns the entries removed."""
        ...


class Connection(Protocol):
    """Which server and deployment a broker talks to, and closing it."""

    @property
    def namespace(self) -> str:
        """Separates deployments (and test runs) on one server; part of consumer identities."""
        ...

    url: str
    """The server's URL (may carry a password: pass it through ``broker.redact`` before logging)."""
    transport: str
    """The transport's name for messages (``redis``, ``memory``)."""
    capabilities: frozenset[str]
    """The optional capabilities it offers (names from :mod:`broker.capabilities`)."""

    async def close(self) -> None:
        """Release connections. Called last; the broker is not used afterwards."""
        ...


class Broker(Destinations, Publisher, GroupReader, Settler, Connection, Protocol):
    """A message transport keeping the contract in this module's docstring: everything the
    framework may call on any transport (optional capabilities: :mod:`broker.capabilities`)."""
