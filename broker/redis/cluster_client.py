"""The async Redis Cluster client the broker uses: redis-py's, routing stream reads without a round trip.

redis-py finds the slot of a command from its keys. For commands whose keys move with their
arguments (``XREADGROUP``, ``XREAD``: flagged ``movablekeys``) it asks a server first, with
``COMMAND GETKEYS``: one extra round trip for every group read, the broker's most frequent
command. :class:`BrokerCluster` reads the keys itself (those after ``STREAMS``: the first half of
what follows) and leaves every other command to redis-py. The promise is the same as redis-py's:
a command whose keys map to different slots is refused before it is sent.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisClusterException

__all__ = ["BrokerCluster", "stream_read_keys"]

_STREAM_READS = frozenset({"XREADGROUP", "XREAD"})


def _word(arg: Any) -> str:
    return (arg.decode(errors="replace") if isinstance(arg, bytes) else str(arg)).upper()


def stream_read_keys(command: str, args: tuple[Any, ...]) -> list[Any] | None:
    """The stream keys of an ``XREADGROUP``/``XREAD`` call (``args`` after the command name), or None
    when the arguments are not the plain form (then redis-py routes the call itself).

    The options before ``STREAMS`` are walked by their arity, so a group or consumer called
    "streams" is not taken for the keyword.
    """
    i = 0
    if _word(command) == "XREADGROUP":
        if len(args) < 3 or _word(args[0]) != "GROUP":
            return None
        i = 3
    while i < len(args):
        word = _word(args[i])
        if word in ("COUNT", "BLOCK", "CLAIM"):
            i += 2
        elif word == "NOACK":
            i += 1
        elif word == "STREAMS":
            rest = args[i + 1 :]
            if not rest or len(rest) % 2:
                return None
            return list(rest[: len(rest) // 2])
        else:
            return None
    return None


class BrokerCluster(RedisCluster):
    """``redis.asyncio.RedisCluster`` that routes ``XREADGROUP``/``XREAD`` by their ``STREAMS`` keys."""

    async def _determine_slot(self, command: str, *args: Any) -> int:
        name = command.decode() if isinstance(command, bytes) else str(command)
        if name.upper() in _STREAM_READS:
            keys = stream_read_keys(name, args)
            if keys:
                slots = {self.keyslot(k) for k in keys}
                if len(slots) != 1:
                    raise RedisClusterException(f"{name} - all keys must map to the same key slot")
                return slots.pop()
        return await super()._determine_slot(command, *args)
