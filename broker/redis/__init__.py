"""The Redis Streams transport: everything that knows Redis (keys, Lua, connections, the embedded server).

:class:`RedisBroker` (``broker.py``) combines the roles below; import the names this package exports,
not its role modules. Each role is a mixin over
:class:`~broker.redis.core.RedisCore`, which owns the state every role shares::

    core.py            the client, caches, script pipelines, XINFO GROUPS
    topology.py        declare, route/ensure_declared (declare on first use), subscribe
    publishing.py      publish (batches, idempotency keys, the body size limit)
    reading.py         group reads, own pending, claims, leases (extend), the inbox check, channels
    settlement.py      ack, attempts, dead letter, retry later, due retries, retention
    state.py           versioned state per key (sagas) and commit_effects: effects committed with the ack
    effects.py         the recorder behind ctx.redis_transaction(), typed state operations as commands
    administration.py  dead letters (list, redrive, purge), unsubscribe, delete a destination
    leases.py          partition ownership: instances' heartbeats, partition leases, take-over of pending entries
    scheduling.py      scheduled messages (stored until due, moved atomically, cancelled) and job ticks
    keys.py            the key layout, written down once
    scripts.py, lua/   the Lua scripts, each with a header documenting its keys and arguments
    wire.py            connections: faster packing, bounded reads, one connection error
    connect.py         connecting by URL (single node or Cluster), ACL refusals mapped
    embedded.py        the shared embedded Valkey (``framework server``); embedded_cluster.py for tests
    inspect.py         read-only views for ``framework status`` (depth, pending, lag)

The key layout is in ``broker/redis/keys.py``; each Lua script in ``broker/redis/lua/`` documents its keys.
"""

from broker.redis.broker import RedisBroker
from broker.redis.embedded import EmbeddedServer, ServerStatus, default_data_dir, framework_home
from broker.redis.keys import GroupKeys, KeySpace, PartitionKeys

__all__ = [
    "EmbeddedServer",
    "GroupKeys",
    "KeySpace",
    "PartitionKeys",
    "RedisBroker",
    "ServerStatus",
    "default_data_dir",
    "framework_home",
]
