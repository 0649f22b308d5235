"""The in-process transport: the Broker contract in this process's memory, for users' unit tests.

``broker.connect("memory://")`` or ``connect_memory("memory://NAME")`` gives a :class:`MemoryBroker` on
the process's server of that name (``memory://`` is the default one): every connect to one name in one
process shares one :class:`MemoryServer`, so a test's client and the service it runs meet there;
namespaces (``namespace=``, default ``$FRAMEWORK_NAMESPACE`` or ``fw``) separate deployments on one
server as key prefixes do on Redis. :func:`reset` drops a server (or all) between tests.

What it promises:

* **One process only.** Other processes (workers started by ``framework run``, the CLI) cannot reach it.
  Nothing survives the process: there is no persistence, so "durable" means "stored in this process".
* **The Redis transport's semantics** (``broker/redis/``) for everything it declares: publishing with
  idempotency keys and the body size limit, group reads with ``ms-seq`` entry ids and per-partition
  order, pending entries with delivery counts and idle times (``claim_idle``, ``extend``,
  ``release_own_pending``), settle calls that are atomic and no-ops once settled, fencing tokens
  (``LeaseLost``), delayed retries and redrives to one group only, dead letters with the same fields,
  topic retention that never trims what a group has not acknowledged, queues that delete acked entries;
  and the capabilities ``inbox``, ``ownership`` (leases and heartbeats within the process),
  ``scheduling``, ``dead_letter_admin``, ``introspection`` (depth, pending, lag: "run until idle") and
  ``state`` (versioned state per key committed with the ack: sagas run here).
* **Blocking reads** wait on an event woken by every append (no polling) and end at ``block_ms``.
  Idle times, leases and heartbeats use the process's monotonic clock; entry ids, due times, inbox
  records and idempotency windows use Unix time, as the Redis server's clock.

What it does not do: the ``redis`` capability (``ctx.redis``, ``ctx.redis_transaction()``: a
handler's own Redis writes committed with the ack); anything across processes (``framework run``
workers, ``framework status`` and the other CLI commands see nothing of it); connection and timeout
failures (nothing fails); sharing between threads or event loops running at once; memory limits
(retention applies only when ``trim`` runs, as on Redis).
"""

from __future__ import annotations

from broker.memory.broker import MemoryBroker
from broker.memory.core import MemoryKeys
from broker.memory.server import MemoryServer, get_server, reset
from broker.urls import default_namespace

__all__ = ["MemoryBroker", "MemoryKeys", "MemoryServer", "connect_memory", "get_server", "reset"]


def connect_memory(url: str = "memory://", *, namespace: str | None = None) -> MemoryBroker:
    """A broker on the process's server named by ``url`` (``memory://`` or ``memory://NAME``), created on
    first use, under ``namespace`` (default :func:`broker.urls.default_namespace`)."""
    return MemoryBroker(get_server(url), namespace=namespace or default_namespace(), url=url)
