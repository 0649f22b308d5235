"""Connections for the broker: faster command packing, bounded reads, one kind of connection error.

redis-py's async connections pack commands in pure Python (about a microsecond per argument);
its sync connections use hiredis. An ack of 500 entries or a batch publish has thousands of
arguments, so the async connection classes here pack with ``hiredis.pack_command`` instead,
falling back to redis-py's packer for arguments hiredis does not take.

Every call on a :class:`Channel` is bounded in time; a call that runs out of time drops its
connection (never reused with a half-read reply) and raises redis's ``TimeoutError``. A connection
closed under uvloop raises ``RuntimeError("unable to perform operation on <TCPTransport
closed=True>...")`` rather than an ``OSError``; the classes here turn it into redis's
``ConnectionError``, so callers see one kind of error for a lost connection.
"""

from __future__ import annotations

import asyncio
import math
import os
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import redis.asyncio.connection as aconn
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from broker.errors import ConfigurationError, register_transport_errors

_hiredis_pack: Callable[[tuple[Any, ...]], bytes] | None
try:
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # pragma: no cover - hiredis is installed with redis[hiredis]
    _hiredis_pack = None

__all__ = [
    "DEFAULT_COMMAND_TIMEOUT",
    "Channel",
    "client_options",
    "command_timeout_from_env",
    "connection_class_for",
    "is_closed_transport",
]

DEFAULT_COMMAND_TIMEOUT = 10.0  # seconds a command may wait for its reply (blocking reads: plus their BLOCK)
_CONNECT_TIMEOUT = 5.0  # seconds to open a connection (TCP, TLS, AUTH)
_HEALTH_CHECK_INTERVAL = 15  # seconds idle after which a pooled connection is PINGed before use
# An idle connection whose peer vanished without a word is found dead after about
# KEEPIDLE + KEEPINTVL * KEEPCNT = 25 s (reads in progress are bounded by their own timeouts).
_KEEPALIVE = (("TCP_KEEPIDLE", 10), ("TCP_KEEPALIVE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3))


def command_timeout_from_env() -> float:
    """``$FRAMEWORK_COMMAND_TIMEOUT`` in seconds, else :data:`DEFAULT_COMMAND_TIMEOUT`."""
    raw = os.environ.get("FRAMEWORK_COMMAND_TIMEOUT", "").strip()
    if not raw:
        return DEFAULT_COMMAND_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ConfigurationError(f"FRAMEWORK_COMMAND_TIMEOUT={raw!r} is not a positive number of seconds (e.g. 10)")
    return value


def client_options(url: str, command_timeout: float, *, cluster: bool = False) -> dict[str, Any]:
    """redis-py client options bounding every network wait (see docs: operations, network).

    Connecting takes at most 5 s and any command ``command_timeout`` (the framework sends no
    blocking command through the client longer than that: see ``RedisBroker.read``); a command
    that fails on a lost or timed-out connection is retried once on a fresh one, so a call
    through the client waits at most about twice ``command_timeout``. TCP keepalive finds dead
    idle connections; pooled connections idle for 15 s are checked with a PING before use.
    """
    options: dict[str, Any] = {
        "socket_connect_timeout": _CONNECT_TIMEOUT,
        "socket_timeout": command_timeout,
        "health_check_interval": _HEALTH_CHECK_INTERVAL,
    }
    if not url.startswith("unix://"):
        keepalive = {getattr(socket, name): value for name, value in _KEEPALIVE if hasattr(socket, name)}
        options.update(socket_keepalive=True, socket_keepalive_options=keepalive)
    if not cluster:
        from redis.asyncio.retry import Retry
        from redis.backoff import ExponentialWithJitterBackoff

        options.update(
            connection_class=connection_class_for(url),
            retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), retries=1),
        )
    return options


def is_closed_transport(exc: BaseException) -> bool:
    """Whether ``exc`` is uvloop's (or asyncio's) complaint about writing to a closed transport."""
    return isinstance(exc, RuntimeError) and "closed=True" in str(exc)


register_transport_errors(
    connection=(RedisConnectionError, RedisTimeoutError), closed=is_closed_transport, any_error=(RedisError,)
)


def _lost(exc: BaseException) -> RedisConnectionError:
    return RedisConnectionError(f"connection to the broker lost: {exc}")


if TYPE_CHECKING:
    _ConnectionBase = aconn.AbstractConnection  # what the mixin is mixed into (typed as such)
else:
    _ConnectionBase = object


class _FastConnection(_ConnectionBase):
    """Mixin: hiredis packing, and a closed transport reported as ``ConnectionError``."""

    def pack_command(self, *args: Any) -> list[bytes]:
        if _hiredis_pack is not None:
            first = args[0]
            if (isinstance(first, str) and " " in first) or (isinstance(first, bytes) and b" " in first):
                args = (*first.split(), *args[1:])
            try:
                return [_hiredis_pack(args)]
            except TypeError:
                pass
        return super().pack_command(*args)

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        try:
            await super().send_packed_command(command, check_health)
        except RuntimeError as exc:
            if not is_closed_transport(exc):
                raise
            await self.disconnect(nowait=True)
            raise _lost(exc) from exc

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)
        except RuntimeError as exc:
            if not is_closed_transport(exc):
                raise
            await self.disconnect(nowait=True)
            raise _lost(exc) from exc

    async def send_unbounded(self, packed: list[bytes]) -> None:
        """Write packed commands with no timeout of their own (a :class:`Channel` bounds the call).

        redis-py's ``send_packed_command`` wraps each write in ``asyncio.wait_for`` when the
        connection has a socket timeout, which starts a task per call.
        """
        if self.is_connected and cast("asyncio.StreamWriter", self._writer).is_closing():
            # Reset or closed while idle: nothing was sent on it yet, so open a fresh one rather
            # than fail a call that never reached the server.
            await self.disconnect(nowait=True)
        if not self.is_connected:
            await self.connect_check_health(check_health=False)
        try:
            writer = cast("asyncio.StreamWriter", self._writer)  # connected: set
            writer.writelines(packed)
            await writer.drain()
        except OSError as exc:
            await self.disconnect(nowait=True)
            raise RedisConnectionError(f"error while writing to the broker: {exc}") from exc


class FastConnection(_FastConnection, aconn.Connection):
    """TCP connection packing with hiredis."""


class FastSSLConnection(_FastConnection, aconn.SSLConnection):
    """TLS connection packing with hiredis."""


class FastUnixConnection(_FastConnection, aconn.UnixDomainSocketConnection):
    """Unix-socket connection packing with hiredis."""


def connection_class_for(url: str) -> type[aconn.AbstractConnection]:
    """The fast connection class matching a redis:// , rediss:// or unix:// URL."""
    if url.startswith("rediss://"):
        return FastSSLConnection
    if url.startswith("unix://"):
        return FastUnixConnection
    return FastConnection


class Channel:
    """A connection of one task's own, for its hot path (fetch, inbox check, ack).

    redis-py's client adds about 60 µs per command (pool, retry and timeout layers) on top of the
    round trip; a fetcher pays it twice per message at low rates. A channel holds one pooled
    connection and sends packed commands straight to it. Each call is bounded: ``timeout``
    seconds if given (a blocking read passes its BLOCK time plus a margin), else
    ``command_timeout``; connecting counts against the same bound. On a timeout it raises redis's
    ``TimeoutError``, on a lost connection redis's ``ConnectionError``. On any error the
    connection is dropped and the next call opens a fresh one, so a failed call never leaves a
    half-read reply behind. One channel serves one task at a time.
    """

    def __init__(self, pool: Any, *, command_timeout: float = DEFAULT_COMMAND_TIMEOUT) -> None:
        self._pool = pool
        self._conn: Any = None
        self.command_timeout = command_timeout

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                await conn.disconnect(nowait=True)
            finally:
                await self._pool.release(conn)

    async def execute(self, *args: Any, timeout: float | None = None) -> Any:
        """Send one command and return its reply (an error reply raises ``ResponseError``)."""
        reply = (await self.execute_many([args], timeout=timeout))[0]
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def execute_many(
        self, commands: list[tuple[Any, ...]] | list[list[Any]], *, timeout: float | None = None
    ) -> list[Any]:
        """Send commands in one write; return their replies in order (error replies as exceptions).

        The whole call (connecting, writing, reading every reply) takes at most ``timeout``
        seconds (default: ``command_timeout``).
        """
        bound = self.command_timeout if timeout is None else timeout
        try:
            async with asyncio.timeout(bound):
                return await self._round_trip(commands)
        except TimeoutError as exc:  # asyncio's: ours expired (redis-py's own are RedisTimeoutError)
            await self._drop()
            raise RedisTimeoutError(
                f"no reply from the broker within {bound:g} s; the connection was dropped and will be reopened"
            ) from exc
        except RuntimeError as exc:
            await self._drop()
            if is_closed_transport(exc):
                raise _lost(exc) from exc
            raise
        except BaseException:
            await self._drop()
            raise

    async def _round_trip(self, commands: list[tuple[Any, ...]] | list[list[Any]]) -> list[Any]:
        conn = self._conn
        if conn is None:
            conn = self._conn = await self._pool.get_connection()
        packed: list[bytes] = []
        for command in commands:
            packed += conn.pack_command(*command)
        send = getattr(conn, "send_unbounded", None)
        if send is not None:
            await send(packed)
        else:
            await conn.send_packed_command(packed, check_health=False)
        replies: list[Any] = []
        read = conn.read_response
        for _ in commands:
            try:
                # No timeout of redis-py's own: the call's bound covers every read (and an
                # explicit per-read timeout would make redis-py return None on expiry).
                replies.append(await read(timeout=_FOREVER))
            except ResponseError as exc:
                replies.append(exc)
        return replies

    async def aclose(self) -> None:
        """Give the connection back to the pool."""
        conn, self._conn = self._conn, None
        if conn is not None:
            await self._pool.release(conn)


_FOREVER = float("inf")
