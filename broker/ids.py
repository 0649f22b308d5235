"""Message ids: time-ordered UUIDv7 for new messages, deterministic ids for derived ones.

A new id is a UUIDv7 (RFC 9562): 48 bits of Unix milliseconds, a 12-bit counter that keeps ids
from one process strictly increasing within a millisecond, and 62 random bits. A derived id (a
message a handler sends while processing another) keeps its parent's millisecond prefix, so it
sorts near its cause, and fills the rest from a hash of the parent id and a salt: the same parent
and salt always give the same id, which is what lets downstream inboxes drop re-sent copies.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time

__all__ = ["derive_id", "id_time_ms", "new_id"]

_lock = threading.Lock()
_last_ms = 0
_counter = 0


def _format(value: int) -> str:
    h = f"{value:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def new_id() -> str:
    """Return a new UUIDv7 string; ids from one process are strictly increasing."""
    global _last_ms, _counter
    rand = int.from_bytes(os.urandom(8), "big")
    with _lock:
        ms = time.time_ns() // 1_000_000
        if ms > _last_ms:
            _last_ms = ms
            _counter = rand >> 52  # random start leaves room to count up inside one millisecond
        else:
            _counter += 1
            if _counter > 0xFFF:  # counter exhausted: borrow the next millisecond
                _last_ms += 1
                _counter = 0
            ms = _last_ms
        counter = _counter
    value = (ms << 80) | (0x7 << 76) | (counter << 64) | (0b10 << 62) | (rand & ((1 << 62) - 1))
    return _format(value)


def derive_id(parent_id: str, salt: str) -> str:
    """Return the id of a message derived from ``parent_id``: the same inputs give the same id.

    The result is a UUIDv8 that keeps the parent's 48-bit millisecond prefix (when the parent is
    a UUID) so that derived ids stay roughly time-ordered.
    """
    digest = int.from_bytes(hashlib.blake2b(f"{parent_id}\x1f{salt}".encode(), digest_size=16).digest(), "big")
    try:
        ms = int(parent_id.replace("-", "")[:12], 16)
    except ValueError:
        ms = digest >> 80
    low = digest & ((1 << 80) - 1)
    value = (ms << 80) | low
    value = (value & ~(0xF << 76)) | (0x8 << 76)  # version 8: custom
    value = (value & ~(0b11 << 62)) | (0b10 << 62)  # RFC 9562 variant
    return _format(value)


def id_time_ms(message_id: str) -> int | None:
    """Return the Unix milliseconds a UUIDv7/derived id carries, or None for other ids."""
    try:
        return int(message_id.replace("-", "")[:12], 16)
    except ValueError:
        return None
