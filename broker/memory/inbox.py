"""A group's inbox in memory: leases of running messages and processed ids, as the Redis inbox scripts keep them.

The Redis inbox (``broker/redis/lua/inbox_claim.lua``, ``ack.lua``, ``inbox_store.lua``) keeps leases in a
zset (score ``-expiry``), processed UUIDv7/v8 ids in buckets that expire a dedup window after their last
write, and other processed ids in the zset (score = when, until ``trim_inbox`` drops them). This class
keeps the same three sets; a bucketed record expires a window after the ack that wrote it.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

__all__ = ["DEFAULT_WINDOW_MS", "Inbox", "bucketed"]

DEFAULT_WINDOW_MS = 7 * 24 * 3600 * 1000
"""The dedup window until an inbox claim stores the group's own (as in ``inbox_store.lua``)."""

_HEX = frozenset("0123456789abcdefABCDEF")


def bucketed(message_id: str) -> bool:
    """Whether Redis keeps ``message_id``'s record in the expiring buckets (a UUIDv7/v8 text id), not
    in the zset that ``trim_inbox`` trims (mirrors ``broker.redis.keys.compact_id``)."""
    if len(message_id) != 36 or message_id[14] not in "78":
        return False
    digits = message_id.replace("-", "")
    return len(digits) == 32 and set(digits) <= _HEX


@attrs.define(slots=True)
class Inbox:
    """Leases (id -> expiry, Unix ms), final records of other ids (id -> when) and bucketed records
    (id -> expiry, Unix ms); an id is in at most one of ``leases`` and ``final``."""

    window_ms: int = 0  # the group's dedup window (0: none stored yet, DEFAULT_WINDOW_MS applies)
    leases: dict[str, int] = attrs.field(factory=dict)
    final: dict[str, int] = attrs.field(factory=dict)
    records: dict[str, int] = attrs.field(factory=dict)

    def processed(self, message_id: str, now: int) -> bool:
        """Whether ``message_id`` was recorded as processed (and its record has not expired)."""
        if message_id in self.final:
            return True
        expiry = self.records.get(message_id)
        if expiry is None:
            return False
        if expiry <= now:
            del self.records[message_id]
            return False
        return True

    def claim(self, ids: Sequence[str], first: int, lease_ms: int, now: int, window_ms: int) -> list[int]:
        """inbox_claim.lua: per id 0 leased to the caller, 1 processed, 2 leased elsewhere (a live lease and a
        first delivery, the ids before ``first``; or a second copy in this batch)."""
        if window_ms:
            self.window_ms = window_ms
        out: list[int] = []
        taken: set[str] = set()
        for i, message_id in enumerate(ids):
            lease = self.leases.get(message_id)
            if self.processed(message_id, now):
                out.append(1)
            elif (lease is not None and lease > now and i < first) or message_id in taken:
                out.append(2)
            else:
                taken.add(message_id)
                self.leases[message_id] = now + lease_ms
                out.append(0)
        return out

    def record(self, message_ids: Sequence[str], now: int) -> None:
        """Make ``message_ids`` final (ack.lua with the inbox): their leases go."""
        expiry = now + (self.window_ms or DEFAULT_WINDOW_MS)
        for message_id in message_ids:
            self.leases.pop(message_id, None)
            if bucketed(message_id):
                self.records[message_id] = expiry
            else:
                self.final[message_id] = now

    def release(self, message_id: str) -> None:
        """Drop ``message_id``'s lease if it holds one (dead letter, retry later); a record stays."""
        self.leases.pop(message_id, None)

    def extend(self, message_id: str, expiry: int) -> None:
        """Push out ``message_id``'s lease, if it holds one, to ``expiry``."""
        if message_id in self.leases:
            self.leases[message_id] = expiry

    def trim(self, older_than_ms: int, now: int) -> int:
        """Forget zset records made at or before ``older_than_ms`` and leases that expired; return how many
        went (bucketed records expired by now are dropped too, uncounted: Redis expires them by itself)."""
        old = [i for i, at in self.final.items() if at <= older_than_ms]
        expired = [i for i, until in self.leases.items() if until < now]
        for message_id in old:
            del self.final[message_id]
        for message_id in expired:
            del self.leases[message_id]
        for message_id in [i for i, until in self.records.items() if until <= now]:
            del self.records[message_id]
        return len(old) + len(expired)

    def __bool__(self) -> bool:
        return bool(self.leases or self.final or self.records)
