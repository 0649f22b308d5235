"""The Redis inbox beside a transport that keeps none itself (RabbitMQ): :class:`RedisInbox`.

A group partition's inbox lives under the keys the Redis transport gives the same group partition
(``KeySpace(namespace).partition(destination, p).group(group).inbox``, see :mod:`broker.redis.keys`),
so every key of one group partition shares its hash tag (a Cluster routes each call to one node),
``inbox_memory`` reports read it alike, and a service moving between the transports on one Redis
keeps its processed ids. Every call is one of the Redis transport's own:

* check and lease a batch: ``inbox_claim.lua`` (:meth:`RedisBroker.inbox_claim`);
* record processed ids for good and drop their leases: ``ack.lua`` with no stream entry to ack;
* extend leases: ``ZADD XX LT`` of the lease score (a lease is a negative score, ``-expiry``: a later
  expiry is a lower score, and only a member already there, a lease, is touched);
* release leases (a retry or a dead letter): ``ZADD XX GT -now``, which ends a live lease at once and
  never touches a final record (scores >= 0);
* forget old records and dead leases: :meth:`RedisBroker.trim_inbox`; a group's whole inbox when it
  goes (unsubscribe): :meth:`RedisBroker.delete_inbox`.

The connection is opened on first use (or by :meth:`ready`, which the runtime calls at start): a
process that only publishes never needs the inbox's server. Without a URL the inbox uses
``$REDIS_URL``, else the per-user embedded Valkey (started if needed), as the Redis transport does.
A server that cannot be reached is one line naming it and saying how to start one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import anyio

from broker.envelope import now_ms
from broker.errors import BrokerUnavailable
from broker.introspection import InboxMemory
from broker.operators import WorkerBeat
from broker.protocol import Delivery, GroupPartition
from broker.redis.broker import RedisBroker
from broker.redis.keys import inbox_records
from broker.redis.reading import SCRIPT_CHUNK
from broker.urls import redact

__all__ = ["RedisInbox"]


def _embedded_url() -> str:
    from broker.redis.embedded import EmbeddedServer

    return EmbeddedServer().ensure_running()


class RedisInbox:
    """The Redis inbox of another transport's groups (the ``SideInbox`` of :mod:`broker.rabbitmq.inbox`).

    ``url``: the inbox's Redis (None: ``$REDIS_URL``, else the embedded Valkey); ``origin``: where that
    choice came from, for error messages (``"the amqp URL's inbox parameter"``, ...).
    """

    def __init__(self, url: str | None, *, namespace: str, origin: str) -> None:
        self.url = url
        self.origin = origin
        self.namespace = namespace
        self._broker: RedisBroker | None = None
        self._opening = anyio.Lock()

    def describe(self) -> str:
        """Where the inbox lives, without a password."""
        if self._broker is not None:
            return redact(self._broker.url)
        return redact(self.url) if self.url else "$REDIS_URL or the embedded Valkey"

    async def _redis(self) -> RedisBroker:
        """The Redis broker whose scripts and keys serve the inbox, connected on first use."""
        broker = self._broker
        if broker is not None:
            return broker
        async with self._opening:
            if self._broker is None:
                self._broker = await self._connect()
            return self._broker

    async def counter(self, name: str) -> int:
        """A named counter of the namespace beside the inbox (``SideCounters``: the registry's version)."""
        broker = await self._redis()
        return int(await broker.redis.get(f"{self.namespace}:counter:{name}") or 0)

    async def bump(self, name: str) -> int:
        """Raise the named counter by one; its new value."""
        broker = await self._redis()
        return int(await broker.redis.incr(f"{self.namespace}:counter:{name}"))

    async def beat_worker(
        self, name: str, groups: Sequence[tuple[str, str]], ttl_ms: int, info: Mapping[str, str]
    ) -> None:
        """A worker's heartbeat in the Redis beside the other transport (``SideWorkers``), as on Redis."""
        await (await self._redis()).beat_worker(name, groups, ttl_ms, info)

    async def leave_worker(self, name: str) -> None:
        """Mark worker ``name`` gone now."""
        await (await self._redis()).leave_worker(name)

    async def workers(self) -> list[WorkerBeat]:
        """Every worker recorded beside the other transport, by name."""
        return await (await self._redis()).workers()

    async def redis_broker(self) -> RedisBroker:
        """The Redis broker behind the inbox, connected on first use (the schedule beside it shares it)."""
        return await self._redis()

    async def _connect(self) -> RedisBroker:
        from broker.redis.connect import connect_redis

        url, origin = self.url, self.origin
        if url is None:
            url, origin = os.environ.get("REDIS_URL") or None, "REDIS_URL"
        if url is None:
            origin = "the embedded Valkey"
            try:
                url = await anyio.to_thread.run_sync(_embedded_url)
            except BrokerUnavailable as exc:
                raise BrokerUnavailable(f"the inbox's Redis (the embedded Valkey) cannot start: {exc}") from None
        try:
            return await connect_redis(url, explicit=True, namespace=self.namespace)
        except BrokerUnavailable as exc:
            reason = str(exc.__cause__ or exc).rstrip(".").replace("\n", " ")
            raise BrokerUnavailable(
                f"cannot reach the inbox's Redis at {redact(url)} ({origin}): {reason}. Start it "
                "(`redis-server --port 6379`; `framework server start` for the embedded Valkey), or point the "
                "broker URL's ?inbox= (or FRAMEWORK_INBOX_URL) at a running one; ?inbox=none turns the Redis "
                "inbox off"
            ) from None

    async def _view(self, source: GroupPartition) -> tuple[RedisBroker, GroupPartition]:
        """The Redis broker and its view of ``source``'s group partition (the same keys the Redis
        transport keeps for it)."""
        broker = await self._redis()
        return broker, broker.group_partition(source.spec, source.partition, source.group)

    async def ready(self) -> None:
        """Connect now (the runtime's start): :class:`BrokerUnavailable` in one line when it cannot."""
        broker = await self._redis()
        try:
            await broker.redis.ping()
        except Exception as exc:
            raise BrokerUnavailable(
                f"the inbox's Redis at {redact(broker.url)} does not answer ({type(exc).__name__}: {exc})"
            ) from None

    async def claim(
        self, source: GroupPartition, deliveries: Sequence[Delivery], lease_ms: int, *, window_ms: int = 0
    ) -> list[int]:
        """``inbox_claim.lua`` over the deliveries (redelivered ones, ``delivery_count`` > 1, take
        leases over): 0 run, 1 already processed, 2 leased elsewhere; one call."""
        if not deliveries:
            return []
        broker, view = await self._view(source)
        statuses = await broker.inbox_claim(view, deliveries, lease_ms, window_ms=window_ms)
        return [int(s) for s in statuses]

    async def record(self, source: GroupPartition, message_ids: Sequence[str]) -> None:
        """Make ``message_ids`` processed for good and drop their leases (``ack.lua`` acking no entry)."""
        if not message_ids:
            return
        broker, view = await self._view(source)
        keys = [view.stream, view.keys.inbox, view.keys.attempts]
        now = now_ms()
        for i in range(0, len(message_ids), SCRIPT_CHUNK):
            chunk = list(message_ids[i : i + SCRIPT_CHUNK])
            args: list[Any] = [view.group, "0", now, 0, len(chunk), 0, *chunk, inbox_records(chunk), 0]
            await broker.scripts["ack"](broker.redis, keys, args)

    async def extend(self, source: GroupPartition, message_ids: Sequence[str], lease_ms: int) -> None:
        """Push the leases of ``message_ids`` out to ``lease_ms`` from now (ids without a lease: nothing)."""
        if not message_ids:
            return
        broker, view = await self._view(source)
        score = -(now_ms() + lease_ms)
        pipe = broker.redis.pipeline(transaction=False)
        for mid in message_ids:
            pipe.zadd(view.keys.inbox, {mid: score}, xx=True, lt=True)
        await pipe.execute()

    async def release(self, source: GroupPartition, message_ids: Sequence[str]) -> None:
        """End the live leases of ``message_ids`` now (a retry or a dead letter: the next copy runs at once)."""
        if not message_ids:
            return
        broker, view = await self._view(source)
        score = -now_ms()
        pipe = broker.redis.pipeline(transaction=False)
        for mid in message_ids:
            pipe.zadd(view.keys.inbox, {mid: score}, xx=True, gt=True)
        await pipe.execute()

    async def trim(self, source: GroupPartition, older_than_ms: int) -> int:
        """:meth:`RedisBroker.trim_inbox` of the group partition."""
        broker, view = await self._view(source)
        return await broker.trim_inbox(view, older_than_ms)

    async def memory(self, source: GroupPartition) -> InboxMemory:
        """What the group partition's inbox holds (:meth:`RedisBroker.inbox_memory`)."""
        broker, view = await self._view(source)
        return await broker.inbox_memory(view)

    async def forget(self, source: GroupPartition) -> int:
        """Delete the group partition's inbox (:meth:`RedisBroker.delete_inbox`, plus its attempts hash);
        returns the keys deleted."""
        broker, view = await self._view(source)
        return await broker.delete_inbox(view) + int(await broker.redis.delete(view.keys.attempts))

    async def close(self) -> None:
        """Close the connection (opened again on next use)."""
        broker, self._broker = self._broker, None
        if broker is not None:
            await broker.close()
