"""A handler's payload decoding: the fast path gives exactly what the converter gives, or defers to it.

Every body below is decoded twice: by ``decoder_for`` (which takes the compiled fast path for
the common case) and by the converter alone (cattrs, the reference). Both must agree on the value
and its types, or both must fail with the same message naming the field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import attrs
import cattrs
import orjson
import pytest

from framework._fast_structure import fast_structure
from framework._payloads import _STRICT_HOOKS, PayloadError, _describe, converter, decoder_for
from tests.test_service import Line


@attrs.frozen
class Order:
    order_id: str
    total_cents: int
    rate: float
    paid: bool
    note: str | None = None
    lines: list[Line] = attrs.Factory(list)
    first: Line | None = None
    weight: float = 0  # an int default stays the int the class gives it (the converter does not convert it)


@attrs.define
class Checked:
    amount: int = attrs.field(validator=attrs.validators.ge(0))
    currency: str = attrs.field(kw_only=True, default="EUR")


@dataclasses.dataclass(frozen=True)
class Shipped:
    order_id: str
    parcels: int = 1
    tags: list[str] = dataclasses.field(default_factory=list)


def _reference(tp: type, body: bytes) -> tuple[str, Any]:
    """What the converter alone makes of ``body`` (the behaviour before the fast path): the value,
    or the message of the error ``decoder_for`` raises for it."""
    hook = converter.get_structure_hook(tp)
    try:
        return ("ok", hook(orjson.loads(body), tp))
    except Exception as exc:
        return ("error", f"payload does not match {tp.__name__}: {_describe(exc)}")


def _typed(value: Any) -> Any:
    """``value`` with the type of every field, so 5 and 5.0 or 1 and True do not compare equal."""
    if attrs.has(type(value)) or dataclasses.is_dataclass(value):
        items = attrs.asdict(value, recurse=False) if attrs.has(type(value)) else vars(value)
        return (type(value), {k: _typed(v) for k, v in items.items()})
    if isinstance(value, list):
        return [_typed(v) for v in value]
    return (type(value), value)


CASES: list[tuple[type, dict[str, Any]]] = [
    (Order, {"order_id": "o1", "total_cents": 500, "rate": 1.5, "paid": True}),
    (Order, {"order_id": "o1", "total_cents": 500, "rate": 2, "paid": False, "weight": 3}),  # ints for floats
    (Order, {"order_id": "o1", "total_cents": 500, "rate": 1.0, "paid": True, "note": None, "extra": [1]}),
    (Order, {"order_id": "o1", "total_cents": 500, "rate": 1.0, "paid": True, "lines": [{"sku": "a", "qty": 2}]}),
    (Order, {"order_id": "o1", "total_cents": 500, "rate": 1.0, "paid": True, "first": {"sku": "a", "qty": 2}}),
    (Order, {"order_id": "o1", "total_cents": True, "rate": 1.0, "paid": True}),  # a bool is not an int
    (Order, {"order_id": "o1", "total_cents": "500", "rate": 1.0, "paid": True}),  # nothing coerced
    (Order, {"order_id": 7, "total_cents": 500, "rate": 1.0, "paid": True}),
    (Order, {"order_id": "o1", "total_cents": 500, "rate": "1.0", "paid": True}),
    (Order, {"order_id": "o1", "total_cents": 500, "rate": 1.0, "paid": 1}),
    (Order, {"order_id": "o1", "total_cents": 500, "rate": 1.0}),  # missing field
    (Order, {"order_id": "o1", "total_cents": 500, "rate": 1.0, "paid": True, "note": 5}),
    (Order, {"order_id": "o1", "total_cents": 500, "rate": 1.0, "paid": True, "lines": [{"sku": "a", "qty": "2"}]}),
    (Order, {"order_id": "o1", "total_cents": 500, "rate": 1.0, "paid": True, "first": {"sku": "a"}}),
    (Checked, {"amount": 5}),
    (Checked, {"amount": 5, "currency": "USD"}),
    (Checked, {"amount": -1}),  # the class's own validator refuses it
    (Shipped, {"order_id": "o1"}),
    (Shipped, {"order_id": "o1", "parcels": 2, "tags": ["x"]}),
    (Shipped, {"order_id": "o1", "parcels": 2.5}),
]


@pytest.mark.parametrize(("tp", "raw"), CASES)
def test_a_payload_decodes_exactly_as_the_converter_decodes_it(tp: type, raw: dict[str, Any]) -> None:
    body = orjson.dumps(raw)
    outcome, expected = _reference(tp, body)
    if outcome == "ok":
        assert _typed(decoder_for(tp)(body)) == _typed(expected)
    else:
        with pytest.raises(PayloadError) as caught:
            decoder_for(tp)(body)
        assert str(caught.value) == expected


def test_a_wrong_field_is_still_named_in_the_error() -> None:
    with pytest.raises(PayloadError, match=r"expected int @ payload\.total_cents"):
        decoder_for(Order)(b'{"order_id":"o","total_cents":"x","rate":1.0,"paid":true}')
    with pytest.raises(PayloadError, match=r"@ payload\.lines\[0\]\.qty"):
        decoder_for(Order)(b'{"order_id":"o","total_cents":1,"rate":1.0,"paid":true,"lines":[{"sku":"a","qty":1.5}]}')
    with pytest.raises(PayloadError, match=r"payload does not match Checked: invalid value @ payload"):
        decoder_for(Checked)(b'{"amount":-1}')  # the class's own validator, reported as before


def test_plain_payload_classes_get_the_fast_path() -> None:
    """A cattrs upgrade that changed how its generated hooks look would silently lose the fast path."""
    for tp in (Order, Line, Checked, Shipped):
        fast = fast_structure(tp, converter, _STRICT_HOOKS)
        assert fast is not None, tp
    fast = fast_structure(Order, converter, _STRICT_HOOKS)
    assert fast is not None
    assert fast({"order_id": "o", "total_cents": 1, "rate": 2, "paid": True}).rate == 2.0


def test_a_class_with_a_hook_of_its_own_keeps_its_hook() -> None:
    @attrs.frozen
    class Money:
        cents: int

    local = cattrs.Converter()
    local.register_structure_hook(Money, lambda value, _: Money(int(value["amount"] * 100)))
    assert fast_structure(Money, local, {}) is None


def test_a_scalar_hook_registered_by_the_user_is_used_for_its_fields() -> None:
    @attrs.frozen
    class Tagged:
        name: str

    local = cattrs.Converter()
    local.register_structure_hook(str, lambda value, _: str(value).upper())
    fast = fast_structure(Tagged, local, {str: object()})  # the strict hook is not the one registered
    assert fast is not None
    assert fast({"name": "abc"}) == Tagged("ABC")
