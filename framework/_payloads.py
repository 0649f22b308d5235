"""Payloads: typed Python values <-> message bodies (orjson JSON; attrs classes through cattrs).

A handler declares the type it wants (an attrs class, a dataclass, a Pydantic v2 model, ``dict``,
``list``, ``bytes``, ``str`` or any type cattrs can structure); the body is decoded and structured
into it before the handler runs. A body that is not JSON or does not fit the type raises
:class:`PayloadError` whose message names the field, which sends the message to the dead-letter queue.

Pydantic is never imported here: a class is a Pydantic model only if ``pydantic`` is already
imported (a model's module imported it), so services without Pydantic do not need it installed.
Models are validated by Pydantic itself (their own config: strict or lax) and encoded with
``model_dump_json(by_alias=True)``, so what one service encodes the other validates.

Internal apart from :data:`converter` and :class:`PayloadError`, which users import from
:mod:`framework`.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import sys
import uuid
from collections.abc import Callable
from typing import Any

import attrs
import cattrs
import orjson
from cattrs.preconf.orjson import make_converter

from framework._fast_structure import fast_structure

__all__ = [
    "JSON_CONTENT_TYPE",
    "RAW_CONTENT_TYPE",
    "PayloadError",
    "converter",
    "decoder_for",
    "encode_payload",
    "type_name",
]

JSON_CONTENT_TYPE = "application/json"
RAW_CONTENT_TYPE = "application/octet-stream"

converter: cattrs.Converter = make_converter(forbid_extra_keys=False)
"""The converter used for every payload; register hooks on it for custom types."""

_STRICT_HOOKS: dict[type, Any] = {}


def _strict(tp: type, accepts: tuple[type, ...], rejects: tuple[type, ...] = ()) -> None:
    """Refuse silent coercion (cattrs would turn 5 into "5"): a payments payload must be exact."""

    def hook(value: Any, _: Any) -> Any:
        # tested apart so that ``value`` stays Any for float() (isinstance in the if would narrow it to object)
        exact = isinstance(value, accepts) and not isinstance(value, rejects)
        if exact:
            return value if tp is not float else float(value)
        raise ValueError(f"expected {tp.__name__}, got {type(value).__name__} {value!r}")

    converter.register_structure_hook(tp, hook)
    _STRICT_HOOKS[tp] = hook


_strict(str, (str,))
_strict(int, (int,), (bool,))
_strict(float, (int, float), (bool,))
_strict(bool, (bool,))


class PayloadError(ValueError):
    """A message body is not valid JSON or does not match the handler's payload type."""


def type_name(payload: Any) -> str:
    """The ``type`` recorded in an envelope: ``__message_type__`` if the class sets it, else its name."""
    cls = type(payload)
    name = getattr(cls, "__message_type__", None)
    if isinstance(name, str):
        return name
    if cls is dict:
        return "json"
    if cls in (bytes, bytearray, memoryview):
        return "bytes"
    return cls.__name__


def is_pydantic_model(tp: Any) -> bool:
    """Whether ``tp`` is a Pydantic v2 model class (False, without importing it, when Pydantic is not loaded)."""
    pydantic = sys.modules.get("pydantic")
    return pydantic is not None and isinstance(tp, type) and issubclass(tp, pydantic.BaseModel)


def encode_payload(payload: Any) -> tuple[bytes, str]:
    """Body bytes and content type of ``payload``; bytes pass through untouched."""
    if isinstance(payload, bytes | bytearray | memoryview):
        return bytes(payload), RAW_CONTENT_TYPE
    if isinstance(payload, dict | list | str | int | float | bool) or payload is None:
        return orjson.dumps(payload), JSON_CONTENT_TYPE
    if is_pydantic_model(type(payload)):
        try:
            return payload.model_dump_json(by_alias=True).encode(), JSON_CONTENT_TYPE
        except ValueError as exc:  # pydantic_core.PydanticSerializationError
            raise TypeError(f"cannot encode a {type(payload).__name__} payload as JSON: {exc}") from None
    try:
        return orjson.dumps(converter.unstructure(payload)), JSON_CONTENT_TYPE
    except TypeError as exc:
        raise TypeError(f"cannot encode a {type(payload).__name__} payload as JSON: {exc}") from None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, cattrs.BaseValidationError):
        return "; ".join(cattrs.transform_error(exc, path="payload"))
    return f"{type(exc).__name__}: {exc}"


def decoder_for(tp: Any) -> Callable[[bytes], Any]:
    """A function turning a body into ``tp``, raising :class:`PayloadError` with the reason.

    Raises ``TypeError`` at once if cattrs cannot structure ``tp`` at all, so a handler with an
    unusable payload type fails at registration, not at its first message.
    """
    if tp is bytes:
        return bytes
    if tp is Any or tp is object:

        def decode_any(body: bytes) -> Any:
            try:
                return orjson.loads(body)
            except orjson.JSONDecodeError as exc:
                raise PayloadError(f"body is not JSON: {exc}") from None

        return decode_any
    if is_pydantic_model(tp):
        return _pydantic_decoder(tp)
    is_class = isinstance(tp, type)
    if (
        is_class
        and not (attrs.has(tp) or dataclasses.is_dataclass(tp))
        and tp not in (dict, list, str, int, float, bool, dt.datetime, dt.date, uuid.UUID)
    ):
        raise TypeError(
            f"payload type {tp.__name__} is not supported: use an attrs class, a dataclass, a Pydantic model, "
            "dict, list, bytes, str or a type registered on framework._payloads.converter"
        )
    hook = converter.get_structure_hook(tp)
    fast = fast_structure(tp, converter, _STRICT_HOOKS) if is_class else None

    def decode(body: bytes) -> Any:
        try:
            raw = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise PayloadError(f"body is not JSON: {exc}") from None
        if fast is not None:
            try:
                return fast(raw)
            except Exception:  # not the common case as is: the converter decides (and names the field)
                pass
        try:
            return hook(raw, tp)
        except Exception as exc:
            raise PayloadError(f"payload does not match {getattr(tp, '__name__', tp)}: {_describe(exc)}") from None

    return decode


def _pydantic_path(loc: tuple[int | str, ...]) -> str:
    """``payload.items[0].sku`` for Pydantic's error location ``("items", 0, "sku")``."""
    return "payload" + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc)


def _pydantic_decoder(tp: Any) -> Callable[[bytes], Any]:
    """Validation by the model itself (one parse, in Rust); its errors named by field, as cattrs' are."""
    from pydantic import ValidationError  # loaded already: tp is a model

    validate = tp.model_validate_json
    name = tp.__name__

    def decode(body: bytes) -> Any:
        try:
            return validate(body)
        except ValidationError as exc:
            errors = exc.errors(include_url=False, include_input=False)
            if errors and errors[0]["type"] == "json_invalid":
                raise PayloadError(f"body is not JSON: {errors[0]['msg']}") from None
            reasons = "; ".join(f"{e['msg']} @ {_pydantic_path(e['loc'])}" for e in errors)
            raise PayloadError(f"payload does not match {name}: {reasons}") from None

    return decode
