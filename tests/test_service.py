"""Declaring services: signatures checked at import, payload types, names."""

from __future__ import annotations

import dataclasses
from typing import Any

import attrs
import pytest

from framework import Context, HandlerError, Queue, Service, Topic
from framework._payloads import PayloadError, decoder_for, encode_payload, type_name


@attrs.frozen
class Line:
    sku: str
    qty: int


@attrs.frozen
class Order:
    order_id: str
    lines: list[Line]
    note: str | None = None


def test_handlers_register_with_their_options() -> None:
    svc = Service("billing")

    @svc.event(Topic("orders.placed", partitions=3), key=lambda o: o.order_id, start="latest")
    async def charge(order: Order, ctx: Context) -> None: ...

    @svc.command("billing.refund")
    def refund(cmd: dict) -> None: ...

    [h1, h2] = svc.handlers
    assert (h1.name, h1.is_async, h1.takes_context) == ("charge", True, True)
    assert (h1.payload_type, h1.start) == (Order, "latest")
    assert h1.spec.partitions == 3 and h1.spec.kind == "event"
    assert (h2.is_async, h2.takes_context, h2.spec.kind) == (False, False, "command")
    assert h1.key is not None and h1.key(Order("o-1", [])) == "o-1"


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (lambda: None, r"takes \(payload\) or \(payload, ctx\), but its signature is \(\)"),
        (lambda a, b, c: None, r"signature is \(a, b, c\)"),
    ],
)
def test_bad_signatures_fail_at_declaration_naming_the_handler(fn: Any, message: str) -> None:
    svc = Service("billing")
    with pytest.raises(HandlerError, match=message) as err:
        svc.command("q")(fn)
    assert "billing.<lambda>" in str(err.value) and "'q'" in str(err.value)


def test_unresolvable_annotations_are_named() -> None:
    svc = Service("s")

    async def h(payload: NoSuchType) -> None: ...  # type: ignore[name-defined] # noqa: F821

    with pytest.raises(HandlerError, match=r"handler s\.h for 'q': cannot resolve its type hints"):
        svc.command("q")(h)


def test_keyword_only_parameters_are_refused() -> None:
    svc = Service("s")

    async def h(payload: dict, *, extra: int) -> None: ...

    with pytest.raises(HandlerError, match=r"handler s\.h for 'q'"):
        svc.command("q")(h)


class NotSerializable:
    pass


def test_unsupported_payload_type_fails_at_declaration() -> None:
    svc = Service("s")

    async def h(payload: NotSerializable) -> None: ...

    with pytest.raises(HandlerError, match="NotSerializable is not supported"):
        svc.command("q")(h)


def test_one_handler_per_destination_and_kind_checks() -> None:
    svc = Service("s")

    @svc.command("q")
    async def first(p: dict) -> None: ...

    with pytest.raises(HandlerError, match="already handles 'q'"):
        svc.command("q")(first)
    with pytest.raises(HandlerError, match="is a Topic"):
        svc.command(Topic("t"))  # type: ignore[arg-type]
    with pytest.raises(HandlerError, match="is a Queue"):
        svc.event(Queue("q2"))  # type: ignore[arg-type]
    with pytest.raises(HandlerError, match="invalid service name"):
        Service("bad name!")
    with pytest.raises(HandlerError, match="invalid destination name"):
        svc.command("has{braces}")


def test_payloads_round_trip_and_invalid_ones_name_the_field() -> None:
    order = Order("o-1", [Line("sku-1", 2)])
    body, content_type = encode_payload(order)
    assert content_type == "application/json"
    assert decoder_for(Order)(body) == order
    with pytest.raises(PayloadError, match=r"expected int @ payload\.lines\[0\]\.qty"):
        decoder_for(Order)(b'{"order_id":"o","lines":[{"sku":"a","qty":"two"}]}')
    with pytest.raises(PayloadError, match="body is not JSON"):
        decoder_for(dict)(b"\x00")
    assert decoder_for(bytes)(b"\x00raw") == b"\x00raw"
    assert type_name(order) == "Order" and type_name({}) == "json" and type_name(b"") == "bytes"


def test_dataclasses_and_message_type_names() -> None:
    @dataclasses.dataclass
    class Shipped:
        __message_type__ = "shipping.Shipped.v2"
        order_id: str

    assert type_name(Shipped("o")) == "shipping.Shipped.v2"
    assert decoder_for(Shipped)(encode_payload(Shipped("o"))[0]) == Shipped("o")
