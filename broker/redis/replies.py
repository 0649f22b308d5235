"""Reply destinations on Redis (the ``replies`` capability): one stream per requester, with an expiry.

A requester's replies go to the stream ``<namespace>:reply:{<name>}``, created empty by
``reply_open.lua`` with a PEXPIRE that the requester pushes back while it lives; a reply is
stored by ``reply_send.lua`` only while that stream exists, so a requester that dies leaves
nothing behind once its expiry passes. The requester reads with XREAD from its own cursor (no
group: one reader) and deletes what it read with its next read, so a reconnect within the expiry loses no reply.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from broker.codec import decode_fields, encode_fields, fields_of
from broker.envelope import COMMAND, Envelope
from broker.errors import ConfigurationError
from broker.redis.core import RedisCore, text

__all__ = ["Replies", "reply_key"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,199}$")


def reply_key(namespace: str, name: str) -> str:
    """The stream holding reply destination ``name``'s replies; ``ConfigurationError`` for a bad name."""
    if not _NAME.match(name):
        raise ConfigurationError(f"invalid reply destination name {name!r}: use letters, digits, '.', '_', ':' or '-'")
    return f"{namespace}:reply:{{{name}}}"


class Replies(RedisCore):
    """The ``replies`` capability (:class:`broker.capabilities.ReplyStore`) on Redis Streams."""

    async def open_replies(self, name: str, ttl_ms: int) -> None:
        """Create reply destination ``name`` (empty) if needed; it expires ``ttl_ms`` from now."""
        if ttl_ms <= 0:
            raise ConfigurationError(f"a reply destination's time to live must be positive, not {ttl_ms} ms")
        await self._run_pipeline([("reply_open", [reply_key(self.namespace, name)], [int(ttl_ms)])])

    async def send_replies(self, replies: Sequence[Envelope]) -> int:
        """Store each reply on its destination if it still exists; return how many were stored."""
        if not replies:
            return 0
        calls = [("reply_send", [reply_key(self.namespace, r.destination)], encode_fields(r)) for r in replies]
        return sum(int(stored) for stored in await self._run_pipeline(calls))

    async def read_replies(
        self, name: str, cursor: str, *, block_ms: int = 0, count: int = 100
    ) -> tuple[str, list[Envelope]]:
        """Replies stored after ``cursor``, waiting up to ``block_ms`` (capped at half the command
        timeout), and the next cursor; what an earlier call returned (up to ``cursor``) is deleted."""
        key = reply_key(self.namespace, name)
        args: list[Any] = ["XREAD", "COUNT", count]
        if block_ms > 0:
            args += ["BLOCK", min(block_ms, int(self.command_timeout * 500))]
        pipe = self.redis.pipeline(transaction=False)
        if cursor and cursor != "0":  # what the last call returned was read: drop it (in the same round trip)
            pipe.execute_command("XTRIM", key, "MINID", _next_id(cursor))
        pipe.execute_command(*args, "STREAMS", key, cursor or "0")
        entries = _entries((await pipe.execute())[-1])
        if not entries:
            return cursor, []
        envelopes = []
        for _, fields in entries:
            try:
                env = decode_fields(fields, name, COMMAND)
            except Exception:
                continue
            envelopes.append(env)
        return entries[-1][0], envelopes

    async def replies_exist(self, name: str) -> bool:
        """Whether reply destination ``name`` exists."""
        return bool(await self.redis.exists(reply_key(self.namespace, name)))

    async def close_replies(self, name: str) -> None:
        """Delete reply destination ``name`` now."""
        await self.redis.delete(reply_key(self.namespace, name))


def _entries(reply: Any) -> list[tuple[str, dict[bytes, bytes]]]:
    """XREAD's reply for one stream as (entry id, fields) pairs, whatever shape redis-py gave it."""
    if not reply:
        return []
    streams = list(reply.values()) if isinstance(reply, dict) else [row[1] for row in reply]
    out: list[tuple[str, dict[bytes, bytes]]] = []
    for rows in streams:
        for row in rows or ():
            if isinstance(rows, dict):  # RESP3 may give {id: fields}
                entry_id, fields = row, rows[row]
            else:
                entry_id, fields = row[0], row[1]
            if fields is None:
                continue
            if not isinstance(fields, dict):
                fields = fields_of(list(fields))
            out.append((text(entry_id), {_b(k): _b(v) for k, v in fields.items()}))
    return out


def _next_id(entry_id: str) -> str:
    """The stream id right after ``entry_id`` (XTRIM MINID keeps ids at or above its argument)."""
    ms, _, seq = entry_id.partition("-")
    return f"{ms}-{int(seq or 0) + 1}"


def _b(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()
