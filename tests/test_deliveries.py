"""A stream read's reply into deliveries: the inline common case decodes exactly as decode_flat does.

The entries are what the framework's own encoder writes (``encode_fields``), as XREADGROUP returns
them (flat field/value lists of bytes), plus the malformed ones a worker must dead-letter.
"""

from __future__ import annotations

from typing import Any

import pytest

from broker import Envelope
from broker.codec import decode_flat, encode_fields
from broker.protocol import DestinationSpec, GroupPartition
from broker.redis.deliveries import deliveries_of


def _source() -> GroupPartition:
    return GroupPartition(DestinationSpec("shop.orders", "command"), 0, "billing", "t:{shop.orders:0}", None)


def _flat(env: Envelope) -> list[bytes]:
    return [x if isinstance(x, bytes) else str(x).encode() for x in encode_fields(env)]


def _env(**kw: Any) -> Envelope:
    return Envelope(destination="shop.orders", kind="command", type="OrderPlaced", body=b'{"a":1}', **kw)


ENTRIES: list[list[bytes]] = [
    _flat(_env()),
    _flat(_env(key="order-7")),
    _flat(_env(key="order-7", headers={"traceparent": "00-abc-def-01"})),
    _flat(_env(headers={"content-type": "application/json"})),
    _flat(_env(attempt=3)),
    _flat(_env(key="k\u00e9y")),
    [b"id", b"m1", b"type", b"T", b"body", b"{}", b"ts", b"not-a-number"],
    [b"id", b"\xff\xfe", b"type", b"T", b"body", b"{}", b"ts", b"1"],
    [b"id", b"m1", b"type", b"T", b"body", b"{}", b"ts", b"1", b"key", b"\xff"],
    [b"type", b"T", b"id", b"m1", b"body", b"{}", b"ts", b"1"],  # another field order
    [b"id", b"m1", b"body", b"{}"],
    [b"id", b"m1", b"type", b"T", b"body", b"x" * 100, b"ts", b"1"],  # over the limit below
]


@pytest.mark.parametrize("flat", ENTRIES)
def test_each_entry_becomes_what_decode_flat_makes_of_it(flat: list[bytes]) -> None:
    source = _source()
    [d] = deliveries_of(source, [[b"s", [(b"1-0", flat)]]], max_body=64, counts={"1-0": 2})
    assert (d.stream, d.entry_id, d.raw, d.delivery_count) == ("s", "1-0", flat, 2)
    try:
        expected = decode_flat(flat, "shop.orders", "command", 64)
    except Exception as exc:
        assert d.envelope is None and d.error == str(exc)  # the reason the dead letter carries
    else:
        assert d.error is None and d.envelope == expected


def test_a_reply_keeps_its_order_its_streams_and_its_deleted_entries() -> None:
    first, second = _flat(_env(id="a")), _flat(_env(id="b", key="k"))
    reply = [[b"part", [(b"1-0", first), (b"2-0", None)]], [b"redeliver", [(b"3-0", second)]]]
    out = deliveries_of(_source(), reply)
    assert [(d.stream, d.entry_id, d.message_id) for d in out] == [
        ("part", "1-0", "a"),
        ("part", "2-0", ""),
        ("redeliver", "3-0", "b"),
    ]
    assert out[1].error == "entry was deleted while pending"
    assert out[2].envelope is not None and out[2].envelope.key == "k"
    assert deliveries_of(_source(), None) == [] and deliveries_of(_source(), {}) == []
    assert [d.entry_id for d in deliveries_of(_source(), {b"part": [(b"1-0", first)]})] == ["1-0"]  # RESP3
