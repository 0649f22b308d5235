"""Connecting to the broker: ``REDIS_URL`` when set, else the shared embedded Valkey."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aredis
from redis.exceptions import RedisError

from broker.embedded import EmbeddedServer
from broker.errors import BrokerUnavailable
from broker.redis_broker import RedisBroker
from broker.wire import connection_class_for

__all__ = ["connect", "default_namespace", "redact", "resolve_url"]


def default_namespace() -> str:
    """``$FRAMEWORK_NAMESPACE`` or ``fw``."""
    return os.environ.get("FRAMEWORK_NAMESPACE") or "fw"


def redact(url: str) -> str:
    """The URL with any password replaced by ``***`` (for messages and logs)."""
    parts = urlsplit(url)
    if parts.password:
        netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))
    return url


def resolve_url(url: str | None = None, data_dir: Path | str | None = None) -> str:
    """The broker URL to use: ``url``, else ``$REDIS_URL``, else the embedded server (started if needed)."""
    url = url or os.environ.get("REDIS_URL") or None
    if url:
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise BrokerUnavailable(
                f"invalid broker URL {redact(url)!r}: expected redis://host:port/db, rediss://... or unix://path"
            )
        return url
    return EmbeddedServer(data_dir).ensure_running()


async def connect(
    url: str | None = None,
    *,
    namespace: str | None = None,
    data_dir: Path | str | None = None,
    max_connections: int | None = None,
) -> RedisBroker:
    """Connect and check the server answers; raise :class:`BrokerUnavailable` saying how to fix it.

    Without ``url`` and ``REDIS_URL`` this uses (and if needed starts) the embedded Valkey in
    ``data_dir`` (default ``./.framework/valkey``). A Redis Cluster is detected and used as one.
    """
    explicit = bool(url or os.environ.get("REDIS_URL"))
    resolved = resolve_url(url, data_dir)
    kwargs: dict[str, Any] = {
        "protocol": 2,
        "socket_connect_timeout": 5,
        "socket_keepalive": True,
        "connection_class": connection_class_for(resolved),
    }
    if max_connections:
        kwargs["max_connections"] = max_connections
    client = aredis.Redis.from_url(resolved, **kwargs)
    try:
        await client.ping()
        info = await client.info("cluster")
    except (RedisError, OSError) as exc:
        await client.aclose()
        hint = (
            "Check the server is running and REDIS_URL is right (for a local one: "
            "`redis-server --port 6379`), or unset REDIS_URL to use the embedded Valkey "
            "(`framework server start`)."
            if explicit
            else "The embedded Valkey did not answer: see `framework server status` and its valkey.log."
        )
        reason = str(exc).rstrip(".")
        raise BrokerUnavailable(f"cannot reach the broker at {redact(resolved)}: {reason}. {hint}") from exc
    ns = namespace or default_namespace()
    if info.get("cluster_enabled") in (1, "1"):
        await client.aclose()
        from redis.asyncio.cluster import RedisCluster

        cluster = RedisCluster.from_url(resolved, protocol=2)
        await cluster.initialize()
        return RedisBroker(cluster, namespace=ns, url=resolved, cluster=True)
    return RedisBroker(client, namespace=ns, url=resolved)
