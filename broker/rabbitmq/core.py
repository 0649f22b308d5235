"""State every role of the RabbitMQ broker shares: the connection, its channels, the layout, and the message codec.

An envelope travels as one AMQP message: ``body`` is the envelope's body, ``message_id`` its id,
``type`` its type; the rest rides in headers (``fw-ts``, ``fw-key``, ``fw-headers`` as JSON,
``fw-attempt`` when not 1). Fields a retry or a dead letter adds (``first-failed-at``,
``dlq-*``) are headers under their own names. A delivery's ``raw`` is the same field/value list
the Redis transport stores (:func:`broker.codec.encode_fields`), so dead letters read alike.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Mapping
from typing import Any

import aio_pika
import aio_pika.abc
import orjson

from broker.codec import decode_flat
from broker.codec import max_body_bytes as max_body_bytes_setting
from broker.envelope import Envelope
from broker.errors import ConfigurationError, DecodeError
from broker.protocol import Delivery, GroupPartition
from broker.rabbitmq.connection import open_connection
from broker.rabbitmq.names import Layout
from broker.topology import DestinationSpec

__all__ = ["RabbitCore", "RabbitKeys", "fields_of_message", "is_closed_error", "message_of_fields", "to_message"]

_NS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_CORE_HEADERS = {b"ts": "fw-ts", b"key": "fw-key", b"headers": "fw-headers", b"attempt": "fw-attempt"}
_FIELD_OF_HEADER = {v: k for k, v in _CORE_HEADERS.items()}


class RabbitKeys:
    """``GroupPartition.keys`` of the RabbitMQ transport: the queue a group reads and its DLQ."""

    __slots__ = ("dlq", "queue")

    def __init__(self, queue: str, dlq: str) -> None:
        self.queue = queue
        self.dlq = dlq

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RabbitKeys) and (self.queue, self.dlq) == (other.queue, other.dlq)

    def __hash__(self) -> int:
        return hash((self.queue, self.dlq))

    def __repr__(self) -> str:
        return f"RabbitKeys({self.queue!r})"


def _text(value: Any) -> bytes:
    """A header value as stored in a field (bytes as they are, everything else as text)."""
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    return str(value).encode()


def to_message(env: Envelope, extra: Mapping[str, Any] | None = None) -> aio_pika.Message:
    """The persistent AMQP message carrying ``env`` (``extra``: more headers, e.g. a retry's)."""
    headers: dict[str, Any] = {"fw-ts": env.published_at}
    if env.key is not None:
        headers["fw-key"] = env.key
    if env.headers:
        headers["fw-headers"] = orjson.dumps(env.headers).decode()
    if env.attempt != 1:
        headers["fw-attempt"] = env.attempt
    if extra:
        headers.update(extra)
    return aio_pika.Message(
        env.body,
        message_id=env.id,
        type=env.type,
        headers=headers,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
    )


def fields_of_message(message: aio_pika.abc.AbstractIncomingMessage) -> list[bytes]:
    """The field/value list of a delivered message, as the Redis transport stores an entry.

    A message our producers wrote gives the envelope's fields first (``id``, ``type``, ``body``,
    ``ts``, then ``key``, ``headers``, ``attempt``), then its other headers (``dlq-*``, ...). A
    foreign one (no ``message_id`` or ``fw-ts``) gives its headers and a non-empty body as they are.
    """
    headers = dict(message.headers or {})
    flat: list[bytes] = []
    if message.message_id is not None and "fw-ts" in headers:
        flat += (b"id", message.message_id.encode(), b"type", (message.type or "").encode())
        flat += (b"body", message.body, b"ts", _text(headers["fw-ts"]))
        for name in (b"key", b"headers", b"attempt"):
            if _CORE_HEADERS[name] in headers:
                flat += (name, _text(headers[_CORE_HEADERS[name]]))
    elif message.body:
        flat += (b"body", message.body)
    for header, value in headers.items():
        if not header.startswith(("fw-", "x-")):  # ours (read above) and the server's (x-death, ...)
            flat += (header.encode(), _text(value))
    return flat


def message_of_fields(
    fields: Iterable[tuple[bytes, bytes]], *, drop: Iterable[bytes] = (), extra: Mapping[str, Any] | None = None
) -> aio_pika.Message:
    """The AMQP message of a field/value list (the inverse of :func:`fields_of_message`), without the
    fields in ``drop`` and with ``extra`` headers set (a retry's attempt, a dead letter's reason)."""
    dropped = set(drop)
    body = b""
    message_id: str | None = None
    type_name: str | None = None
    headers: dict[str, Any] = {}
    for name, value in fields:
        if name in dropped:
            continue
        if name == b"body":
            body = value
        elif name == b"id":
            message_id = value.decode(errors="replace")
        elif name == b"type":
            type_name = value.decode(errors="replace")
        elif name in _CORE_HEADERS:
            headers[_CORE_HEADERS[name]] = value.decode(errors="replace")
        else:
            try:
                headers[name.decode()] = value.decode()
            except UnicodeDecodeError:  # kept as an AMQP byte array
                headers[name.decode(errors="replace")] = bytearray(value)
    if extra:
        headers.update(extra)
    return aio_pika.Message(
        body,
        message_id=message_id,
        type=type_name,
        headers=headers,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
    )


class RabbitCore:
    """The shared state of one RabbitMQ broker; every role mixin builds on it."""

    transport = "rabbitmq"

    def __init__(
        self,
        connection: aio_pika.abc.AbstractConnection,
        *,
        url: str,
        client_url: str = "",
        namespace: str = "fw",
        prefetch: int = 1000,
        delivery_limit: int = 50,
        timeout: float = 10.0,
        max_body_bytes: int | None = None,
    ) -> None:
        """``prefetch``: unacknowledged messages each consumed queue may hold here; ``delivery_limit``:
        the quorum queues' ``x-delivery-limit`` (the crash-loop safety net); ``timeout``: every call's bound."""
        if not _NS.match(namespace):
            raise ConfigurationError(f"invalid namespace {namespace!r}: use letters, digits, '.', '_' or '-'")
        self.connection = connection
        self.url = url
        self._client_url = client_url or url
        self._reconnecting = asyncio.Lock()
        self.layout = Layout(namespace)
        self.prefetch = prefetch
        self.delivery_limit = delivery_limit
        self.timeout = timeout
        self.max_body_bytes = max_body_bytes_setting(max_body_bytes)
        self._namespace = namespace
        self._specs: dict[str, DestinationSpec] = {}
        self._channels: dict[str, aio_pika.abc.AbstractChannel] = {}
        self.server_version = _server_version(connection)
        self.closed = False

    @property
    def namespace(self) -> str:
        """Separates deployments (and test runs) on one server: the prefix of every name."""
        return self._namespace

    async def _channel(self, role: str = "admin", *, confirms: bool = False) -> aio_pika.abc.AbstractChannel:
        """This broker's channel for ``role`` (``publish``: confirms, returns raised), reopened when
        the server closed it (a failed declaration closes its channel)."""
        channel = self._channels.get(role)
        if channel is None or channel.is_closed:
            connection = await self.live()
            channel = await connection.channel(publisher_confirms=confirms, on_return_raises=confirms)
            self._channels[role] = channel
        return channel

    async def live(self) -> aio_pika.abc.AbstractConnection:
        """The connection, opened again when it was lost (the server requeued what it held; the
        consumers restart on their next read). ``BrokerUnavailable`` while the server is away."""
        if _lost(self.connection) and not self.closed:
            async with self._reconnecting:
                if _lost(self.connection):
                    self.connection = await open_connection(self.url, self._client_url, self.timeout)
                    self._channels.clear()
        return self.connection

    async def close(self) -> None:
        """Close the connection: messages delivered here and not acknowledged go back to their queues."""
        self.closed = True
        self._channels.clear()
        if not self.connection.is_closed:
            await self.connection.close()

    def _delivery(self, source: GroupPartition, message: aio_pika.abc.AbstractIncomingMessage, entry: str) -> Delivery:
        """The delivery of one message read from ``source``'s queue (decoded as the Redis broker decodes)."""
        raw = fields_of_message(message)
        count = 1 + int(str((message.headers or {}).get("x-delivery-count", 0) or 0))
        try:
            env = decode_flat(raw, source.spec.name, source.spec.kind, self.max_body_bytes)
        except DecodeError as exc:
            return Delivery(source, source.keys.queue, entry, raw, None, str(exc), count)
        return Delivery(source, source.keys.queue, entry, raw, env, None, count)


def _lost(connection: aio_pika.abc.AbstractConnection) -> bool:
    """Whether ``connection`` (or the AMQP connection under it) is closed."""
    if connection.is_closed:
        return True
    transport = getattr(connection, "transport", None)
    return transport is None or bool(transport.connection.is_closed)


def is_closed_error(exc: BaseException) -> bool:
    """aiormq's ``RuntimeError('<Connection ...> closed')``: a call on a connection already lost."""
    return isinstance(exc, RuntimeError) and str(exc).endswith(" closed")


def _server_version(connection: aio_pika.abc.AbstractConnection) -> str:
    """The server's version from its connection properties ('' when it did not say)."""
    try:
        props = connection.transport.connection.server_properties  # type: ignore[union-attr]
    except AttributeError:
        return ""
    version = props.get("version", b"") if props else b""
    return version.decode() if isinstance(version, bytes) else str(version or "")
