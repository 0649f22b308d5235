"""Faster command packing for redis-py's asyncio client.

redis-py's async connections pack commands in pure Python (about a microsecond per argument);
its sync connections use hiredis. An ack of 500 entries or a batch publish has thousands of
arguments, so the async connection classes here pack with ``hiredis.pack_command`` instead,
falling back to redis-py's packer for arguments hiredis does not take.
"""

from __future__ import annotations

import math
from typing import Any

import redis.asyncio.connection as aconn

try:
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # pragma: no cover - hiredis is installed with redis[hiredis]
    _hiredis_pack = None

__all__ = ["Channel", "connection_class_for"]


class _HiredisPacking:
    def pack_command(self, *args: Any) -> list[bytes]:
        if _hiredis_pack is not None:
            first = args[0]
            if (isinstance(first, str) and " " in first) or (isinstance(first, bytes) and b" " in first):
                args = (*first.split(), *args[1:])
            try:
                return [_hiredis_pack(args)]
            except TypeError:
                pass
        return super().pack_command(*args)  # type: ignore[misc, no-any-return]


class FastConnection(_HiredisPacking, aconn.Connection):
    """TCP connection packing with hiredis."""


class FastSSLConnection(_HiredisPacking, aconn.SSLConnection):
    """TLS connection packing with hiredis."""


class FastUnixConnection(_HiredisPacking, aconn.UnixDomainSocketConnection):
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
    connection and sends packed commands straight to it. On any error the connection is dropped
    and the next call opens a fresh one, so a failed call never leaves a half-read reply behind.
    One channel serves one task at a time.
    """

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self._conn: Any = None

    async def _connection(self) -> Any:
        if self._conn is None:
            self._conn = await self._pool.get_connection()
        return self._conn

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.disconnect(nowait=True)
            await self._pool.release(conn)

    async def execute(self, *args: Any) -> Any:
        """Send one command and return its reply (an error reply raises ``ResponseError``)."""
        reply = (await self.execute_many([args]))[0]
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def execute_many(self, commands: list[tuple[Any, ...]] | list[list[Any]]) -> list[Any]:
        """Send commands in one write; return their replies in order (error replies as exceptions)."""
        from redis.exceptions import ResponseError

        conn = await self._connection()
        try:
            packed: list[bytes] = []
            for command in commands:
                packed += conn.pack_command(*command)
            await conn.send_packed_command(packed, check_health=False)
            replies: list[Any] = []
            for _ in commands:
                try:
                    replies.append(await conn.read_response(timeout=math.inf))
                except ResponseError as exc:
                    replies.append(exc)
        except BaseException:
            await self._drop()
            raise
        return replies

    async def aclose(self) -> None:
        """Give the connection back to the pool."""
        conn, self._conn = self._conn, None
        if conn is not None:
            await self._pool.release(conn)
