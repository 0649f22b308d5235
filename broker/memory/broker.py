"""The memory transport's broker: the Broker contract and its capabilities in one process, one facade over eight roles.

As :class:`broker.redis.RedisBroker`, :class:`MemoryBroker` is made of role mixins over
:class:`~broker.memory.core.MemoryCore` (topology, publishing with scheduling, reading, leases,
settlement, state, administration, introspection), each in its module of ``broker/memory/``; the state lives in the
:class:`~broker.memory.server.MemoryServer` every broker connected to one ``memory://NAME`` shares.
"""

from __future__ import annotations

from broker.capabilities import DEAD_LETTER_ADMIN, INBOX, INTROSPECTION, OWNERSHIP, REPLIES, SCHEDULING, STATE
from broker.memory.administration import Administration
from broker.memory.introspection import Inspection
from broker.memory.leases import Leases
from broker.memory.publishing import Publishing
from broker.memory.reading import Reading
from broker.memory.replies import Replies
from broker.memory.settlement import Settlement
from broker.memory.state import StateStorage

__all__ = ["ROLES", "MemoryBroker"]

ROLES: tuple[type, ...] = (Publishing, Reading, Settlement, StateStorage, Administration, Leases, Inspection, Replies)
"""The role mixins :class:`MemoryBroker` is made of (topology comes in through four of them; leases
build on reading, state on scheduling)."""


class MemoryBroker(Publishing, Leases, Reading, Settlement, StateStorage, Administration, Inspection, Replies):
    """Broker in this process's memory. Use :func:`broker.memory.connect_memory` (or
    ``broker.connect("memory://NAME")``) to build one.

    Belongs to one event loop at a time, like any broker; any number of its tasks may call it at once.
    Keeps the :class:`~broker.Broker` contract with the semantics of the Redis transport, and the
    capabilities ``inbox``, ``ownership`` (within this process), ``scheduling``, ``dead_letter_admin``,
    ``introspection``, ``state`` (sagas) and ``replies`` (request/reply).
    """

    transport = "memory"
    capabilities = frozenset({INBOX, OWNERSHIP, SCHEDULING, DEAD_LETTER_ADMIN, INTROSPECTION, STATE, REPLIES})
