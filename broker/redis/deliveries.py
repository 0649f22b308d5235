"""Stream replies into deliveries: the entries an ``XREADGROUP``, ``XAUTOCLAIM`` or leased read returned.

Every message a worker handles passes through :func:`deliveries_of` once, so it is written for
that: the common entry (what :func:`broker.codec.encode_fields` writes for a message with no
headers and a first attempt: id, type, body, ts and perhaps key) is decoded inline, and anything
else, or anything in doubt, goes to :func:`broker.codec.decode_flat`, which names what is wrong.
An entry that cannot be decoded becomes a delivery with ``envelope`` None and the reason in
``error`` (the runtime dead-letters it); nothing is dropped.
"""

from __future__ import annotations

from typing import Any

from broker.codec import decode_flat
from broker.envelope import Envelope
from broker.errors import DecodeError
from broker.protocol import Delivery, GroupPartition
from broker.redis.core import text

__all__ = ["deliveries_of"]

_NO_LIMIT = 1 << 62  # a body limit of 0 means none


def deliveries_of(
    source: GroupPartition, reply: Any, max_body: int = 0, counts: dict[str, int] | None = None
) -> list[Delivery]:
    """The deliveries of a stream read's reply (``[[stream, [(entry id, fields), ...]], ...]``,
    or a map under RESP3), in order; ``counts`` maps entry ids to their delivery counts (default 1).

    A body over ``max_body`` bytes (0: no limit) is undecodable. (Measured on a 2-core VM: about
    1.2 µs per entry inline against 1.6 µs through a call of ``decode_flat`` per entry.)
    """
    out: list[Delivery] = []
    if not reply:
        return out
    name, kind = source.spec.name, source.spec.kind
    if isinstance(reply, dict):
        reply = list(reply.items())
    append = out.append
    limit = max_body or _NO_LIMIT
    for stream_name, entries in reply:
        stream = text(stream_name)
        for entry_id, flat in entries:
            eid = entry_id.decode()
            count = counts.get(eid, 1) if counts is not None else 1
            if flat is None:  # deleted from the stream while pending
                append(Delivery(source, stream, eid, [], None, "entry was deleted while pending", count))
                continue
            n = len(flat)
            if (
                (n == 8 or (n == 10 and flat[8] == b"key"))
                and flat[0] == b"id"
                and flat[2] == b"type"
                and flat[4] == b"body"
                and flat[6] == b"ts"
                and len(flat[5]) <= limit
            ):
                try:
                    env = Envelope(
                        name,
                        kind,
                        flat[3].decode(),
                        flat[5],
                        flat[9].decode() if n == 10 else None,
                        {},
                        flat[1].decode(),
                        int(flat[7]),
                        1,
                    )
                except (ValueError, UnicodeDecodeError):
                    pass  # decode_flat below names the problem
                else:
                    append(Delivery(source, stream, eid, flat, env, None, count))
                    continue
            try:
                append(Delivery(source, stream, eid, flat, decode_flat(flat, name, kind, limit), None, count))
            except DecodeError as exc:
                append(Delivery(source, stream, eid, flat, None, str(exc), count))
    return out
