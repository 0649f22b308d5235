"""Optional capabilities: what only some transports offer, declared by each and checked at wiring.

A transport lists the names it offers in ``capabilities`` (a frozenset of the constants below);
the runtime checks them when it wires a service (:func:`missing`), so a service that needs one
its transport lacks fails at start naming the handler and the capability, instead of failing on
its first message. Each capability is a protocol of the methods it adds to :class:`~broker.Broker`;
:func:`supports` narrows a broker to it.

| name | protocol | Redis | memory | RabbitMQ |
|---|---|---|---|---|
| ``inbox`` | :class:`InboxStore` | yes | yes | yes, in Redis beside the server (``?inbox=none``: no) |
| ``ownership`` | :class:`PartitionOwnership` | yes (fencing in every settle script) | yes (one process) | no |
| ``scheduling`` | :class:`Scheduler` | yes | yes | no |
| ``dead_letter_admin`` | :class:`DeadLetterAdmin` | yes | yes | yes |
| ``introspection`` | :class:`~broker.introspection.Introspection` | yes | yes | yes |
| ``state`` | :class:`StateStore` | yes (hashes under the partition's hash tag) | yes | no |
| ``redis`` | :class:`RedisStore` | yes | no | no |
| ``replies`` | :class:`ReplyStore` | yes (a stream per requester, PEXPIRE) | yes | yes (queues with ``x-expires``) |
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, cast, runtime_checkable

from broker.envelope import Envelope
from broker.introspection import Introspection
from broker.protocol import Broker, Delivery, GroupPartition
from broker.scheduling import MoveResult, ScheduledMessage
from broker.state import Effects
from broker.topology import DestinationSpec

__all__ = [
    "DEAD_LETTER_ADMIN",
    "INBOX",
    "INTROSPECTION",
    "OWNERSHIP",
    "REDIS",
    "REPLIES",
    "SCHEDULING",
    "STATE",
    "DeadLetterAdmin",
    "InboxStore",
    "PartitionOwnership",
    "RedisStore",
    "RedisTransaction",
    "ReplyStore",
    "Scheduler",
    "StateStore",
    "as_dead_letter_admin",
    "as_inbox",
    "as_introspection",
    "as_ownership",
    "as_redis",
    "as_replies",
    "as_scheduler",
    "as_state",
    "missing",
    "supports",
]

INBOX = "inbox"
"""Processed message ids per group with leases (:class:`InboxStore`): duplicates are acked unrun."""
OWNERSHIP = "ownership"
"""Partition leases with fencing tokens (:class:`PartitionOwnership`): order per key across processes."""
SCHEDULING = "scheduling"
"""Messages stored until a due time, recurring jobs' ticks (:class:`Scheduler`)."""
DEAD_LETTER_ADMIN = "dead_letter_admin"
"""Listing, redriving and purging dead letters; removing groups and destinations (:class:`DeadLetterAdmin`)."""
INTROSPECTION = "introspection"
"""Read-only views of destinations and groups: depth, pending, lag, leases, inbox memory
(:class:`broker.introspection.Introspection`): ``framework status`` and "run until idle"."""
STATE = "state"
"""Versioned state per key committed with the ack (:class:`StateStore`): sagas' state and timeouts."""
REDIS = "redis"
"""The Redis data store beside the streams (:class:`RedisStore`): ``ctx.redis``,
``ctx.redis_transaction()``: a handler's own Redis writes atomic with the ack."""
REPLIES = "replies"
"""Reply destinations per requester that expire when it is gone (:class:`ReplyStore`): request/reply."""


@runtime_checkable
class InboxStore(Protocol):
    """The inbox: leases while a handler runs, records made final with the ack (``ack(inbox=True)``)."""

    async def inbox_claim(
        self,
        source: GroupPartition,
        deliveries: Sequence[Delivery],
        lease_ms: int,
        *,
        channel: Any = None,
        window_ms: int = 0,
    ) -> list[int]:
        """Per delivery: 0 leased to the caller (run it), 1 already processed (ack it), 2 leased
        elsewhere (leave it pending). Redeliveries take stale leases over. ``window_ms``: the
        group's dedup window, which the records made final later are kept for (0: as stored)."""
        ...

    async def read_leased(
        self,
        source: GroupPartition,
        consumer: str,
        count: int,
        block_ms: int,
        *,
        lease_ms: int,
        window_ms: int = 0,
        channel: Any = None,
        token: int | None = None,
    ) -> list[Delivery]:
        """:meth:`~broker.protocol.GroupReader.read`, leasing what it reads as :meth:`inbox_claim`
        would, in the same call where the transport can: each delivery's ``inbox_status`` is set,
        or left None for the caller to check with :meth:`inbox_claim`."""
        ...

    async def trim_inbox(self, source: GroupPartition, older_than_ms: int) -> int:
        """Forget processed ids recorded before ``older_than_ms`` and leases that expired."""
        ...

    async def inbox_ready(self) -> None:
        """Check the inbox can be used, before any message (the runtime's start): a transport that
        keeps its inbox in a store beside it (RabbitMQ's Redis inbox) connects to it here and raises
        :class:`~broker.errors.BrokerUnavailable` in one line when it cannot; others return at once."""
        ...


@runtime_checkable
class PartitionOwnership(Protocol):
    """Which instance of a group owns which partition: heartbeats, leases with fencing tokens, take-over.

    A lease is held for ``ttl_ms`` from its acquisition or last renewal (by the server's clock);
    every acquisition raises the partition's token, which never goes back.
    """

    async def heartbeat(
        self, destination: str, group: str, instance: str, ttl_ms: int, *, leave: bool = False
    ) -> list[str]:
        """Beat ``instance``'s heartbeat in the group (or leave it); return the live instances, sorted."""
        ...

    async def acquire_lease(self, source: GroupPartition, instance: str, ttl_ms: int) -> int:
        """Take the partition's lease if free or expired (or held under ``instance``'s own name): the new
        token, or 0."""
        ...

    async def renew_leases(self, held: Sequence[tuple[GroupPartition, int]], instance: str, ttl_ms: int) -> list[bool]:
        """Renew (partition, token) leases in one round trip; False for each taken over meanwhile."""
        ...

    async def release_lease(self, source: GroupPartition, instance: str, token: int) -> bool:
        """Free the lease (another instance may acquire it at once); False when the token is not current."""
        ...

    async def take_over(
        self, source: GroupPartition, consumer: str, count: int, cursors: dict[str, str], *, token: int | None = None
    ) -> list[Delivery]:
        """Claim up to ``count`` entries pending in the partition for anyone, oldest first (a new
        owner's first step); ``cursors`` carries the scan from call to call; ``token``: fenced
        like :meth:`GroupReader.read`."""
        ...

    def taken_over(self, cursors: dict[str, str]) -> bool:
        """Whether the :meth:`take_over` scan with ``cursors`` has gone through every pending entry."""
        ...

    async def stop_reading(self, source: GroupPartition) -> None:
        """This process no longer owns the partition: end any subscription the transport keeps for it here
        (a server pushing messages to a consumer), so its next owner gets them; nothing where reads pull."""
        ...


@runtime_checkable
class DeadLetterAdmin(Protocol):
    """Operators' tools: dead letters, removing groups and destinations. Never on the hot path."""

    async def dead_letter_entries(
        self, view: GroupPartition, count: int | None = None
    ) -> list[tuple[str, dict[bytes, bytes]]]:
        """The group's dead letters on this partition, oldest first: (DLQ entry id, fields)."""
        ...

    async def redrive(self, view: GroupPartition, dlq_entry_id: str) -> str | None:
        """Move one dead letter back to its group only, as a first attempt; None if it is gone."""
        ...

    async def purge_dead_letters(self, view: GroupPartition, dlq_entry_ids: Sequence[str]) -> int:
        """Delete dead letters for good; return how many existed."""
        ...

    async def unsubscribe(self, spec: DestinationSpec, group: str) -> None:
        """Remove ``group`` from every partition with its retry, dead-letter and inbox state.

        No liveness check: callers (``framework unsubscribe``) refuse while consumers are alive.
        """
        ...

    async def delete_destination(self, spec: DestinationSpec, *, force: bool = False) -> int:
        """Delete the destination with all its keys and registrations; return how many keys went.

        Refuses while a group is subscribed or entries are stored, unless ``force``.
        """
        ...


@runtime_checkable
class Scheduler(Protocol):
    """Scheduled messages (stored by :meth:`Publisher.publish` when their ``deliver-at`` header lies
    ahead) and recurring jobs' ticks. Moving, cancelling and firing are atomic: several processes
    calling at once never deliver a message or fire a tick twice."""

    async def move_scheduled(self, now_ms: int, *, limit: int = 1000, sweep: bool = False) -> MoveResult:
        """Append due scheduled messages of the namespace to their partition streams."""
        ...

    async def cancel_scheduled(self, message_ids: Sequence[str], *, destination: str | None = None) -> int:
        """Cancel scheduled messages by id; returns how many were still scheduled."""
        ...

    async def scheduled_messages(
        self, *, destination: str | None = None, limit: int = 100, message_ids: Sequence[str] = ()
    ) -> list[ScheduledMessage]:
        """Scheduled messages, earliest due first (or those among ``message_ids``)."""
        ...

    async def count_scheduled(self, destination: str | None = None) -> int:
        """How many messages wait for their due time."""
        ...

    async def fire_tick(self, queue: str, tick_ms: int, envelope: Envelope) -> int:
        """Append a recurring job's tick to ``queue`` unless it (or a later tick) was fired:
        1 fired, 0 fired before, -1 first tick seen (recorded, not fired)."""
        ...


@runtime_checkable
class StateStore(Protocol):
    """Versioned state per key (a saga instance's), read by key and committed as typed operations
    (:mod:`broker.state`) atomically with a delivery's inbox mark, outgoing messages and ack.

    A state is a hash of fields (bytes values) under a key of the delivery's partition; commits
    guard it by a field's value (:class:`~broker.state.ExpectField`, a version), so two writers of
    one state never both apply. A delivery's ``settle_write`` (:class:`~broker.protocol.GuardedWrite`,
    written by :meth:`~broker.protocol.Settler.ack`) writes the same states.
    """

    commits_outgoing: bool
    """Whether :meth:`commit_effects` writes ``outgoing`` in its atomic step (False on a Redis Cluster,
    where one step's keys share a hash tag: the caller publishes them first)."""

    def state_key(self, queue: str, partition: int, correlation: str) -> str:
        """The key of ``correlation``'s state beside ``queue``'s ``partition`` (no server call; on Redis
        under the partition's hash tag, so it commits with the partition's deliveries)."""
        ...

    async def read_state(self, key: str, fields: Sequence[str]) -> list[bytes | None]:
        """``fields`` of the state at ``key`` (None where absent; all None when there is no state), read
        together with other tasks' reads; an error when ``key`` holds something else."""
        ...

    async def read_states(
        self, keys: Sequence[str], fields: Sequence[str], *, channel: Any = None
    ) -> list[list[bytes | None] | None]:
        """The same ``fields`` of each key's state in one call (a fetched batch's states read ahead; the
        keys of one partition): rows in order, None instead of the row of a key that holds no state."""
        ...

    def effects(self) -> Effects:
        """A new recorder of one run's operations, for :meth:`commit_effects`."""
        ...

    async def commit_effects(
        self,
        delivery: Delivery,
        effects: Effects,
        outgoing: Sequence[Envelope] = (),
        *,
        reason: Mapping[str, str] = {},
        token: int | None = None,
    ) -> bool:
        """Apply ``effects``' operations and ``outgoing``, mark the inbox and ack, atomically.

        False when the message was already processed (then only acked) or its entry is no longer
        pending (nothing done). A guard that does not hold raises
        :class:`~broker.errors.EffectsConflict` having done nothing (the entry stays pending); a
        ``token`` no longer current raises :class:`~broker.errors.LeaseLost`, nothing done. A write
        that fails part-way (Redis, which cannot roll back) dead-letters the message in the same
        step (``reason``: the dead letter's ``dlq-*`` fields) and raises ``EffectsFailed``.
        """
        ...


class RedisTransaction(Protocol):
    """What ``ctx.redis_transaction()`` returns (the Redis transport's recorder,
    ``broker.redis.effects.RedisEffects``): Redis writes applied with the ack.

    ``tx.call("HINCRBY", key, field, 5)`` or ``tx.hincrby(key, field, 5)``. The first argument is
    taken as the key; pass ``keys=[...]`` for commands that touch several. Writes are applied after
    the handler returns, so read current values before (``ctx.redis``). On a Redis Cluster every
    key must carry the message's hash tag (``ctx.hash_tag``).
    """

    def call(self, command: str, *args: Any, keys: Sequence[str] | None = None) -> None:
        """Record one write command."""
        ...

    def expect(self, key: str, field: str, value: str | int | None) -> None:
        """A guard: apply nothing unless hash field ``key``/``field`` still holds ``value`` (None:
        absent) at commit; else the commit raises :class:`~broker.errors.EffectsConflict`, nothing done."""
        ...

    def after_commit(self, fn: Callable[[], object]) -> None:
        """Run ``fn()`` once these writes were applied."""
        ...

    def __getattr__(self, name: str) -> Callable[..., None]:
        """``tx.hset(...)``: :meth:`call` of the command named so."""
        ...


@runtime_checkable
class RedisStore(Protocol):
    """The Redis data store of the Redis transport: handlers' own Redis reads (``ctx.redis``) and
    writes committed atomically with the inbox mark and the ack (``ctx.redis_transaction()``)."""

    cluster: bool
    """True on a Redis Cluster: writes of one atomic step must share the delivery's hash tag, so
    a handler's outgoing messages are published before its effects commit."""

    redis: Any
    """The Redis client itself: ``ctx.redis`` hands it to handlers for their own reads. A second
    transport would offer None here (``ctx.redis`` is then None) or a client of its own."""

    def effects(self) -> RedisTransaction:
        """A new recorder of one run's Redis writes (it records :mod:`broker.state` operations too:
        one recorder serves a saga step that also writes Redis itself)."""
        ...

    async def commit_effects(
        self,
        delivery: Delivery,
        effects: Effects,
        outgoing: Sequence[Envelope] = (),
        *,
        reason: Mapping[str, str] = {},
        token: int | None = None,
    ) -> bool:
        """:meth:`StateStore.commit_effects`, for a recorder from :meth:`effects`: its commands in the
        order recorded. A command that fails stops the rest (the ones before it stay applied: Redis
        has no rollback) and dead-letters the message in the same script call (``EffectsFailed``)."""
        ...


@runtime_checkable
class ReplyStore(Protocol):
    """Durable reply destinations, one per requester instance, that expire unless kept alive.

    A reply is an envelope whose ``destination`` is the reply destination's name. A requester
    opens its destination, keeps it with :meth:`open_replies` (each call pushes its expiry back),
    and reads what was stored after a cursor, so a short disconnect loses no reply.
    """

    async def open_replies(self, name: str, ttl_ms: int) -> None:
        """Create reply destination ``name`` (empty) if it does not exist; it expires ``ttl_ms`` from now."""
        ...

    async def send_replies(self, replies: Sequence[Envelope]) -> int:
        """Store each reply on its destination if that destination exists; return how many were
        stored (a reply to an expired or deleted destination is dropped: its requester is gone)."""
        ...

    async def read_replies(
        self, name: str, cursor: str, *, block_ms: int = 0, count: int = 100
    ) -> tuple[str, list[Envelope]]:
        """Replies stored on ``name`` after ``cursor`` ('0': the first), waiting up to ``block_ms``
        for one, and the cursor to read from next; replies up to ``cursor`` (read before) are removed.
        [] when it does not exist."""
        ...

    async def replies_exist(self, name: str) -> bool:
        """Whether reply destination ``name`` exists (not expired, not closed)."""
        ...

    async def close_replies(self, name: str) -> None:
        """Delete reply destination ``name`` now, with any reply on it."""
        ...


def supports(broker: Broker, capability: str) -> bool:
    """Whether ``broker`` declares ``capability`` (one of this module's names)."""
    return capability in broker.capabilities


def missing(broker: Broker, needed: Iterable[str]) -> list[str]:
    """The capabilities in ``needed`` that ``broker`` does not declare, sorted."""
    return sorted(set(needed) - broker.capabilities)


def as_inbox(broker: Broker) -> InboxStore:
    """``broker`` as an :class:`InboxStore`; ``TypeError`` naming the transport when it has none."""
    return cast("InboxStore", _narrow(broker, INBOX))


def as_introspection(broker: Broker) -> Introspection:
    """``broker`` as an :class:`~broker.introspection.Introspection`; ``TypeError`` when it has none."""
    return cast("Introspection", _narrow(broker, INTROSPECTION))


def as_ownership(broker: Broker) -> PartitionOwnership:
    """``broker`` as a :class:`PartitionOwnership`; ``TypeError`` when it has none."""
    return cast("PartitionOwnership", _narrow(broker, OWNERSHIP))


def as_scheduler(broker: Broker) -> Scheduler:
    """``broker`` as a :class:`Scheduler`; ``TypeError`` when it has none."""
    return cast("Scheduler", _narrow(broker, SCHEDULING))


def as_dead_letter_admin(broker: Broker) -> DeadLetterAdmin:
    """``broker`` as a :class:`DeadLetterAdmin`; ``TypeError`` when it has none."""
    return cast("DeadLetterAdmin", _narrow(broker, DEAD_LETTER_ADMIN))


def as_state(broker: Broker) -> StateStore:
    """``broker`` as a :class:`StateStore`; ``TypeError`` when it has none."""
    return cast("StateStore", _narrow(broker, STATE))


def as_redis(broker: Broker) -> RedisStore:
    """``broker`` as a :class:`RedisStore`; ``TypeError`` when it has none."""
    return cast("RedisStore", _narrow(broker, REDIS))


def as_replies(broker: Broker) -> ReplyStore:
    """``broker`` as a :class:`ReplyStore`; ``TypeError`` when it has none."""
    return cast("ReplyStore", _narrow(broker, REPLIES))


def _narrow(broker: Broker, name: str) -> Broker:
    """``broker`` itself, once it is known to declare capability ``name`` (callers cast it to its protocol)."""
    if name not in broker.capabilities:
        raise TypeError(f"the {broker.transport} transport has no {name!r} capability")
    return broker
