"""Journals: RabbitMQ streams of JSON records that any process appends to and reads whole, without consuming.

The transport keeps two: the registry (destinations and subscriptions, kept for good) and the run
journal (redelivered runs of messages, kept a day), see :mod:`broker.rabbitmq.names`. A stream is
read from its first record; a read appends a marker record of its own (about 60 bytes) and stops
there, so it sees every record confirmed before it began, whatever other processes do meanwhile.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import aio_pika
import aio_pika.abc
import anyio
import orjson

from broker.rabbitmq.core import RabbitCore

__all__ = ["Journals"]

_MARKER = "marker"


class Journals(RabbitCore):
    """Appends records to, and reads records of, the namespace's streams."""

    _ready: set[str]

    async def _declare_journal(self, stream: str, max_age: str | None = None) -> None:
        """Declare ``stream`` (once per broker); ``max_age`` (e.g. ``1D``): records older are dropped."""
        if stream in self._ready:
            return
        arguments: dict[str, Any] = {"x-queue-type": "stream"}
        if max_age:
            arguments["x-max-age"] = max_age
        channel = await self._channel()
        await channel.declare_queue(stream, durable=True, arguments=arguments, timeout=self.timeout)
        self._ready.add(stream)

    async def _append(self, stream: str, records: Sequence[dict[str, Any]]) -> None:
        """Append ``records`` to ``stream`` (declared before), each confirmed."""
        if not records:
            return
        channel = await self._channel("publish", confirms=True)
        exchange = channel.default_exchange
        for record in records:
            message = aio_pika.Message(orjson.dumps(record), delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
            await exchange.publish(message, stream, timeout=self.timeout)

    async def _read_journal(self, stream: str) -> list[dict[str, Any]]:
        """Every record of ``stream`` (declared before) confirmed before this call, in order (markers left out)."""
        token = uuid.uuid4().hex
        await self._append(stream, [{"op": _MARKER, "token": token}])
        records: list[dict[str, Any]] = []
        done = anyio.Event()
        channel = await (await self.live()).channel()
        try:
            await channel.set_qos(prefetch_count=1000, timeout=self.timeout)
            queue = await channel.get_queue(stream, ensure=False)

            async def on_record(message: aio_pika.abc.AbstractIncomingMessage) -> None:
                if done.is_set():  # read through: no ack, which could follow the channel's close on the wire
                    return  # (the server answers an ack on a closed channel by closing the whole connection)
                await message.ack()
                record = orjson.loads(message.body)
                if record.get("op") != _MARKER:
                    records.append(record)
                elif record.get("token") == token:
                    done.set()

            tag = await queue.consume(on_record, arguments={"x-stream-offset": "first"}, timeout=self.timeout)
            with anyio.fail_after(self.timeout):
                await done.wait()
                await queue.cancel(tag, timeout=self.timeout)  # acks still on their way go out before the close
        finally:
            await channel.close()
        return records
