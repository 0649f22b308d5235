"""Calls from many tasks sent together: effects commits (one script call per source) and reads.

A handler that commits its Redis effects (``ctx.redis_transaction()``, a saga step) makes one
commit per message. Sent one by one through the client, each pays redis-py's command machinery, a
round trip and a script run of its own (with the inbox's bookkeeping); with 64 lanes that is most
of a worker's CPU and of the server's. The :class:`CommitBatcher` queues the commits and sends
whatever is queued as one write on a :class:`~broker.redis.wire.Channel`, with at most ``width`` writes
in flight at a time, so a lone commit goes out at once and commits made while others are in flight
share the next write. Commits of one source (stream, group, fencing token) in a write are one call
of ``commit_effects.lua``, which commits each message as if it were alone and returns each one's
outcome (the inbox's lookups and records are made once for all of them).

A write that fails as a whole (a lost connection, no reply in time) fails every commit in it, as
the same commits sent one by one would have failed; whether a commit that was sent ran is then
unknown, exactly as for a single call. No task runs in the background: the caller whose call
finds a free slot sends the batch (shielded from cancellation, since other callers wait on it),
and a caller whose call waits is handed the next batch when a slot frees.

The :class:`ReadBatcher` does the same for plain read commands (a saga step's state read): each
call's reply is its own, and a write of many reads costs the worker one send and one wake-up.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from broker.envelope import now_ms
from broker.redis.scripts import script_missing

if TYPE_CHECKING:
    from broker.redis.scripts import Script
    from broker.redis.wire import Channel

__all__ = ["MAX_BATCH", "Batcher", "CommitBatcher", "ReadBatcher"]

_LEAD: Any = object()  # a waiting caller's signal: a slot is free, send the queued calls yourself
MAX_BATCH = 64  # calls per write at most (one script call of 64 commits runs about 4 ms on the server, blocking it)


def _copy(exc: BaseException) -> BaseException:
    """A batch's failure as one caller's own exception (the same object raised in many tasks
    would collect all their tracebacks)."""
    try:
        copy = type(exc)(*exc.args)
    except Exception:
        return exc
    copy.__cause__ = exc
    return copy


class _Call:
    __slots__ = ("future", "keys", "part", "source")

    def __init__(self, source: Any, keys: Sequence[Any], part: list[Any], future: asyncio.Future[Any]):
        self.source = source
        self.keys = keys
        self.part = part
        self.future = future


class Batcher:
    """Calls from many tasks sent together on channels, at most ``width`` writes in flight (see the
    module docstring); subclasses say how a batch of calls becomes commands and replies."""

    def __init__(self, new_channel: Callable[[], Channel], *, width: int = 4) -> None:
        self._new_channel = new_channel  # () -> Channel
        self.width = width
        self._queue: deque[_Call] = deque()
        self._idle: list[Channel] = []
        self._busy = 0  # batches in flight (or about to be)
        self.batches = 0  # batches sent (tests, observability)
        self.calls = 0  # calls sent

    async def _submit(self, source: Any, keys: Sequence[Any], part: list[Any]) -> Any:
        """Queue one call (or send it now, with the queued ones); its own reply, raised if an error."""
        loop = asyncio.get_running_loop()
        item = _Call(source, keys, part, loop.create_future())
        if self._busy < self.width:  # a free slot: send it now, with whatever is queued
            self._busy += 1
            with anyio.CancelScope(shield=True):
                await self._send(item)
        else:
            self._queue.append(item)
            try:
                signal = await item.future
            except BaseException:
                if item.future.cancelled():  # still queued: leave (nothing was sent)
                    with contextlib.suppress(ValueError):
                        self._queue.remove(item)
                elif item.future.result() is _LEAD:  # handed a slot as we were cancelled: send the others'
                    with anyio.CancelScope(shield=True):
                        await self._send(None)
                raise  # (or our call had been sent: its outcome is unknown to us, as for any cancelled call)
            if signal is _LEAD:  # handed a slot (and taken off the queue): send ours and the queued
                item.future = loop.create_future()
                with anyio.CancelScope(shield=True):
                    await self._send(item)
        reply = item.future.result()
        if isinstance(reply, BaseException):
            raise reply
        return reply

    async def _send(self, own: _Call | None) -> None:
        """Send ``own`` and up to :data:`MAX_BATCH` queued calls on a free channel; settle them all.
        The caller holds a slot; this frees it and hands the next one on."""
        queue = self._queue
        batch = [] if own is None else [own]
        while queue and len(batch) < MAX_BATCH:
            batch.append(queue.popleft())
        channel = self._idle.pop() if self._idle else self._new_channel()
        try:
            if batch:
                await self._exchange(channel, batch)
                self.batches += 1
                self.calls += len(batch)
        except BaseException as exc:
            for c in batch:
                if not c.future.done():
                    c.future.set_result(exc if c is own else _copy(exc))
            if not isinstance(exc, Exception):
                raise
        finally:
            self._idle.append(channel)
            self._busy -= 1
            self._hand_over()

    def _hand_over(self) -> None:
        """A slot is free: the first queued caller takes it and sends the next batch."""
        queue = self._queue
        while queue and self._busy < self.width:
            first = queue.popleft()
            if first.future.done():  # cancelled (it would leave the queue itself)
                continue
            self._busy += 1
            first.future.set_result(_LEAD)
            return

    async def _exchange(self, channel: Channel, batch: list[_Call]) -> None:
        """Send ``batch`` on ``channel`` and set each call's future to its reply."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """Give the channels' connections back."""
        idle, self._idle = self._idle, []
        for channel in idle:
            await channel.aclose()


class CommitBatcher(Batcher):
    """Sends ``commit_effects.lua`` commits from many tasks together (see the module docstring)."""

    def __init__(self, script: Script, new_channel: Callable[[], Channel], *, width: int = 4) -> None:
        super().__init__(new_channel, width=width)
        self.script = script

    async def call(self, source: tuple[Any, ...], keys: Sequence[Any], part: list[Any]) -> Any:
        """Commit one message: ``source`` = (stream, inbox, attempts, DLQ, lease key, group, delete
        flag, fencing token, then the reason pairs shared by the call), ``keys`` the keys its
        commands touch, ``part`` its section of ARGV (see ``commit_effects.lua``). Its own result:
        -1 (fenced), or what the script lists for it."""
        return await self._submit(source, keys, part)

    async def _exchange(self, channel: Channel, batch: list[_Call]) -> None:
        by_source: dict[tuple[Any, ...], list[_Call]] = {}
        for c in batch:
            by_source.setdefault(c.source, []).append(c)
        groups = list(by_source.values())
        replies = await self._run(channel, [self._command(calls) for calls in groups])
        for calls, reply in zip(groups, replies, strict=True):
            for i, c in enumerate(calls):
                if c.future.done():
                    continue
                if isinstance(reply, list):
                    c.future.set_result(reply[i])
                elif isinstance(reply, BaseException):
                    c.future.set_result(reply if i == 0 else _copy(reply))
                else:  # one result for all (-1: fenced)
                    c.future.set_result(reply)

    def _command(self, calls: list[_Call]) -> list[Any]:
        """One script call committing ``calls`` (of one source)."""
        source = calls[0].source
        keys: list[Any] = list(source[:5])
        extra: dict[Any, None] = {}
        args: list[Any] = [*source[5:7], now_ms(), source[7], len(calls), (len(source) - 8) // 2, *source[8:]]
        for c in calls:
            extra.update(dict.fromkeys(c.keys))
            args += c.part
        keys += extra
        return self.script.command(keys, args)

    async def _run(self, channel: Channel, commands: list[list[Any]]) -> list[Any]:
        replies = await channel.execute_many(commands)
        missing = [i for i, r in enumerate(replies) if script_missing(r)]
        if missing:  # the server lost its scripts (a restart without persistence, SCRIPT or FUNCTION FLUSH)
            await channel.execute(*self.script.load_command())
            for i, reply in zip(missing, await channel.execute_many([commands[i] for i in missing]), strict=True):
                replies[i] = reply
        return replies


class ReadBatcher(Batcher):
    """Sends read commands from many tasks together, one pipelined write (see the module docstring)."""

    async def call(self, *command: Any) -> Any:
        """Run ``command`` with the other queued reads; its reply (a failed write fails every read in it)."""
        return await self._submit(None, (), list(command))

    async def _exchange(self, channel: Channel, batch: list[_Call]) -> None:
        replies = await channel.execute_many([c.part for c in batch])
        for c, reply in zip(batch, replies, strict=True):
            if not c.future.done():
                c.future.set_result(reply)
