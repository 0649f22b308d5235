"""The leased read: new entries and their inbox leases in one server call (``intake.lua``).

A handler with the inbox needs each message's lease before it starts; taken by a second call
after the read, the lease costs a round trip per batch, which is most of the latency a message
waits at low rates. Here the read takes the leases itself: a script reads the entries
(``XREADGROUP``, never blocking) and leases their ids, and when it finds nothing the wait (a
plain ``XREAD BLOCK`` from the streams' last ids, which takes nothing) and the next leased read
go in one write, so a message that arrives during the wait comes back read and leased in one
round trip. A leased read that reached the streams' ends returns their last ids too, so the
next call starts its wait at once (one round trip per message at low rates, as a blocking
``XREADGROUP`` takes).

The server copies what a script reads through Lua (about 2 µs per entry, more than the separate
inbox check costs it), so a read that came back full (a backlog: throughput, not latency) is
followed by plain reads whose deliveries the caller checks with ``inbox_claim`` in one call per
batch; the leased read comes back once a read returns less than :data:`LEASED_BELOW` entries.
"""

from __future__ import annotations

import time
from typing import Any

from broker.envelope import now_ms
from broker.protocol import Delivery, GroupPartition
from broker.redis.core import text
from broker.redis.reading import Reading, lease_lost
from broker.redis.scripts import script_missing
from broker.redis.wire import Channel

__all__ = ["LEASED_BELOW", "TOUCH_EVERY_S", "Intake"]

LEASED_BELOW = 64
"""A read that returned fewer entries than this is followed by a leased read; a fuller one by a
plain read (the backlog path, see the module's docstring)."""

TOUCH_EVERY_S = 1.0
"""A wait marks its consumer seen when no wait did for this long (see :meth:`Intake.read_leased`)."""

# Past every entry (a read of the consumer's own pending entries after it takes and returns
# nothing). Not the largest id: the server reads that one as ">" (new entries: the read would take
# them and nobody would run them).
_PAST_ALL = ["18446744073709551615-18446744073709551614"] * 2


class Intake(Reading):
    """Reads that take the inbox leases of what they read (:meth:`read_leased`)."""

    async def read_leased(
        self,
        source: GroupPartition,
        consumer: str,
        count: int,
        block_ms: int,
        *,
        lease_ms: int,
        window_ms: int = 0,
        channel: Channel | None = None,
        token: int | None = None,
    ) -> list[Delivery]:
        """Like :meth:`read`, and lease the read messages' ids in the group's inbox in the same call.

        Each delivery's ``inbox_status`` is what ``inbox_claim`` would have said (0 run, 1 already
        processed, 2 running elsewhere); deliveries read by the backlog path (see the module) have
        ``inbox_status`` None: the caller checks them with ``inbox_claim``. Fenced like
        :meth:`read` when ``token`` is given (:class:`~broker.errors.LeaseLost`, nothing taken).
        """
        mode_key = (source.stream, consumer)
        if self._backlog.get(mode_key):
            out = await self.read(source, consumer, count, block_ms, channel=channel, token=token)
            self._backlog[mode_key] = len(out) >= LEASED_BELOW
            return out
        if channel is None:
            block_ms = min(block_ms, int(self.command_timeout * 500))
        keys = [source.stream, source.keys.redeliver, source.keys.inbox, source.keys.lease]
        fence = "" if token is None else str(token)
        script = self.scripts["intake"]

        def intake_args() -> list[Any]:
            return [consumer, source.group, count, now_ms(), lease_ms, window_ms, fence]

        drained = self._drained.pop(mode_key, None)
        if drained is not None and block_ms > 0:  # the last read reached the streams' ends: wait from there
            reply: Any = [0, *drained]
        else:
            reply = await self._intake(source, keys, intake_args(), channel)
        if int(reply[0]) == 0 and block_ms > 0:
            last = [text(reply[1]), text(reply[2])]
            streams = [source.stream, source.keys.redeliver]
            wait = ["XREAD", "COUNT", 1, "BLOCK", block_ms, "STREAMS", *streams, *last]
            # Keeps the consumer seen (XINFO CONSUMERS, the CLI's live-consumer checks) while it
            # waits: a read of its own pending entries past every id (_PAST_ALL), which takes and
            # returns nothing. Every leased read marks it seen too, so this goes along only when no wait
            # did for TOUCH_EVERY_S (at a steady rate: hardly ever; the first wait: always).
            now = time.monotonic()
            touch = None
            if now - self._touched.get(mode_key, -TOUCH_EVERY_S) >= TOUCH_EVERY_S:
                self._touched[mode_key] = now
                touch = ["XREADGROUP", "GROUP", source.group, consumer, "COUNT", 1, "STREAMS", *streams, *_PAST_ALL]
            if channel is not None:
                call = script.command(keys, intake_args())
                commands = [wait, call] if touch is None else [touch, wait, call]
                replies = await channel.execute_many(commands, timeout=block_ms / 1000 + self.command_timeout)
                for r in replies[:-1]:
                    if isinstance(r, Exception):
                        raise r
                reply = replies[-1]
                if script_missing(reply):  # it did not run: load it and read again
                    reply = await self._intake(source, keys, intake_args(), channel)
                elif isinstance(reply, Exception):
                    raise reply
            else:
                if touch is not None:
                    await self._send_once(source, touch, None, 0)
                if not await self._send_once(source, wait, None, block_ms):
                    return []
                reply = await self._intake(source, keys, intake_args(), None)
        if int(reply[0]) == -1:
            raise lease_lost(source, "nothing was read")
        if int(reply[0]) == 0:
            # Another reader took what woke the wait: wait again from here at once, as a blocked
            # XREADGROUP would, so that readers of one partition take turns (the server serves
            # waits in the order they began).
            self._drained[mode_key] = (text(reply[1]), text(reply[2]))
            return []
        out = self._deliveries(source, reply[1])
        for d, status in zip(out, reply[2], strict=True):
            d.inbox_status = int(status)
        self._backlog[mode_key] = len(out) >= LEASED_BELOW
        if len(reply) >= 5:  # read to the streams' ends: the next call waits from these ids at once
            self._drained[mode_key] = (text(reply[3]), text(reply[4]))
        return out

    async def _intake(self, source: GroupPartition, keys: list[str], args: list[Any], channel: Channel | None) -> Any:
        """One intake.lua call, never re-sent after a timeout (loaded again on NOSCRIPT: it did not run)."""
        if channel is not None:
            return await self.scripts["intake"].on(channel, keys, args)
        return await self._script_once(source, "intake", keys, args)
