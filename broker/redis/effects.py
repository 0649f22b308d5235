"""The recorder behind ``ctx.redis_transaction()`` (Redis commands and :mod:`broker.state` operations) and
their translation into the commands of one ``commit_effects.lua`` call.

:class:`RedisEffects` keeps a run's writes in the order recorded: Redis commands as plain tuples
(``("HINCRBY", key, field, 5)``) and typed operations as themselves. :func:`state_command` turns a
typed operation into the command the script runs: a guard into the script's in-band
``__EXPECT__`` entry, :class:`~broker.state.SetFields` into ``HSET``, :class:`~broker.state.DeleteKey`
into ``DEL``, :class:`~broker.state.ExpireKey` into ``PEXPIRE``; a
:class:`~broker.state.ScheduleMessage` becomes the ``ZADD`` and ``HSET`` of the partition's scheduled
keys, its envelope packed as ``schedule_add.lua`` stores it (:func:`msgpack_strings`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from broker.state import DeleteKey, Effects, ExpectField, ExpireKey, SetFields

__all__ = ["EXPECT", "RedisEffects", "as_bytes", "msgpack_strings", "state_command"]

EXPECT = "__EXPECT__"
"""The command name ``commit_effects.lua`` reads as a guard (``[EXPECT, key, field, value]``), not a write."""


class RedisEffects(Effects):
    """Redis writes recorded by a handler, applied atomically with its ack when it succeeds.

    ``tx.call("HINCRBY", key, field, 5)`` or ``tx.hincrby(key, field, 5)``. The first argument
    is taken as the key; pass ``keys=[...]`` for commands that touch several. Writes are applied
    after the handler returns, so read current values before (``ctx.redis``). On a Redis Cluster
    every key must carry the message's hash tag (``ctx.hash_tag``). Typed operations
    (:meth:`~broker.state.Effects.add`, :meth:`~broker.state.Effects.expect`) go in the same commit.
    """

    __slots__ = ("keys",)

    def __init__(self) -> None:
        super().__init__()
        self.keys: list[str] = []  # the keys the commands touch (declared to the script for Cluster routing)

    @classmethod
    def of(cls, *commands: Sequence[Any]) -> RedisEffects:
        """A recorder holding ``commands`` (each keyed by its first argument): for tools and tests."""
        effects = cls()
        for command in commands:
            effects.call(*command)
        return effects

    def call(self, command: str, *args: Any, keys: Sequence[str] | None = None) -> None:
        """Record one write command."""
        self.ops.append((command, *args))
        if keys is not None:
            self.keys += keys
        elif args:
            self.keys.append(str(args[0]))

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, keys=None: self.call(name.upper(), *args, keys=keys)


def state_command(op: object) -> Sequence[Any] | None:
    """The command of a typed state operation (None for one this does not translate: a Redis command
    recorded as it is, or a :class:`~broker.state.ScheduleMessage`, which needs the partition's keys)."""
    kind = type(op)
    if kind is SetFields:
        assert isinstance(op, SetFields)
        command: list[Any] = ["HSET", op.key]
        for item in op.fields.items():
            command += item
        return command
    if kind is ExpectField:
        assert isinstance(op, ExpectField)
        return (EXPECT, op.key, op.field, op.value)
    if kind is DeleteKey:
        assert isinstance(op, DeleteKey)
        return ("DEL", op.key)
    if kind is ExpireKey:
        assert isinstance(op, ExpireKey)
        return ("PEXPIRE", op.key, op.ms)
    return None


def as_bytes(value: bytes | str | int) -> bytes:
    """A field value as the script receives it."""
    if isinstance(value, bytes):
        return value
    return str(value).encode()


def msgpack_strings(items: list[bytes]) -> bytes:
    """cmsgpack's encoding of a Lua array of strings: what ``schedule_add.lua`` stores for a scheduled
    entry's field/value list, packed here so a commit writes a scheduled message by plain commands."""
    n = len(items)
    out = bytearray()
    if n < 16:
        out.append(0x90 | n)
    elif n < 1 << 16:
        out += b"\xdc" + n.to_bytes(2, "big")
    else:
        out += b"\xdd" + n.to_bytes(4, "big")
    for b in items:
        size = len(b)
        if size < 32:
            out.append(0xA0 | size)
        elif size < 1 << 8:
            out += b"\xd9" + size.to_bytes(1, "big")
        elif size < 1 << 16:
            out += b"\xda" + size.to_bytes(2, "big")
        else:
            out += b"\xdb" + size.to_bytes(4, "big")
        out += b
    return bytes(out)
