"""Faster command packing for redis-py's asyncio client.

redis-py's async connections pack commands in pure Python (about a microsecond per argument);
its sync connections use hiredis. An ack of 500 entries or a batch publish has thousands of
arguments, so the async connection classes here pack with ``hiredis.pack_command`` instead,
falling back to redis-py's packer for arguments hiredis does not take.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio.connection as aconn

try:
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # pragma: no cover - hiredis is installed with redis[hiredis]
    _hiredis_pack = None

__all__ = ["connection_class_for"]


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
