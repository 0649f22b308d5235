"""The Redis Streams transport: the Broker contract on Redis >= 6.2 or Valkey (single node or Cluster).

:class:`RedisBroker` is one facade over eight roles, each a module of ``broker/redis/`` named for its
job (topology, publishing, reading, intake, settlement, state, administration, leases). Why mixins rather than
a facade forwarding to role objects:

* the public methods stay exactly what they were (same names, signatures, docstrings and code),
  with no forwarding layer on the hot path (read, inbox check, ack run per batch) and no second
  copy of each signature to keep in step;
* the roles share one state (client, registry cache, partition key cache, scripts), declared once
  in :class:`~broker.redis.core.RedisCore`; a role reads only that state and the roles it
  inherits from (publishing, settlement, state and administration need topology's :meth:`route`), and
  no two roles define the same name (``tests/test_broker_conformance.py`` checks it).
"""

from __future__ import annotations

from broker.capabilities import DEAD_LETTER_ADMIN, INBOX, INTROSPECTION, OWNERSHIP, REDIS, REPLIES, SCHEDULING, STATE
from broker.redis.administration import Administration
from broker.redis.inspect import Inspection
from broker.redis.intake import Intake
from broker.redis.leases import Leases
from broker.redis.publishing import Publishing
from broker.redis.reading import Reading
from broker.redis.replies import Replies
from broker.redis.settlement import Settlement
from broker.redis.state import StateStorage

__all__ = ["ROLES", "RedisBroker"]

ROLES: tuple[type, ...] = (
    Publishing,
    Reading,
    Intake,
    Settlement,
    StateStorage,
    Administration,
    Leases,
    Inspection,
    Replies,
)
"""The role mixins :class:`RedisBroker` is made of (topology comes in through four of them; leases
and the leased read build on reading, state on scheduling)."""


class RedisBroker(Publishing, Leases, Intake, Reading, Settlement, StateStorage, Administration, Inspection, Replies):
    """Broker on Redis Streams. Use :func:`broker.connect` to build one from a URL.

    One instance is safe to share between tasks of one event loop (not between threads or event
    loops: its client's connections belong to the loop that opened them). Blocking reads take a
    connection each from the pool for as long as they wait. Keeps the :class:`~broker.Broker`
    contract and every capability of :mod:`broker.capabilities`; the key layout is in
    :mod:`broker.redis.keys`.
    """

    transport = "redis"
    capabilities = frozenset({INBOX, OWNERSHIP, SCHEDULING, DEAD_LETTER_ADMIN, INTROSPECTION, STATE, REDIS, REPLIES})
