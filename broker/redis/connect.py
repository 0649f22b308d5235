"""Connecting to a Redis or Valkey server (single node or Cluster): the Redis part of :func:`broker.connect`."""

from __future__ import annotations

import functools
from typing import Any

import redis.asyncio as aredis
import redis.asyncio.connection as aconn
from redis.exceptions import AuthenticationError, NoPermissionError, RedisError

from broker.errors import BrokerUnavailable, PermissionDenied
from broker.redis.broker import RedisBroker
from broker.redis.scripts import functions_usable
from broker.redis.wire import client_options, command_timeout_from_env
from broker.urls import default_namespace, redact

__all__ = ["RedisPermissionDenied", "connect_redis"]


class RedisPermissionDenied(PermissionDenied, NoPermissionError):
    """:class:`PermissionDenied` raised by redis-py's parser: also its ``NoPermissionError``."""


_SCRIPT_ACL = ("The user executing the script can't", "ACL failure in script")  # Redis 7, Valkey


class _ScriptErrors(dict[str, Any]):
    """ERR replies by message; a script's ACL refusal becomes a :class:`PermissionDenied`."""

    permission: Any = None

    def get(self, key: Any, default: Any = None) -> Any:
        if isinstance(key, str) and key.startswith(_SCRIPT_ACL):
            return self.permission
        return super().get(key, default)


@functools.cache
def _permission_parser(namespace: str) -> type:
    """The default reply parser, raising :class:`PermissionDenied` (one line naming the command and
    ``~namespace:*``) for ACL refusals instead of redis' bare ``NoPermissionError``."""
    base: Any = aconn.DefaultParser
    factory = functools.partial(RedisPermissionDenied, namespace=namespace)
    classes = dict(base.EXCEPTION_CLASSES)
    classes["NOPERM"] = factory
    script_errors = _ScriptErrors(classes.get("ERR", {}))
    script_errors.permission = factory
    classes["ERR"] = script_errors
    return type("PermissionAwareParser", (base,), {"EXCEPTION_CLASSES": classes})


async def connect_redis(
    resolved: str,
    *,
    explicit: bool,
    namespace: str | None = None,
    max_connections: int | None = None,
) -> RedisBroker:
    """Connect to the Redis server at ``resolved`` and check it answers; raise
    :class:`BrokerUnavailable` saying how to fix it (``explicit``: the URL was given, not the
    embedded server's). A Redis Cluster is detected and used as one. ACL refusals raise
    :class:`PermissionDenied`, here and on every later command.
    """
    # Every wait is bounded (connect 5 s, commands $FRAMEWORK_COMMAND_TIMEOUT): see client_options.
    command_timeout = command_timeout_from_env()
    kwargs: dict[str, Any] = {"protocol": 2, **client_options(resolved, command_timeout)}
    if max_connections:
        kwargs["max_connections"] = max_connections
    kwargs["parser_class"] = _permission_parser(namespace or default_namespace())
    client = aredis.Redis.from_url(resolved, **kwargs)
    try:
        await client.ping()
        try:
            info = await client.info("cluster")
        except NoPermissionError:  # INFO is not needed otherwise: an ACL user without it is standalone
            info = {}
    except PermissionDenied:
        await client.aclose()
        raise
    except AuthenticationError as exc:
        await client.aclose()
        reason = str(exc).rstrip(".")
        hint = (
            "Check the user name and password in REDIS_URL."
            if explicit
            else "The embedded Valkey's password file does not match the running server: "
            "restart it (`framework server stop`, then `framework server start`)."
        )
        raise BrokerUnavailable(f"the broker at {redact(resolved)} refused the credentials: {reason}. {hint}") from exc
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
        from broker.redis.cluster_client import BrokerCluster

        cluster = BrokerCluster.from_url(
            resolved, protocol=2, **client_options(resolved, command_timeout, cluster=True)
        )
        await cluster.initialize()
        return RedisBroker(cluster, namespace=ns, url=resolved, cluster=True, command_timeout=command_timeout)
    # (a Cluster keeps EVALSHA: redis-py finds an FCALL's keys by asking the server, a round trip a call)
    functions = await functions_usable(client)
    return RedisBroker(client, namespace=ns, url=resolved, command_timeout=command_timeout, functions=functions)
