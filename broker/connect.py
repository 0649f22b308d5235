"""Choosing a transport by URL scheme and connecting to it.

``url``, else ``$BROKER_URL``, else ``$REDIS_URL``, else the shared embedded Valkey (started if
needed). Schemes: ``redis://``, ``rediss://``, ``unix://`` (Redis or Valkey, single node or
Cluster), ``amqp://`` and ``amqps://`` (RabbitMQ 3.10+, see :mod:`broker.rabbitmq`; needs the
``rabbitmq`` extra) and ``memory://[name]`` (in this process only: for users' unit tests, see
:mod:`broker.memory`). An unknown scheme is refused with the list of those there are.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

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
    broker: Broker = await connect_rabbitmq(url, namespace=namespace)
    return broker
