"""The broker's administration role: dead letters (list, redrive, purge), unsubscribe, delete a destination.

Used by operators' tools (``framework dlq``, ``framework unsubscribe``/``delete``), never on the
message hot path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from redis.exceptions import ResponseError

from broker.envelope import now_ms
from broker.errors import ConfigurationError
from broker.protocol import GroupPartition
from broker.redis.core import text
from broker.redis.keys import INBOX_SLOT_MS, hashed_generations, inbox_slot
from broker.redis.topology import Topology
from broker.topology import DestinationSpec

__all__ = ["Administration"]


class Administration(Topology):
    """Inspects and repairs a group's dead letters; removes groups and destinations."""

    async def dead_letter_entries(
        self, view: GroupPartition, count: int | None = None
    ) -> list[tuple[str, dict[bytes, bytes]]]:
        """The group's dead letters on this partition, oldest first: (DLQ entry id, fields)."""
        args: list[Any] = ["XRANGE", view.keys.dlq, "-", "+"]
        if count is not None:
            args += ["COUNT", count]
        rows = await self.redis.execute_command(*args)
        return [(text(eid), dict(zip(flat[::2], flat[1::2], strict=True))) for eid, flat in rows]

    async def redrive(self, view: GroupPartition, dlq_entry_id: str) -> str | None:
        """Move one dead letter back to its group only, as a first attempt; None if it is gone."""
        reply = await self.scripts["redrive"](self.redis, [view.keys.dlq, view.keys.redeliver], [dlq_entry_id])
        return None if reply is None else text(reply)

    async def purge_dead_letters(self, view: GroupPartition, dlq_entry_ids: Sequence[str]) -> int:
        """Delete dead letters for good; returns how many existed."""
        if not dlq_entry_ids:
            return 0
        return int(await self.redis.xdel(view.keys.dlq, *dlq_entry_ids))

    async def delete_inbox(self, source: GroupPartition) -> int:
        """Delete the group's inbox on this partition: the zset and the buckets of every slot in the
        window (each slot lists its buckets; ids of older times, from a replay, expire by themselves).
        DEL, HGET and SMEMBERS only: no SCAN, the operator ACL stays small. Returns keys deleted."""
        base = source.keys.inbox
        raw = await self.redis.hget(f"{base}:info", "window")
        window = int(raw) if raw else 7 * 24 * 3600 * 1000
        now = now_ms()
        deleted = 0
        metas = [
            f"{base}:{inbox_slot(s * INBOX_SLOT_MS)}"
            for s in range((now - window) // INBOX_SLOT_MS - 1, now // INBOX_SLOT_MS + 2)
        ]
        pipe = self.redis.pipeline(transaction=False)
        for meta in metas:
            pipe.smembers(f"{meta}:k")
        for meta, names in zip(metas, await pipe.execute(), strict=True):
            listed = sorted(f"{base}:{text(n)}" for n in names)
            for i in range(0, len(listed), 1000):
                deleted += int(await self.redis.delete(*listed[i : i + 1000]))
            deleted += int(await self.redis.delete(meta, f"{meta}:k"))
        for start, bits, _ in hashed_generations(await self.redis.hget(f"{base}:h", "g")):  # ids kept by their hash
            for i in range(0, 1 << bits, 1000):  # (every bucket a generation may have: no list is kept)
                names = [f"{base}:h:{start:x}:{p:x}" for p in range(i, min(i + 1000, 1 << bits))]
                deleted += int(await self.redis.delete(*names))
        return deleted + int(await self.redis.delete(base, f"{base}:info", f"{base}:h"))

    async def unsubscribe(self, spec: DestinationSpec, group: str) -> None:
        """Remove ``group`` from every partition of ``spec`` with its retry, DLQ and inbox keys.

        No check here: workers still consuming crash on the missing group, and a group created
        again replays what the topic retains with its inbox gone. ``framework unsubscribe``
        refuses while consumers are alive and says what would replay.
        """
        for p in range(spec.partitions):
            view = self.group_partition(spec, p, group)
            for stream in (view.stream, view.keys.redeliver):
                with contextlib.suppress(ResponseError):
                    await self.redis.xgroup_destroy(stream, group)
            keys = view.keys
            await self.delete_inbox(view)
            await self.redis.delete(keys.redeliver, keys.delayed, keys.dlq, keys.inbox, keys.attempts, keys.lease)
        await self.redis.delete(self.keyspace.members(spec.name, group))
        await self.redis.hdel(self.keyspace.subscriptions, f"{spec.name}|{group}")

    async def delete_destination(self, spec: DestinationSpec, *, force: bool = False) -> int:
        """Delete ``spec`` and every key it has; return how many keys were deleted.

        Goes: each partition's stream, producer idempotency keys, scheduled messages (counted as
        stored entries) and recurring-job state, the retry, delayed,
        dead-letter, inbox and attempt keys of every group (registered, or present on a stream),
        then its registry entries (last, so an interrupted delete can be run again: ``unsubscribe``
        also drops its registry entry last). Refuses with ConfigurationError while a group is
        subscribed or entries are stored, unless ``force``. No SCAN: the ACL stays small.
        """
        groups = {g for d, g in await self.list_subscriptions() if d == spec.name}
        entries = 0
        for p in range(spec.partitions):
            stream = self.keyspace.partition(spec.name, p).stream
            groups |= {text(info["name"]) for info in await self.stream_groups(stream)}
            entries += int(await self.redis.xlen(stream))
            entries += int(await self.redis.zcard(self.keyspace.partition(spec.name, p).scheduled))  # scheduled too
        if (groups or entries) and not force:
            raise ConfigurationError(
                f"{spec.name!r} still has {len(groups)} consumer group(s) ({', '.join(sorted(groups)) or 'none'}) "
                f"and {entries} stored entr{'y' if entries == 1 else 'ies'}: unsubscribe the groups and let them "
                "drain first, or force the delete"
            )
        deleted = 0
        for p in range(spec.partitions):
            pkeys = self.keyspace.partition(spec.name, p)
            keys = {pkeys.stream, pkeys.published, pkeys.scheduled, pkeys.scheduled_envelopes, pkeys.job}
            for group in groups:
                g = pkeys.group(group)
                keys |= {g.redeliver, g.delayed, g.dlq, g.inbox, g.attempts}
                deleted += await self.delete_inbox(self.group_partition(spec, p, group))
            deleted += int(await self.redis.delete(*sorted(keys)))
            self._pkeys.pop((spec.name, p), None)
        for group in groups:
            await self.redis.hdel(self.keyspace.subscriptions, f"{spec.name}|{group}")
        await self.redis.hdel(self.keyspace.destinations, spec.name)
        self._specs.pop(spec.name, None)
        return deleted
