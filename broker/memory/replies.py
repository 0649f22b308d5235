"""Reply destinations in memory (the ``replies`` capability): one list per requester, with an expiry.

The same idea as the Redis transport's reply streams (``broker/redis/replies.py``): created by
:meth:`Replies.open_replies` with an expiry the requester pushes back while it lives; a reply is
stored only while its destination exists; an expired destination is gone with its replies.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import attrs

from broker.envelope import Envelope
from broker.errors import ConfigurationError
from broker.memory.core import MemoryCore
from broker.memory.streams import wall_ms

__all__ = ["ReplyBox", "Replies"]


@attrs.define(slots=True, eq=False)
class ReplyBox:
    """One reply destination: its replies after a sequence number, when it expires, its blocked reader."""

    expires: int  # Unix ms
    replies: list[tuple[int, Envelope]] = attrs.field(factory=list)
    sequence: int = 0
    waiter: anyio.Event = attrs.field(factory=anyio.Event)


class Replies(MemoryCore):
    """The ``replies`` capability (:class:`broker.capabilities.ReplyStore`) in this process."""

    def _boxes(self) -> dict[str, ReplyBox]:
        boxes: dict[str, ReplyBox] = self.server.replies
        return boxes

    def _box(self, name: str) -> ReplyBox | None:
        """Reply destination ``name`` (namespaced), dropped first if it expired."""
        boxes = self._boxes()
        key = f"{self._namespace}:reply:{name}"
        box = boxes.get(key)
        if box is not None and box.expires <= wall_ms():
            del boxes[key]
            box.waiter.set()
            return None
        return box

    async def open_replies(self, name: str, ttl_ms: int) -> None:
        """Create reply destination ``name`` (empty) if needed; it expires ``ttl_ms`` from now."""
        if ttl_ms <= 0:
            raise ConfigurationError(f"a reply destination's time to live must be positive, not {ttl_ms} ms")
        await anyio.lowlevel.checkpoint()
        box = self._box(name)
        if box is None:
            box = self._boxes()[f"{self._namespace}:reply:{name}"] = ReplyBox(expires=0)
        box.expires = wall_ms() + int(ttl_ms)

    async def send_replies(self, replies: Sequence[Envelope]) -> int:
        """Store each reply on its destination if it still exists; return how many were stored."""
        await anyio.lowlevel.checkpoint()
        stored = 0
        for reply in replies:
            box = self._box(reply.destination)
            if box is None:
                continue
            box.sequence += 1
            box.replies.append((box.sequence, attrs.evolve(reply, headers=dict(reply.headers))))
            box.waiter.set()
            stored += 1
        return stored

    async def read_replies(
        self, name: str, cursor: str, *, block_ms: int = 0, count: int = 100
    ) -> tuple[str, list[Envelope]]:
        """Replies stored after ``cursor``, waiting up to ``block_ms``, and the next cursor; read ones are removed."""
        after = int(cursor or 0) if (cursor or "0").isdigit() else 0
        box = self._box(name)
        if box is not None and not any(seq > after for seq, _ in box.replies) and block_ms > 0:
            if box.waiter.is_set():
                box.waiter = anyio.Event()
            with anyio.move_on_after(block_ms / 1000):
                await box.waiter.wait()
            box = self._box(name)
        else:
            await anyio.lowlevel.checkpoint()
        if box is None:
            return cursor, []
        taken = [(seq, env) for seq, env in box.replies if seq > after][:count]
        if not taken:
            return cursor, []
        last = taken[-1][0]
        box.replies = [(seq, env) for seq, env in box.replies if seq > last]
        return str(last), [env for _, env in taken]

    async def replies_exist(self, name: str) -> bool:
        """Whether reply destination ``name`` exists."""
        await anyio.lowlevel.checkpoint()
        return self._box(name) is not None

    async def close_replies(self, name: str) -> None:
        """Delete reply destination ``name`` now."""
        await anyio.lowlevel.checkpoint()
        box = self._boxes().pop(f"{self._namespace}:reply:{name}", None)
        if box is not None:
            box.waiter.set()
