"""The envelope: one message as the broker stores and delivers it, independent of any service."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Literal

import attrs

from broker.ids import new_id

__all__ = ["COMMAND", "EVENT", "Envelope", "Kind", "now_ms"]

Kind = Literal["command", "event"]
COMMAND: Kind = "command"
EVENT: Kind = "event"


def now_ms() -> int:
    """Current Unix time in milliseconds."""
    return time.time_ns() // 1_000_000


@attrs.define(slots=True, eq=True)
class Envelope:
    """A message: identity, routing, metadata and an opaque body.

    ``id`` is unique and time-ordered (UUIDv7 unless derived); ``destination`` names a queue
    (kind ``command``) or a topic (kind ``event``); ``key`` picks the partition and orders
    messages that share it; ``body`` is JSON bytes (orjson) unless the producer sent raw bytes;
    ``attempt`` is 1 on first publication and counts deliveries through the retry path.
    """

    destination: str
    kind: Kind
    type: str
    body: bytes
    key: str | None = None
    headers: dict[str, str] = attrs.field(factory=dict)
    id: str = attrs.field(factory=new_id)
    published_at: int = attrs.field(factory=now_ms)  # Unix ms
    attempt: int = 1

    @property
    def published_datetime(self) -> datetime:
        """``published_at`` as an aware UTC datetime."""
        return datetime.fromtimestamp(self.published_at / 1000, tz=UTC)
