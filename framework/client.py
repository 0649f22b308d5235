"""Publishing from plain code: an async :class:`Client` and a blocking :class:`SyncClient`.

``send`` puts a command on a queue, ``publish`` an event on a topic; both return once the message
is stored. ``request`` sends a command and waits for its handler's return value (request/reply,
:mod:`framework.requests`). ``send_many``/``publish_many`` and :meth:`Client.batch` pipeline many messages in one
round trip. ``idempotency_key`` makes a repeated publish (a retried HTTP request, say) a no-op
within the broker's dedup window (``send``/``publish`` then return None instead of an id).

A destination named by string that nobody declared is checked first (:mod:`framework._destinations`):
a near match of a declared name raises :class:`~framework.UnknownDestination` (a typo would create a
queue nobody reads); ``create=True`` or a ``Queue``/``Topic`` object creates one on purpose.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Iterator, Mapping
from datetime import datetime, timedelta
from typing import Any

import anyio.from_thread

from broker import COMMAND, EVENT, Broker, Envelope, connect
from broker.capabilities import as_scheduler
from broker.codec import check_body_size
from broker.codec import max_body_bytes as max_body_setting
from framework._destinations import DestinationGuard
from framework._messages import Outgoing, build_envelope
from framework.observability import hooks
from framework.requests import DEFAULT_REPLY_TTL, Requester
from framework.scheduling import with_due
from framework.service import Queue, Topic

__all__ = ["Batch", "Client", "SyncClient"]


def _scheduled(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with ``delay``/``at`` turned into the ``deliver-at`` header."""
    delay, at = options.pop("delay", None), options.pop("at", None)
    if delay is not None or at is not None:
        options["headers"] = with_due(dict(options.get("headers") or {}), delay, at)
    return options


class Batch:
    """Messages collected to be published together, in order, in one pipeline."""

    def __init__(self) -> None:
        self.items: list[Outgoing] = []
        self.created: set[str] = set()  # names sent to with create=True

    def send(self, queue: str | Queue, command: Any, *, create: bool = False, **options: Any) -> str | None:
        """Add a command; returns its message id (options as :meth:`Client.send`, ``delay``/``at`` too)."""
        env, spec = build_envelope(queue, COMMAND, command, **_scheduled(options))
        self.items.append((env, spec))
        if create:
            self.created.add(env.destination)
        return env.id

    def publish(self, topic: str | Topic, event: Any, *, create: bool = False, **options: Any) -> str | None:
        """Add an event; returns its message id (options as :meth:`Client.publish`, ``delay``/``at`` too)."""
        env, spec = build_envelope(topic, EVENT, event, **_scheduled(options))
        self.items.append((env, spec))
        if create:
            self.created.add(env.destination)
        return env.id


class Client:
    """Async producer. ``async with Client() as c: await c.send("billing.refund", Refund(...))``.

    Without ``url``/``broker`` it connects like the runtime does: ``REDIS_URL``, else the
    embedded server. ``max_body_bytes`` (default ``$FRAMEWORK_MAX_BODY_BYTES``, else 1 MiB):
    a larger body raises :class:`~broker.errors.MessageTooLarge` and nothing is stored.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        namespace: str | None = None,
        broker: Broker | None = None,
        max_body_bytes: int | None = None,
        reply_ttl: float = DEFAULT_REPLY_TTL,
    ) -> None:
        self._url = url
        self._reply_ttl = reply_ttl
        self._requester: Requester | None = None
        self._namespace = namespace
        self._broker = broker
        self._max_body_bytes = max_body_setting(max_body_bytes) if max_body_bytes is not None else None
        self._owns = broker is None
        self._guard = DestinationGuard()

    async def __aenter__(self) -> Client:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> Broker:
        """Connect now (otherwise the first publish does)."""
        if self._broker is None:
            broker = await connect(self._url, namespace=self._namespace)
            if self._max_body_bytes is not None:
                broker.max_body_bytes = self._max_body_bytes
            self._broker = broker
        return self._broker

    @property
    def broker(self) -> Broker:
        """The connected broker."""
        if self._broker is None:
            raise RuntimeError("client is not connected: use `async with Client()` or await connect()")
        return self._broker

    async def close(self) -> None:
        """Close the connection if this client opened it (and delete its reply destination)."""
        if self._requester is not None:
            requester, self._requester = self._requester, None
            await requester.close()
        if self._owns and self._broker is not None:
            await self._broker.close()
            self._broker = None

    async def _publish(
        self,
        items: list[Outgoing],
        dedup_window_ms: int | None = None,
        *,
        create: bool | Collection[str] = False,
    ) -> list[str | None]:
        """Store ``items``; names not declared yet are checked unless ``create`` (True, or the names)."""
        broker = await self.connect()
        limit = self._max_body_bytes or broker.max_body_bytes
        for env, _ in items:  # before anything is declared or sent
            check_body_size(env, limit)
        if create is not True:
            await self._guard.check(broker, items, created=create or ())
        for _, spec in items:  # Queue/Topic objects: declared once per broker; names are routed by publish
            if spec is not None:
                await broker.ensure_declared(spec)
        if hooks.ANY:  # a PRODUCER span per message, its context in the headers; the sent counter
            return await hooks.publish(broker, [env for env, _ in items], dedup_window_ms)
        return await broker.publish([env for env, _ in items], dedup_window_ms=dedup_window_ms)

    async def send(
        self,
        queue: str | Queue,
        command: Any,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
        type: str | None = None,
        idempotency_key: str | None = None,
        message_id: str | None = None,
        delay: timedelta | float | None = None,
        at: datetime | None = None,
        create: bool = False,
    ) -> str | None:
        """Send a command to ``queue``; return its message id.

        None when ``idempotency_key`` was already used within the dedup window (nothing stored).
        ``delay`` (seconds or timedelta, >= 0) or ``at`` (an aware datetime) schedules it: stored
        now, delivered when due; :meth:`cancel_scheduled` takes the returned id. An undeclared
        ``queue`` close to a declared name raises :class:`~framework.UnknownDestination` unless
        ``create=True``.
        """
        item = build_envelope(
            queue,
            COMMAND,
            command,
            key=key,
            headers=with_due(dict(headers) if headers else None, delay, at),
            type=type,
            idempotency_key=idempotency_key,
            message_id=message_id,
        )
        [entry] = await self._publish([item], create=create)
        return None if entry is None else item[0].id

    async def publish(
        self,
        topic: str | Topic,
        event: Any,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
        type: str | None = None,
        idempotency_key: str | None = None,
        message_id: str | None = None,
        delay: timedelta | float | None = None,
        at: datetime | None = None,
        create: bool = False,
    ) -> str | None:
        """Publish an event to ``topic``; return its message id.

        None when ``idempotency_key`` was already used within the dedup window (nothing stored).
        ``delay``/``at`` schedule it, and ``create`` works, as for :meth:`send`.
        """
        item = build_envelope(
            topic,
            EVENT,
            event,
            key=key,
            headers=with_due(dict(headers) if headers else None, delay, at),
            type=type,
            idempotency_key=idempotency_key,
            message_id=message_id,
        )
        [entry] = await self._publish([item], create=create)
        return None if entry is None else item[0].id

    async def send_many(
        self,
        queue: str | Queue,
        commands: Iterable[Any],
        *,
        key: Callable[[Any], str] | None = None,
        delay: timedelta | float | None = None,
        at: datetime | None = None,
        create: bool = False,
    ) -> list[str]:
        """Send many commands in one pipeline; ``key`` computes each one's key; ``delay``/``at``
        schedule them all (one due time)."""
        headers = with_due(None, delay, at)
        items = [build_envelope(queue, COMMAND, c, key=key(c) if key else None, headers=headers) for c in commands]
        await self._publish(items, create=create)
        return [env.id for env, _ in items]

    async def publish_many(
        self,
        topic: str | Topic,
        events: Iterable[Any],
        *,
        key: Callable[[Any], str] | None = None,
        delay: timedelta | float | None = None,
        at: datetime | None = None,
        create: bool = False,
    ) -> list[str]:
        """Publish many events in one pipeline; ``key`` computes each one's key; ``delay``/``at``
        schedule them all (one due time)."""
        headers = with_due(None, delay, at)
        items = [build_envelope(topic, EVENT, e, key=key(e) if key else None, headers=headers) for e in events]
        await self._publish(items, create=create)
        return [env.id for env, _ in items]

    async def request(
        self,
        queue: str | Queue,
        command: Any,
        *,
        timeout: float,
        response: Any = Any,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
        type: str | None = None,
    ) -> Any:
        """Send ``command`` to ``queue`` and wait for its handler's return value, decoded into ``response``.

        Raises :class:`~framework.requests.RequestTimeout` naming ``queue`` when no reply comes within
        ``timeout`` seconds, :class:`~framework.requests.RequestFailed` with the remote error when the
        request was dead-lettered, :class:`~framework.requests.ReplyDecodeError` naming the field when
        the reply is not a ``response``. See docs/request-reply.md.
        """
        if self._requester is None:
            self._requester = Requester(await self.connect(), self._publish, reply_ttl=self._reply_ttl)
        return await self._requester.request(
            queue, command, timeout=timeout, response=response, key=key, headers=headers, type=type
        )

    @property
    def reply_stats(self) -> dict[str, int]:
        """Replies received; late replies (after their request's timeout) and duplicates dropped."""
        if self._requester is None:
            return {"replies": 0, "late_replies": 0, "duplicate_replies": 0, "waiting": 0}
        return self._requester.stats()

    async def cancel_scheduled(self, message_id: str, *, destination: str | None = None) -> bool:
        """Cancel a message scheduled with ``delay``/``at``; False when it is no longer scheduled."""
        broker = await self.connect()
        return bool(await as_scheduler(broker).cancel_scheduled([message_id], destination=destination))

    async def scheduled(self, *, destination: str | None = None, limit: int = 100) -> list[Any]:
        """Messages waiting for their due time, earliest first
        (:class:`~broker.redis.scheduling.ScheduledMessage`)."""
        broker = await self.connect()
        return list(await as_scheduler(broker).scheduled_messages(destination=destination, limit=limit))

    async def publish_envelopes(self, envelopes: Iterable[Envelope]) -> list[str | None]:
        """Publish prepared envelopes as they are (the outbox relay and tools use this)."""
        return await self._publish([(e, None) for e in envelopes], create=True)

    @contextlib.asynccontextmanager
    async def batch(self) -> AsyncIterator[Batch]:
        """Collect sends and publishes; they are stored together when the block exits without error."""
        b = Batch()
        yield b
        if b.items:
            await self._publish(b.items, create=b.created)


class SyncClient:
    """Blocking producer for sync code: the same calls as :class:`Client`, run on a private event loop."""

    def __init__(
        self, url: str | None = None, *, namespace: str | None = None, max_body_bytes: int | None = None
    ) -> None:
        self._cm = anyio.from_thread.start_blocking_portal()
        self._portal = self._cm.__enter__()
        self._client = Client(url, namespace=namespace, max_body_bytes=max_body_bytes)
        try:
            self._portal.call(self._client.connect)
        except BaseException:
            self._cm.__exit__(None, None, None)
            raise

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection and stop the private event loop."""
        if self._portal is not None:
            self._portal.call(self._client.close)
            self._cm.__exit__(None, None, None)
            self._portal = None  # type: ignore[assignment]

    def send(self, queue: str | Queue, command: Any, **options: Any) -> str | None:
        """See :meth:`Client.send`."""
        return self._portal.call(lambda: self._client.send(queue, command, **options))

    def publish(self, topic: str | Topic, event: Any, **options: Any) -> str | None:
        """See :meth:`Client.publish`."""
        return self._portal.call(lambda: self._client.publish(topic, event, **options))

    def cancel_scheduled(self, message_id: str, *, destination: str | None = None) -> bool:
        """See :meth:`Client.cancel_scheduled`."""
        return self._portal.call(lambda: self._client.cancel_scheduled(message_id, destination=destination))

    def scheduled(self, *, destination: str | None = None, limit: int = 100) -> list[Any]:
        """See :meth:`Client.scheduled`."""
        return self._portal.call(lambda: self._client.scheduled(destination=destination, limit=limit))

    def request(self, queue: str | Queue, command: Any, **options: Any) -> Any:
        """See :meth:`Client.request`."""
        return self._portal.call(lambda: self._client.request(queue, command, **options))

    @property
    def reply_stats(self) -> dict[str, int]:
        """See :attr:`Client.reply_stats`."""
        return self._client.reply_stats

    def send_many(self, queue: str | Queue, commands: Iterable[Any], **options: Any) -> list[str]:
        """See :meth:`Client.send_many`."""
        items = list(commands)
        return self._portal.call(lambda: self._client.send_many(queue, items, **options))

    def publish_many(self, topic: str | Topic, events: Iterable[Any], **options: Any) -> list[str]:
        """See :meth:`Client.publish_many`."""
        items = list(events)
        return self._portal.call(lambda: self._client.publish_many(topic, items, **options))

    @contextlib.contextmanager
    def batch(self) -> Iterator[Batch]:
        """Collect sends and publishes; stored together when the block exits without error."""
        b = Batch()
        yield b
        if b.items:
            self._portal.call(functools.partial(self._client._publish, b.items, create=b.created))
