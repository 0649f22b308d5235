"""What a transport claims (:class:`Features`): the optional capabilities and behaviours its checks may rely on."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import attrs

from broker.capabilities import DEAD_LETTER_ADMIN, INBOX, INTROSPECTION, OWNERSHIP, REPLIES, SCHEDULING, STATE
from broker.protocol import Broker, GroupPartition

__all__ = ["CAPABILITY_FEATURES", "BrokerFactory", "Features", "RawWriter"]

BrokerFactory = Callable[[], Awaitable[Broker]]
"""Makes a new connected broker; every broker one factory makes talks to the same server and
namespace (a check that makes two sees them share what is stored). The checks close what they make."""

RawWriter = Callable[[Broker, GroupPartition, Mapping[bytes, bytes]], Awaitable[None]]
"""Appends raw fields to a partition's log past the codec (an entry no producer could write):
how a check stores an undecodable entry. Transport-specific, so supplied by the transport's author."""

CAPABILITY_FEATURES: dict[str, str] = {
    "inbox": INBOX,
    "ownership": OWNERSHIP,
    "scheduling": SCHEDULING,
    "dead_letter_admin": DEAD_LETTER_ADMIN,
    "introspection": INTROSPECTION,
    "state": STATE,
    "replies": REPLIES,
}
"""Feature name -> the :mod:`broker.capabilities` name it stands for."""


@attrs.frozen(kw_only=True)
class Features:
    """What the transport under test claims beyond the core contract; a check needing a feature that
    is off is skipped (see :meth:`broker.conformance.registry.Check.skip_reason`).

    The capability flags mirror :mod:`broker.capabilities` (use :meth:`of` or :meth:`detect` to take
    them from what the transport declares); the behaviour flags default to what the contract's
    docstrings promise, and a transport that does not keep one says so here.
    """

    inbox: bool = False
    """:class:`~broker.capabilities.InboxStore`: processed ids and leases per group."""
    ownership: bool = False
    """:class:`~broker.capabilities.PartitionOwnership`: partition leases, fencing tokens, take-over."""
    scheduling: bool = False
    """:class:`~broker.capabilities.Scheduler`: messages stored until due, recurring jobs' ticks."""
    dead_letter_admin: bool = False
    """:class:`~broker.capabilities.DeadLetterAdmin`: listing, redriving, purging; unsubscribe, delete."""
    introspection: bool = False
    """:class:`~broker.introspection.Introspection`: what is stored, pending, lagging (how checks see storage)."""
    state: bool = False
    """:class:`~broker.capabilities.StateStore`: versioned state per key committed with the ack (sagas)."""
    replies: bool = False
    """:class:`~broker.capabilities.ReplyStore`: reply destinations per requester that expire (request/reply)."""
    retention: bool = True
    """Topics keep events for their retention: a group created at ``earliest`` replays what is kept,
    and :meth:`~broker.protocol.Settler.trim` removes only what every group acknowledged."""
    idempotency_keys: bool = True
    """:meth:`~broker.protocol.Publisher.publish` stores a message with an ``idempotency-key`` header at most
    once per dedup window (False: a repeat is stored again; consumers' inboxes drop the copy)."""
    parked_retries: bool = True
    """Delayed retries wait until :meth:`~broker.protocol.Settler.move_due` moves them (so a caller may move
    them early). False: the server delivers them by its own clock when due, and ``move_due`` moves nothing."""
    atomic_settlement: bool = True
    """``dead_letter`` and ``retry_later`` write the copy and acknowledge in one atomic step. False: a
    confirmed copy, then the ack; a crash between them delivers the message again (never loses it)."""
    fencing: bool = True
    """With ``ownership``: settles, reads, claims and take-overs carrying a stale token are refused
    (:class:`~broker.errors.LeaseLost`). False: leases decide who reads a partition, but the server does not
    check the token (a stale owner's ack still applies)."""
    blocking_reads: bool = True
    """:meth:`~broker.protocol.GroupReader.read` with ``block_ms`` waits for an entry published meanwhile."""
    shared_state: bool = True
    """Brokers the factory makes share what is stored (one server): a second connection, as after a
    reconnect, sees the first one's destinations, messages and pending entries."""
    store_raw: RawWriter | None = None
    """How to store an undecodable entry (None: the checks that need one are skipped)."""

    @classmethod
    def of(cls, capabilities: Iterable[str], **overrides: Any) -> Features:
        """The features a transport declaring ``capabilities`` claims, with ``overrides`` (field=value)."""
        declared = frozenset(capabilities)
        flags: dict[str, Any] = {name: cap in declared for name, cap in CAPABILITY_FEATURES.items()}
        flags.update(overrides)
        return cls(**flags)

    @classmethod
    async def detect(cls, make: BrokerFactory, **overrides: Any) -> Features:
        """:meth:`of` the capabilities a broker from ``make`` declares (it is closed again)."""
        broker = await make()
        try:
            return cls.of(broker.capabilities, **overrides)
        finally:
            await broker.close()

    def has(self, name: str) -> bool:
        """Whether the feature ``name`` is claimed (a hook counts when it is set)."""
        value = getattr(self, name)
        return value is not None and value is not False

    @classmethod
    def names(cls) -> frozenset[str]:
        """Every feature's name (what ``requires=`` may list)."""
        return frozenset(f.name for f in attrs.fields(cls))
