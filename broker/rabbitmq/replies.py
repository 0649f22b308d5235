"""Reply destinations on RabbitMQ (the ``replies`` capability): one classic queue per requester, ``x-expires``.

A requester's replies go to the durable queue ``<namespace>/reply/<name>``, declared with
``x-expires`` (its time to live): the server deletes it once it has had no consumer and no
redeclaration for that long, so a requester that dies leaves nothing behind. Each
:meth:`Replies.open_replies` redeclares it (keeping it). The requester consumes it while its
connection lives, acking what it read (a lost connection requeues the rest), so unlike the Redis
stream it does not expire while its requester's connection lives, even idle. A reply is
published mandatory to the default exchange and confirmed; one whose queue is gone is returned
by the server and dropped (not counted as stored). The cursor of :meth:`Replies.read_replies`
means nothing here (a queue hands each reply to its consumer once).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import aio_pika
import aio_pika.abc

from broker.codec import decode_flat
from broker.envelope import COMMAND, Envelope
from broker.errors import ConfigurationError, DecodeError
from broker.rabbitmq.core import RabbitCore, fields_of_message, to_message

__all__ = ["Replies"]


class _Inbox:
    """What this broker consumes from one reply queue: its channel and the replies delivered so far."""

    def __init__(self, channel: aio_pika.abc.AbstractChannel) -> None:
        self.channel = channel
        self.replies: asyncio.Queue[aio_pika.abc.AbstractIncomingMessage] = asyncio.Queue()
        self.read = 0


class Replies(RabbitCore):
    """The ``replies`` capability (:class:`broker.capabilities.ReplyStore`) on RabbitMQ."""

    _reply_inboxes: dict[str, _Inbox]

    def _reply_queue(self, name: str) -> str:
        if not name or len(name) > 200 or any(c.isspace() for c in name):
            raise ConfigurationError(f"invalid reply destination name {name!r}")
        return f"{self.namespace}/reply/{name}"

    def _inboxes(self) -> dict[str, _Inbox]:
        inboxes = getattr(self, "_reply_inboxes", None)
        if inboxes is None:
            inboxes = self._reply_inboxes = {}
        return inboxes

    async def open_replies(self, name: str, ttl_ms: int) -> None:
        """Declare (or redeclare: that keeps it) reply queue ``name``, expiring ``ttl_ms`` after its last use.

        Every call for one name must give the same ``ttl_ms`` (the server refuses other arguments)."""
        if ttl_ms <= 0:
            raise ConfigurationError(f"a reply destination's time to live must be positive, not {ttl_ms} ms")
        channel = await self._channel("replies")
        await channel.declare_queue(
            self._reply_queue(name),
            durable=True,
            arguments={"x-expires": int(ttl_ms), "x-queue-type": "classic"},
            timeout=self.timeout,
        )

    async def send_replies(self, replies: Sequence[Envelope]) -> int:
        """Publish each reply to its queue (confirmed); return how many a queue took (returned ones: gone)."""
        if not replies:
            return 0
        channel = await self._channel("publish", confirms=True)
        sends = [
            channel.default_exchange.publish(
                to_message(r), self._reply_queue(r.destination), mandatory=True, timeout=self.timeout
            )
            for r in replies
        ]
        results = await asyncio.gather(*sends, return_exceptions=True)
        stored = 0
        for result in results:
            if isinstance(result, aio_pika.exceptions.PublishError):
                continue  # returned: the requester's queue expired or was deleted
            if isinstance(result, BaseException):
                raise result
            stored += 1
        return stored

    async def read_replies(
        self, name: str, cursor: str, *, block_ms: int = 0, count: int = 100
    ) -> tuple[str, list[Envelope]]:
        """Replies delivered to this broker's consumer of queue ``name``, waiting up to ``block_ms`` for one."""
        inbox = await self._consuming(name)
        if inbox is None:
            return cursor, []
        got: list[aio_pika.abc.AbstractIncomingMessage] = []
        if inbox.replies.empty() and block_ms > 0:
            try:
                got.append(await asyncio.wait_for(inbox.replies.get(), block_ms / 1000))
            except TimeoutError:
                return cursor, []
        while len(got) < count and not inbox.replies.empty():
            got.append(inbox.replies.get_nowait())
        if not got:
            return cursor, []
        envelopes = []
        for message in got:
            with contextlib.suppress(DecodeError):  # a malformed reply is skipped, never the reader's end
                envelopes.append(decode_flat(fields_of_message(message), name, COMMAND))
        # acked once read: a connection lost before this requeues them for the next consumer
        await got[-1].ack(multiple=True)
        inbox.read += len(got)
        return str(inbox.read), envelopes

    async def _consuming(self, name: str) -> _Inbox | None:
        """This broker's consumer of reply queue ``name`` (started when missing or its channel closed);
        None when the queue does not exist."""
        inboxes = self._inboxes()
        inbox = inboxes.get(name)
        if inbox is not None and not inbox.channel.is_closed:
            return inbox
        connection = await self.live()
        channel = await connection.channel()
        try:
            queue = await channel.declare_queue(self._reply_queue(name), passive=True, timeout=self.timeout)
        except aio_pika.exceptions.ChannelNotFoundEntity:
            return None
        inbox = inboxes[name] = _Inbox(channel)

        async def deliver(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            inbox.replies.put_nowait(message)

        await channel.set_qos(prefetch_count=1000)
        await queue.consume(deliver, timeout=self.timeout)
        return inbox

    async def replies_exist(self, name: str) -> bool:
        """Whether reply queue ``name`` exists (a passive declare on a channel of its own)."""
        channel = await (await self.live()).channel()
        try:
            await channel.declare_queue(self._reply_queue(name), passive=True, timeout=self.timeout)
        except aio_pika.exceptions.ChannelNotFoundEntity:
            return False
        finally:
            if not channel.is_closed:
                await channel.close()
        return True

    async def close_replies(self, name: str) -> None:
        """Stop consuming reply queue ``name`` and delete it."""
        inbox = self._inboxes().pop(name, None)
        if inbox is not None and not inbox.channel.is_closed:
            await inbox.channel.close()
        channel = await self._channel("replies")
        await channel.queue_delete(self._reply_queue(name), timeout=self.timeout)
