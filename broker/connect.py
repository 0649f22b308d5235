"""Choosing a transport by URL scheme and connecting to it.

``url``, else ``$BROKER_URL``, else ``$REDIS_URL``, else the shared embedded Valkey (started if
needed). Schemes: ``redis://``, ``rediss://``, ``unix://`` (Redis or Valkey, single node or
Cluster), ``amqp://`` and ``amqps://`` (RabbitMQ 3.10+, see :mod:`broker.rabbitmq`; needs the
``rabbitmq`` extra) and ``memory://[name]`` (in this process only: for users' unit tests, see
:mod:`broker.memory`). An unknown scheme is refused with the list of those there are.

A RabbitMQ broker gets the Redis inbox (:mod:`broker.redis.side_inbox`): on the Redis server the
URL's ``inbox`` parameter names (``amqp://...?inbox=redis://127.0.0.1:6379/0``), else
``$FRAMEWORK_INBOX_URL``, else ``$REDIS_URL``, else the embedded Valkey; ``inbox=none`` turns it off.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from broker.errors import BrokerUnavailable
from broker.protocol import Broker
from broker.urls import default_namespace, redact

__all__ = [
    "AMQP_SCHEMES",
    "MEMORY_SCHEMES",
    "REDIS_SCHEMES",
    "connect",
    "default_namespace",
    "is_memory_url",
    "redact",
    "resolve_url",
]

REDIS_SCHEMES = ("redis", "rediss", "unix")
MEMORY_SCHEMES = ("memory",)
AMQP_SCHEMES = ("amqp", "amqps")
_SCHEMES_HELP = (
    "redis://host:port/db, rediss://host:port/db, unix:///path/to/socket, amqp://user:password@host:port/vhost, "
    "amqps://... or memory://[name]"
)


def configured_url() -> str | None:
    """The URL the environment names: ``$BROKER_URL``, else ``$REDIS_URL``, else None."""
    return os.environ.get("BROKER_URL") or os.environ.get("REDIS_URL") or None


def scheme_of(url: str) -> str:
    """The URL's scheme, lower-cased ('' when it has none)."""
    head, sep, _ = url.partition("://")
    return head.lower() if sep else ""


def is_memory_url(url: str | None) -> bool:
    """Whether ``url`` names the in-process transport (which several processes can never share)."""
    return bool(url) and scheme_of(url or "") in MEMORY_SCHEMES


def resolve_url(url: str | None = None, data_dir: Path | str | None = None) -> str:
    """The broker URL to use: ``url``, else ``$BROKER_URL`` / ``$REDIS_URL``, else the embedded
    server's (started if needed). Raises :class:`BrokerUnavailable` for an unknown scheme."""
    url = url or configured_url()
    if url:
        if scheme_of(url) not in REDIS_SCHEMES + MEMORY_SCHEMES + AMQP_SCHEMES:
            raise BrokerUnavailable(f"invalid broker URL {redact(url)!r}: expected {_SCHEMES_HELP}")
        return url
    from broker.redis.embedded import EmbeddedServer

    return EmbeddedServer(data_dir, announce=_announce).ensure_running()


def _announce(line: str) -> None:
    """Say on stderr that this process started the shared embedded server (a detached process
    that outlives it), and where: one line, no password."""
    print(f"framework: {line}", file=sys.stderr, flush=True)


async def connect(
    url: str | None = None,
    *,
    namespace: str | None = None,
    data_dir: Path | str | None = None,
    max_connections: int | None = None,
) -> Broker:
    """Connect to the transport the URL names and check it answers; raise
    :class:`BrokerUnavailable` saying how to fix it.

    Without ``url``, ``BROKER_URL`` and ``REDIS_URL`` this uses (and if needed starts) the
    embedded Valkey in ``data_dir`` (default per user). The result keeps the :class:`Broker`
    contract; what else it offers is declared by its capabilities (:mod:`broker.capabilities`).
    """
    explicit = bool(url or configured_url())
    resolved = resolve_url(url, data_dir)
    if scheme_of(resolved) in MEMORY_SCHEMES:
        from broker.memory import connect_memory

        memory: Broker = connect_memory(resolved, namespace=namespace)
        return memory
    if scheme_of(resolved) in AMQP_SCHEMES:
        return await _connect_amqp(resolved, namespace)
    from broker.redis.connect import connect_redis

    broker: Broker = await connect_redis(
        resolved, explicit=explicit, namespace=namespace, max_connections=max_connections
    )
    return broker


async def _connect_amqp(url: str, namespace: str | None) -> Broker:
    """The RabbitMQ transport, or one line saying how to install its client when it is missing."""
    try:
        from broker.rabbitmq import connect_rabbitmq
    except ImportError as exc:
        if (exc.name or "").partition(".")[0] not in ("aio_pika", "aiormq", "pamqp"):
            raise
        raise BrokerUnavailable(
            f"{redact(url)!r} needs the RabbitMQ client (aio-pika): pip install 'framework[rabbitmq]'"
        ) from None
    inbox = _side_inbox(url, namespace)
    schedule = leases = None
    if inbox is not None:  # scheduled messages, recurring jobs and partition leases live in the inbox's Redis too
        from broker.redis.side_leases import RedisLeases
        from broker.redis.side_schedule import RedisSchedule

        schedule, leases = RedisSchedule(inbox), RedisLeases(inbox)
    broker: Broker = await connect_rabbitmq(
        url, namespace=namespace, inbox=inbox, schedule=schedule, leases=leases, counters=inbox, workers=inbox
    )
    return broker


INBOX_OFF = ("none", "off", "false", "0")
"""Values of an amqp URL's ``inbox`` parameter (or ``$FRAMEWORK_INBOX_URL``) that turn the Redis inbox off."""


def _side_inbox(url: str, namespace: str | None) -> Any:
    """The Redis inbox of a RabbitMQ broker (``broker.redis.side_inbox.RedisInbox``, connected on first
    use), or None when turned off. Its server: the URL's ``inbox`` query parameter, else
    ``$FRAMEWORK_INBOX_URL``, else ``$REDIS_URL``, else the per-user embedded Valkey (started when
    first needed), as the Redis transport would choose."""
    values = [v for k, v in parse_qsl(urlsplit(url).query, keep_blank_values=True) if k == "inbox"]
    if values:
        chosen, origin = values[-1], "the broker URL's ?inbox="
    else:
        chosen, origin = os.environ.get("FRAMEWORK_INBOX_URL", ""), "FRAMEWORK_INBOX_URL"
    if chosen.strip().lower() in INBOX_OFF:
        return None
    if chosen and scheme_of(chosen) not in REDIS_SCHEMES:
        raise BrokerUnavailable(
            f"invalid inbox URL {redact(chosen)!r} ({origin}): expected redis://host:port/db, rediss://... or "
            f"unix:///path (or 'none' to turn the Redis inbox off)"
        )
    from broker.redis.side_inbox import RedisInbox

    return RedisInbox(chosen or None, namespace=namespace or default_namespace(), origin=origin)
