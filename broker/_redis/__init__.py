"""The Redis Streams transport, split by role; :class:`broker.redis_broker.RedisBroker` combines them.

Internal: import :class:`~broker.RedisBroker`, not these modules. Each role is a mixin over
:class:`~broker._redis.core.RedisCore`, which owns the state every role shares::

    core.py            the client, caches, script pipelines, XINFO GROUPS
    topology.py        declare, route/ensure_declared (declare on first use), subscribe
    publishing.py      publish (batches, idempotency keys, the body size limit)
    reading.py         group reads, own pending, claims, leases (extend), the inbox check, channels
    settlement.py      ack, commit_effects, attempts, dead letter, retry later, due retries, retention
    administration.py  dead letters (list, redrive, purge), unsubscribe, delete a destination
    leases.py          partition ownership: instances' heartbeats, partition leases, take-over of pending entries
    scheduling.py      scheduled messages (stored until due, moved atomically, cancelled) and job ticks

The key layout is in ``broker/keys.py``; each Lua script in ``broker/lua/`` documents its keys.
"""
