"""The broker's reading role: group reads, own pending entries, claims, leases and the inbox check.

Everything here hands out :class:`~broker.protocol.Delivery` objects or keeps the ones handed out
owned (``extend``); settling them is :mod:`broker.redis.settlement`'s job.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from redis.exceptions import NoPermissionError, ResponseError

from broker.codec import decode_flat
from broker.envelope import Envelope, now_ms
from broker.errors import DecodeError, LeaseLost
from broker.protocol import Delivery, Extension, GroupPartition
from broker.redis.core import RedisCore, text
from broker.redis.deliveries import deliveries_of
from broker.redis.keys import inbox_records_spanned
from broker.redis.scripts import script_missing
from broker.redis.wire import Channel

__all__ = ["SCRIPT_CHUNK", "Reading", "claim_statuses", "lease_lost"]

SCRIPT_CHUNK = 1000
"""Entry ids per script call (extend, ack): Lua's unpack() fails beyond about 8000 values, and a
script blocks the server while it runs."""


def claim_statuses(reply: Any, n: int) -> list[int]:
    """``inbox_claim.lua``'s reply as one status per id: an integer reply says all ``n`` were leased
    to the caller (status 0), the common case, which spares the server a reply of ``n`` zeros."""
    if isinstance(reply, int):
        return [0] * n
    return [int(x) for x in reply]


def lease_lost(source: GroupPartition, outcome: str) -> LeaseLost:
    """The error of a call refused by the fencing check (another instance holds the lease)."""
    return LeaseLost(
        f"partition {source.partition} of {source.spec.name!r} is owned by another instance of {source.group!r} now "
        f"(this instance's lease expired): {outcome}"
    )


def _last_generated(info: Any) -> str:
    """The ``last-generated-id`` of an ``XINFO STREAM`` reply (a flat list, or a map under RESP3)."""
    if isinstance(info, Exception):
        raise info
    if not isinstance(info, dict):
        info = dict(zip(info[::2], info[1::2], strict=True))
    return text(info.get(b"last-generated-id") or info.get("last-generated-id") or "0-0")


_REFUSED = "nothing was read or claimed"


class Reading(RedisCore):
    """Delivers entries of a group's partition (and its redeliver stream) to consumers."""

    def _deliveries(self, source: GroupPartition, reply: Any, counts: dict[str, int] | None = None) -> list[Delivery]:
        return deliveries_of(source, reply, self.max_body_bytes, counts)

    def channel(self) -> Channel | None:
        """A dedicated connection for one task's hot path (None on a Cluster: use the client)."""
        return None if self.cluster else Channel(self.redis.connection_pool, command_timeout=self.command_timeout)

    async def read(
        self,
        source: GroupPartition,
        consumer: str,
        count: int,
        block_ms: int,
        *,
        channel: Channel | None = None,
        token: int | None = None,
    ) -> list[Delivery]:
        """XREADGROUP new entries of the partition stream and the group's redeliver stream.

        Bounded: on a channel the call waits at most ``block_ms`` plus the command timeout; through
        the client (whose socket timeout is the command timeout) BLOCK is capped at half of it.
        Never re-sent by the client (a read must not reach the server after the caller checked its lease).
        ``token`` (an owned partition's fencing token): the read is fenced (:meth:`_read_owned`).
        """
        if channel is None:
            block_ms = min(block_ms, int(self.command_timeout * 500))
        if token is not None:
            return await self._read_owned(source, consumer, count, block_ms, channel, token)
        args: list[Any] = ["XREADGROUP", "GROUP", source.group, consumer, "COUNT", count]
        if block_ms > 0:
            args += ["BLOCK", block_ms]
        args += ["STREAMS", source.stream, source.keys.redeliver, ">", ">"]
        return self._deliveries(source, await self._send_once(source, args, channel, block_ms))

    async def _send_once(self, source: GroupPartition, args: list[Any], channel: Channel | None, block_ms: int) -> Any:
        """Send one command about ``source``'s partition, never re-sent by a client after a timeout."""
        if channel is not None:
            return await channel.execute(*args, timeout=block_ms / 1000 + self.command_timeout)
        if self.cluster:
            # One attempt: a Cluster client re-sends a command that timed out, and a read re-sent
            # would take entries whose first reply was lost (they would wait, pending here, while
            # later entries of their keys run). Naming the node turns the client's retries off (a
            # MOVED redirection is still followed: the command did not run).
            node = self.redis.get_node_from_key(source.stream)
            return await self.redis.execute_command(*args, target_nodes=node)
        return await self.redis.execute_command(*args)

    async def _script_once(self, source: GroupPartition, name: str, keys: list[str], args: list[Any]) -> Any:
        """One call of script ``name`` through the client, sent once (loaded again on NOSCRIPT, which
        means it did not run)."""
        script = self.scripts[name]
        command = script.command(keys, args)
        try:
            return await self._send_once(source, command, None, 0)
        except ResponseError as exc:
            if not script_missing(exc):
                raise
            await script.load(self.redis)
            return await self._send_once(source, command, None, 0)

    async def _owned_intake(self, source: GroupPartition, keys: list[str], args: list[Any]) -> Any:
        """One owned_intake.lua call through the client (:meth:`_script_once`); LeaseLost when fenced out."""
        reply = await self._script_once(source, "owned_intake", keys, args)
        if int(reply[0]) == -1:
            raise lease_lost(source, _REFUSED)
        return reply

    async def _read_owned(
        self, source: GroupPartition, consumer: str, count: int, block_ms: int, channel: Channel | None, token: int
    ) -> list[Delivery]:
        """The fenced read of an owned partition: only the lease's holder takes entries.

        A blocking XREADGROUP cannot be fenced (the lease is checked when the command runs, and it
        may run after a pause of its sender, or wait on the server past the lease), so the read is
        a non-blocking XREADGROUP made atomic with a check of the lease (:meth:`_fenced_read`);
        when it finds nothing new, a plain XREAD BLOCK from the streams' last ids waits for a newer
        entry (taking nothing), then the fenced read runs again. Raises
        :class:`~broker.errors.LeaseLost` when the token is no longer current (nothing read).
        """
        reply, last = await self._fenced_read(source, consumer, count, channel, token)
        if reply or block_ms <= 0:
            return self._deliveries(source, reply)
        # A read of our own pending entries after the streams' last ids: it takes and returns nothing
        # but keeps the consumer seen (a non-blocking XREADGROUP that finds nothing does not), so
        # ``XINFO CONSUMERS`` and the CLI's live-consumer checks still see an idle owner.
        streams = [source.stream, source.keys.redeliver]
        touch = ["XREADGROUP", "GROUP", source.group, consumer, "COUNT", 1, "STREAMS", *streams, *last]
        wait = ["XREAD", "COUNT", 1, "BLOCK", block_ms, "STREAMS", *streams, *last]
        if channel is not None:
            # The fenced read's first step (WATCH and read the lease) goes in the same write: the
            # server runs it as soon as the wait ends, which saves a round trip per wake-up.
            check = [["WATCH", source.keys.lease], ["HMGET", source.keys.lease, "owner", "token"]]
            replies = await channel.execute_many([touch, wait, *check], timeout=block_ms / 1000 + self.command_timeout)
            for r in replies[:3]:
                if isinstance(r, Exception):
                    raise r
            reply, _ = await self._fenced_read(source, consumer, count, channel, token, replies[3])
        else:
            await self._send_once(source, touch, None, 0)
            if not await self._send_once(source, wait, None, block_ms):
                return []
            reply, _ = await self._fenced_read(source, consumer, count, None, token)
        return self._deliveries(source, reply)

    async def _fenced_read(
        self,
        source: GroupPartition,
        consumer: str,
        count: int,
        channel: Channel | None,
        token: int,
        state: Any = None,
    ) -> tuple[Any, list[str]]:
        """XREADGROUP '>' (not blocking) only if ``consumer`` holds the lease under ``token``, atomically.

        Returns the read's reply (None: nothing new) and the two streams' last generated ids. On a
        channel: WATCH the lease, check it, then MULTI/XREADGROUP/EXEC (the entries come back as
        Redis encodes them; an EXEC aborted by any write to the lease, such as our own renewal,
        checks again; ``state``: the lease's HMGET reply, WATCH already sent). Through the client
        (a Cluster): ``owned_intake.lua``, which costs the server a few µs per entry more (the reply
        is copied through Lua).
        """
        if channel is None:
            keys = [source.keys.lease, source.stream, source.keys.redeliver]
            reply = await self._owned_intake(source, keys, [consumer, token, "read", source.group, count])
            if int(reply[0]) == 1:
                return reply[1], []
            return None, [text(reply[1]), text(reply[2])]
        lease = source.keys.lease
        read: list[Any] = ["XREADGROUP", "GROUP", source.group, consumer, "COUNT", count]
        read += ["STREAMS", source.stream, source.keys.redeliver, ">", ">"]
        tops = [["XINFO", "STREAM", stream] for stream in (source.stream, source.keys.redeliver)]
        while True:
            if state is None:
                _, state = await channel.execute_many([["WATCH", lease], ["HMGET", lease, "owner", "token"]])
            if isinstance(state, Exception):
                raise state
            if text(state[0] or b"") != consumer or int(state[1] or 0) != token:
                await channel.execute("UNWATCH")
                raise lease_lost(source, _REFUSED)
            replies = await channel.execute_many([["MULTI"], read, *tops, ["EXEC"]])
            done = replies[-1]
            if isinstance(done, Exception):
                raise done
            if done is None:  # the lease was written meanwhile (a renewal, a take-over): check again
                state = None
            else:
                reply, top, top_redeliver = done
                if isinstance(reply, Exception):
                    raise reply
                return reply, [_last_generated(info) for info in (top, top_redeliver)]

    async def read_own_pending(
        self, source: GroupPartition, consumer: str, count: int, after: dict[str, str] | None = None
    ) -> list[Delivery]:
        """Re-read entries pending for ``consumer`` itself, oldest first, after ids in ``after``."""
        after = after or {}
        streams = (source.stream, source.keys.redeliver)
        starts = [after.get(s, "0") for s in streams]
        pipe = self.redis.pipeline(transaction=False)
        pipe.execute_command(
            "XREADGROUP", "GROUP", source.group, consumer, "COUNT", count, "STREAMS", *streams, *starts
        )
        for stream, start in zip(streams, starts, strict=True):
            lo = "-" if start == "0" else f"({start}"
            pipe.execute_command("XPENDING", stream, source.group, lo, "+", count, consumer)
        reply, *pending = await pipe.execute()
        counts = {text(p[0]): int(p[3]) for rows in pending for p in rows}
        return self._deliveries(source, reply, counts)

    async def claim_idle(
        self, source: GroupPartition, consumer: str, min_idle_ms: int, count: int, *, token: int | None = None
    ) -> list[Delivery]:
        """XAUTOCLAIM entries idle past ``min_idle_ms``; their delivery counts are raised by one.
        ``token``: an owned partition's fencing token (fenced like :meth:`read`)."""
        out: list[Delivery] = []
        for stream in (source.stream, source.keys.redeliver):
            cursor_key = (stream, source.group)
            start = self._claim_cursor.get(cursor_key, "0-0")
            self._claim_cursor[cursor_key], claimed = await self._autoclaim(
                source, stream, consumer, min_idle_ms, start, count, token
            )
            out += claimed
        return out

    async def _autoclaim(
        self,
        source: GroupPartition,
        stream: str,
        consumer: str,
        min_idle_ms: int,
        start: str,
        count: int,
        token: int | None = None,
    ) -> tuple[str, list[Delivery]]:
        """One XAUTOCLAIM of ``stream`` from ``start``: the next cursor and the claimed deliveries,
        with their delivery counts (one XPENDING over the claimed range). With ``token`` (an owned
        partition) it is fenced: owned_intake.lua claims only for the lease's holder, else LeaseLost."""
        if token is None:
            reply = await self.redis.execute_command(
                "XAUTOCLAIM", stream, source.group, consumer, min_idle_ms, start, "COUNT", count
            )
        else:
            args = [consumer, token, "claim", source.group, min_idle_ms, start, count]
            reply = (await self._owned_intake(source, [source.keys.lease, stream], args))[1]
        entries = [e for e in reply[1] if e is not None]
        if not entries:
            return text(reply[0]), []
        ids = [text(e[0]) for e in entries]
        rows = await self.redis.execute_command(
            "XPENDING", stream, source.group, ids[0], ids[-1], len(ids) * 2 + 10, consumer
        )
        counts = {text(p[0]): int(p[3]) for p in rows}
        return text(reply[0]), self._deliveries(source, [[stream, entries]], counts)

    async def release_own_pending(
        self, source: GroupPartition, consumer: str, idle_ms: int, *, keep: Iterable[str] = ()
    ) -> int:
        """Make entries pending for ``consumer`` claimable by others at once (a handover at shutdown).

        The entries stay pending (nothing is lost); their idle time is set to ``idle_ms`` (at least
        the visibility timeout), so the next claim by a live consumer takes them. Entry ids in
        ``keep`` (handlers still running them) are left alone: they are claimed only after the
        visibility timeout, so they never run twice at once. Returns how many were released.
        """
        kept = set(keep)
        released = 0
        for stream in (source.stream, source.keys.redeliver):
            rows = await self.redis.execute_command("XPENDING", stream, source.group, "-", "+", 10_000, consumer)
            ids = [i for i in (text(r[0]) for r in rows) if i not in kept]
            for i in range(0, len(ids), 1000):
                chunk = ids[i : i + 1000]
                await self.redis.execute_command(
                    "XCLAIM", stream, source.group, consumer, 0, *chunk, "IDLE", idle_ms, "JUSTID"
                )
                released += len(chunk)
        return released

    async def prune_consumers(self, source: GroupPartition, min_idle_ms: int, *, keep: str = "") -> int:
        """Delete consumers of the group that hold nothing and were idle ``min_idle_ms`` or longer.

        Processes that died or were replaced (a new host name after a container restart) stay listed
        in the group forever otherwise, and ``framework status`` would count them. A consumer with
        pending entries is never deleted (its entries would be lost to claims), nor ``keep``. A
        live consumer reading again is recreated by the server. Returns how many consumer entries
        were deleted (a consumer is listed on the partition stream and on the redeliver stream).
        """
        deleted = 0
        for stream in (source.stream, source.keys.redeliver):
            try:
                rows = await self.redis.xinfo_consumers(stream, source.group)
            except NoPermissionError:
                raise
            except ResponseError:  # no stream or group yet
                continue
            for row in rows:
                info = {text(k): v for k, v in row.items()}
                name = text(info["name"])
                if name != keep and int(info["pending"]) == 0 and int(info["idle"]) >= min_idle_ms:
                    await self.redis.xgroup_delconsumer(stream, source.group, name)
                    deleted += 1
        return deleted

    async def extend(
        self, source: GroupPartition, consumer: str, deliveries: Sequence[Delivery], *, lease_ms: int = 60_000
    ) -> Extension:
        """Touch deliveries ``consumer`` still owns so they are not claimed, and extend their inbox
        leases by ``lease_ms``; return the entry ids still owned, with ``.taken``: those pending
        under another consumer. Entries no longer pending (settled meanwhile) are in neither."""
        owned: list[str] = []
        taken: list[str] = []
        by_stream: dict[str, list[Delivery]] = defaultdict(list)
        for d in deliveries:
            by_stream[d.stream].append(d)
        expiry = now_ms() + lease_ms
        for stream, items in by_stream.items():
            for i in range(0, len(items), SCRIPT_CHUNK):  # bounded calls: a script blocks the server while it runs
                chunk = items[i : i + SCRIPT_CHUNK]
                args = [
                    source.group,
                    consumer,
                    expiry,
                    len(chunk),
                    *(d.entry_id for d in chunk),
                    *(d.message_id for d in chunk),
                ]
                reply = await self.scripts["extend"](self.redis, [stream, source.keys.inbox], args)
                for d, status in zip(chunk, reply, strict=True):
                    if status == 0:
                        owned.append(d.entry_id)
                    elif status == 2:
                        taken.append(d.entry_id)
        return Extension(owned, taken)

    async def inbox_claim(
        self,
        source: GroupPartition,
        deliveries: Sequence[Delivery],
        lease_ms: int,
        *,
        channel: Channel | None = None,
        window_ms: int = 0,
    ) -> list[int]:
        """Check deliveries against the group's inbox and lease the new ones, in one call.

        Returns a status per delivery: 0 leased to us (run it), 1 already processed (ack it),
        2 leased elsewhere (leave it pending). Redelivered entries take over stale leases.
        ``window_ms`` (the dedup window) is stored for the group: acks set their records' expiry
        from it (default a week until a claim stores one).
        """
        script = self.scripts["inbox_claim"]
        keys = [source.keys.inbox]
        again = [d for d in deliveries if d.delivery_count != 1]
        # First deliveries go first (the script's n); the common case has none again: the order as is.
        ordered = [*(d for d in deliveries if d.delivery_count == 1), *again] if again else deliveries
        ids = [d.message_id for d in ordered]
        records, span = inbox_records_spanned(ids)
        args = [now_ms(), lease_ms, len(ids) - len(again), window_ms, len(ids), *ids, records, *(span or ())]
        reply = await (script.on(channel, keys, args) if channel is not None else script(self.redis, keys, args))
        statuses = claim_statuses(reply, len(ids))
        if not again:
            return statuses
        status = dict(zip(map(id, ordered), statuses, strict=True))
        return [status[id(d)] for d in deliveries]

    @staticmethod
    def entries_to_deliveries(source: GroupPartition, stream: str, entries: Iterable[Any]) -> list[Delivery]:
        """Turn raw XRANGE rows of ``stream`` into deliveries (used by DLQ tools and tests)."""
        out = []
        for entry_id, flat in entries:
            try:
                env: Envelope | None = decode_flat(flat, source.spec.name, source.spec.kind)
                err = None
            except DecodeError as exc:
                env, err = None, str(exc)
            out.append(Delivery(source, stream, text(entry_id), flat, env, err))
        return out
