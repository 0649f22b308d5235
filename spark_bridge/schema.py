"""Typed columns: the Spark schema of an attrs payload class, and parsing payload JSON into it.

A payload class is encoded the way the framework publishes it (cattrs' orjson converter), so::

    str, UUID, bytes (base85 text), Any      -> string        int          -> bigint
    float                                     -> double        bool         -> boolean
    datetime (RFC 3339 text)                  -> timestamp     date         -> date
    Enum, Literal                             -> the type of their values
    list[X], tuple[X, ...], set[X], Sequence  -> array<X>      dict[str, X] -> map<string, X>
    nested attrs class or dataclass           -> struct        X | None     -> X (every column is nullable)

:func:`payload_schema` gives that schema; :func:`parse_payload` applies it with ``from_json``; the
``eventlog`` source's ``payloadClass`` option parses in the reader instead (:func:`value_converter`).
"""

from __future__ import annotations

import collections.abc as cabc
import dataclasses
import datetime as dt
import enum
import types
import typing
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import attrs
import orjson
from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    DataType,
    DateType,
    DoubleType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["parse_payload", "payload_schema", "value_converter"]

_SCALARS: dict[Any, DataType] = {
    str: StringType(),
    uuid.UUID: StringType(),
    bytes: StringType(),
    Any: StringType(),
    object: StringType(),
    int: LongType(),
    float: DoubleType(),
    bool: BooleanType(),
    dt.datetime: TimestampType(),
    dt.date: DateType(),
}
_SEQUENCES = {list, tuple, set, frozenset, cabc.Sequence, cabc.MutableSequence, cabc.Set, cabc.MutableSet}
_MAPPINGS = {dict, cabc.Mapping, cabc.MutableMapping}


def _fields(cls: type) -> list[tuple[str, Any]]:
    try:
        hints = typing.get_type_hints(cls)
    except NameError as exc:  # string annotations naming something not importable from the class's module
        raise TypeError(
            f"cannot resolve the annotations of {cls.__name__}: {exc}; define the types it uses at module level"
        ) from None
    if attrs.has(cls):
        return [(f.name, hints.get(f.name, f.type)) for f in attrs.fields(cls)]
    return [(f.name, hints.get(f.name, f.type)) for f in dataclasses.fields(cls)]


def _data_type(tp: Any, where: str) -> DataType:
    if tp in _SCALARS:
        return _SCALARS[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        real = [a for a in args if a is not type(None)]
        if len(real) == 1:
            return _data_type(real[0], where)
        raise TypeError(f"{where}: a union of several types ({tp}) has no single Spark type; use one type")
    if origin is typing.Literal:
        return _data_type(type(args[0]), where)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _data_type(type(next(iter(tp)).value), where)
    if origin in _SEQUENCES or tp in _SEQUENCES:
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis) and len(set(args)) > 1:
            raise TypeError(f"{where}: a tuple of mixed types ({tp}) has no Spark type; use tuple[X, ...]")
        item = args[0] if args else Any
        return ArrayType(_data_type(item, f"{where}[]"), containsNull=True)
    if origin in _MAPPINGS or tp in _MAPPINGS:
        value = args[1] if len(args) == 2 else Any
        return MapType(StringType(), _data_type(value, f"{where}{{}}"), valueContainsNull=True)
    if isinstance(tp, type) and (attrs.has(tp) or dataclasses.is_dataclass(tp)):
        return payload_schema(tp, _where=where)
    raise TypeError(
        f"{where}: type {tp!r} has no Spark column type; use str, int, float, bool, datetime, date, UUID, enums, "
        "lists, dicts with str keys, or nested attrs classes"
    )


def payload_schema(cls: type, *, _where: str = "") -> StructType:
    """The Spark schema of attrs (or dataclass) payload class ``cls``: one nullable column per field."""
    if not isinstance(cls, type) or not (attrs.has(cls) or dataclasses.is_dataclass(cls)):
        raise TypeError(f"payload_schema() needs an attrs class or a dataclass, not {cls!r}")
    prefix = _where or cls.__name__
    return StructType(
        [StructField(name, _data_type(tp, f"{prefix}.{name}"), nullable=True) for name, tp in _fields(cls)]
    )


def parse_payload(df: DataFrame, cls: type, *, column: str = "payload", prefix: str = "") -> DataFrame:
    """``df`` with the fields of ``cls`` parsed from JSON ``column`` as top-level columns (``prefix`` + name).

    Rows whose payload is not JSON or does not fit get nulls, as ``from_json`` gives.
    """
    from pyspark.sql import functions as F

    schema = payload_schema(cls)
    clashes = sorted({prefix + f.name for f in schema.fields} & set(df.columns))
    if clashes:
        raise ValueError(f"payload field(s) {', '.join(clashes)} clash with existing columns; pass prefix='p_'")
    parsed = F.from_json(F.col(column), schema, {"mode": "PERMISSIVE"})
    return df.select("*", *(parsed[f.name].alias(prefix + f.name) for f in schema.fields))


# -- parsing in the reader: JSON values -> Python values pyarrow accepts for the Arrow type -------------


def _as_string(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return orjson.dumps(value).decode()


def _as_long(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63:
        return value
    return None


def _as_double(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _as_bool(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _as_timestamp(value: Any) -> dt.datetime | None:
    try:
        if isinstance(value, str):
            when = dt.datetime.fromisoformat(value)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            when = dt.datetime.fromtimestamp(value, tz=dt.UTC)  # numbers are seconds, as from_json reads them
        else:
            return None
    except (ValueError, OverflowError, OSError):
        return None
    return when if when.tzinfo is not None else when.replace(tzinfo=dt.UTC)


def _as_date(value: Any) -> dt.date | None:
    if not isinstance(value, str):
        return None
    try:
        return dt.date.fromisoformat(value[:10])
    except ValueError:
        return None


def value_converter(data_type: DataType) -> Callable[[Any], Any]:
    """A function turning one decoded JSON value into what Arrow takes for ``data_type`` (None if it does not fit)."""
    if isinstance(data_type, StringType):
        return _as_string
    if isinstance(data_type, LongType):
        return _as_long
    if isinstance(data_type, DoubleType):
        return _as_double
    if isinstance(data_type, BooleanType):
        return _as_bool
    if isinstance(data_type, TimestampType):
        return _as_timestamp
    if isinstance(data_type, DateType):
        return _as_date
    if isinstance(data_type, ArrayType):
        item = value_converter(data_type.elementType)
        return lambda v: [item(x) for x in v] if isinstance(v, list) else None
    if isinstance(data_type, MapType):
        val = value_converter(data_type.valueType)
        return lambda v: [(str(k), val(x)) for k, x in v.items()] if isinstance(v, Mapping) else None
    if isinstance(data_type, StructType):
        fields = [(f.name, value_converter(f.dataType)) for f in data_type.fields]
        return lambda v: {n: c(v.get(n)) for n, c in fields} if isinstance(v, Mapping) else None
    raise TypeError(f"no reader conversion for Spark type {data_type.simpleString()}; use parse_payload instead")
