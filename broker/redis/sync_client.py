"""Blocking redis-py clients for tools that run outside the event loop (Spark tasks, test helpers).

:func:`sync_client` opens a plain ``redis.Redis`` on a single server and a ``redis.RedisCluster``
when the server at the URL is a node of a Redis Cluster, so callers work on either with one code
path: commands on one key (or keys sharing a hash tag) go to the node owning that key's slot, and
``scan_iter`` walks every primary. :func:`is_cluster` asks a server which it is.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.exceptions import NoPermissionError, ResponseError

__all__ = ["is_cluster", "sync_client"]


def is_cluster(url: str, **options: Any) -> bool:
    """Whether the server at ``url`` runs with ``cluster-enabled yes`` (one INFO call).

    A server that cannot be reached reads as standalone: the caller's first command on the client
    :func:`sync_client` returns then fails with the connection error, where callers explain it.
    """
    client = redis.Redis.from_url(url, **options)
    try:
        try:
            info = client.info("cluster")
        except (NoPermissionError, ResponseError):  # an ACL user without INFO: treated as standalone
            return False
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            return False
        return info.get("cluster_enabled") in (1, "1")
    finally:
        client.close()


def sync_client(url: str, *, cluster: bool | None = None, **options: Any) -> redis.Redis | redis.RedisCluster:
    """A blocking client for ``url``: a cluster client when the server is a Cluster node.

    ``cluster`` skips the check when the caller already knows (e.g. a Spark task whose driver
    checked). ``options`` go to ``from_url`` of either class.
    """
    if cluster is None:
        cluster = is_cluster(url, **options)
    if cluster:
        return redis.RedisCluster.from_url(url, **options)
    return redis.Redis.from_url(url, **options)
