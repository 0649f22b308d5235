"""Event rows: the columns every event has, and stream entries turned into Arrow record batches of them.

Entries are decoded the way :func:`broker.codec.decode_fields` reads them, column by column into
Arrow (far cheaper than Spark converting Python tuples). An entry that is not a valid envelope
does not fail the query and is not dropped: its row keeps what could be read, ``payload`` is null
and ``decode_error`` says what was wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import (
    IntegerType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from broker.codec import decode_fields
from broker.errors import DecodeError
from broker.headers import TRACEPARENT
from spark_bridge.schema import value_converter

__all__ = ["EVENT_SCHEMA", "BatchBuilder", "event_schema"]

_NO_HEADERS: dict[str, Any] = {}
# After id, type, body, ts (in that order), broker.codec.encode_fields writes key, headers, attempt when set.
_CODEC_TAILS = {
    (),
    (b"key",),
    (b"headers",),
    (b"attempt",),
    (b"key", b"headers"),
    (b"key", b"attempt"),
    (b"headers", b"attempt"),
    (b"key", b"headers", b"attempt"),
}
_TRACEPARENT_LENGTH = 55  # version 00: "00-" 32 hex "-" 16 hex "-" 2 hex

EVENT_SCHEMA = StructType(
    [
        StructField("event_id", StringType()),  # the envelope id (UUIDv7 unless derived)
        StructField("topic", StringType()),
        StructField("partition", IntegerType()),
        StructField("offset", StringType()),  # the stream entry id "ms-seq": order within the partition
        StructField("key", StringType()),
        StructField("type", StringType()),
        StructField("published_at", TimestampType()),  # UTC
        StructField("headers", MapType(StringType(), StringType())),
        StructField("payload", StringType()),  # the body as JSON text
        StructField("trace_id", StringType()),  # from the W3C traceparent header
        StructField("decode_error", StringType()),  # null unless the entry is not a valid envelope
    ]
)
"""The columns of every event row, in order."""


def event_schema(payload: StructType | None = None) -> StructType:
    """:data:`EVENT_SCHEMA`, followed by ``payload``'s fields as typed columns when given."""
    if payload is None:
        return EVENT_SCHEMA
    clashes = sorted(set(payload.fieldNames()) & set(EVENT_SCHEMA.fieldNames()))
    if clashes:
        raise ValueError(
            f"payload field(s) {', '.join(clashes)} clash with event columns of the same name; read without "
            "payloadClass and use spark_bridge.parse_payload(df, Class, prefix='p_') instead"
        )
    return StructType(EVENT_SCHEMA.fields + payload.fields)


def _strings(values: list[Any], errors: list[str | None], what: str) -> pa.Array:
    """bytes/None -> Arrow strings; a value that is not UTF-8 becomes null and is reported in ``errors``."""
    try:
        # binary then cast (which checks UTF-8) is some 30 times faster than building strings from bytes
        return pa.array(values, type=pa.binary()).cast(pa.string())
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        out = []
        for i, value in enumerate(values):
            try:
                out.append(value.decode() if isinstance(value, bytes) else value)
            except UnicodeDecodeError:
                out.append(None)
                errors[i] = errors[i] or f"field {what!r} is not UTF-8 text"
        return pa.array(out, type=pa.string())


def _published_at(values: list[Any], errors: list[str | None]) -> pa.Array:
    try:
        millis = pa.array(values, type=pa.binary()).cast(pa.string()).cast(pa.int64())
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        parsed: list[int | None] = []
        for i, value in enumerate(values):
            try:
                parsed.append(int(value) if value is not None else None)
            except ValueError:
                parsed.append(None)
                errors[i] = errors[i] or f"malformed envelope field: ts={value!r}"
        millis = pa.array(parsed, type=pa.int64())
    return pc.multiply(millis, 1000).cast(pa.timestamp("us", tz="UTC"))


class BatchBuilder:
    """Builds record batches of one partition's entries, in the exact Arrow schema Spark expects."""

    def __init__(self, schema: StructType, topic: str, partition: int) -> None:
        self.topic = topic
        self.partition = partition
        self.arrow_schema = to_arrow_schema(schema, timezone="UTC")
        extra = schema.fields[len(EVENT_SCHEMA.fields) :]
        self.typed = [(f.name, value_converter(f.dataType), self.arrow_schema.field(f.name).type) for f in extra]
        self.headers_type = self.arrow_schema.field("headers").type

    def build(self, entries: Sequence[Any]) -> pa.RecordBatch:
        """One batch from raw XRANGE rows ``[[id, [field, value, ...]], ...]`` (bytes, RESP2)."""
        # Column by column with comprehensions: per-row Python code is what limits a Python source.
        n = len(entries)
        errors: list[str | None] = [None] * n
        offsets = [e[0] for e in entries]
        flats = [e[1] for e in entries]
        odd = [
            i
            for i, f in enumerate(flats)
            if not (
                len(f) >= 8
                and f[0] == b"id"
                and f[2] == b"type"
                and f[4] == b"body"
                and f[6] == b"ts"
                and ((len(f) == 12 and f[8] == b"key" and f[10] == b"headers") or tuple(f[8::2]) in _CODEC_TAILS)
            )
        ]
        if odd:
            flats = list(flats)
            for i in odd:
                flats[i] = self._canonical(flats[i], i, errors)
        keys = [f[9] if len(f) > 9 and f[8] == b"key" else None for f in flats]
        raw_headers = [
            f[11] if len(f) > 11 and f[10] == b"headers" else f[9] if len(f) > 9 and f[8] == b"headers" else None
            for f in flats
        ]
        bodies = [f[5] for f in flats]
        headers, trace_ids = self._headers(raw_headers, errors)
        columns = [
            _strings([f[1] for f in flats], errors, "id"),
            pa.array([self.topic] * n, type=pa.string()),
            pa.array([self.partition] * n, type=pa.int32()),
            pa.array(offsets, type=pa.binary()).cast(pa.string()),
            _strings(keys, errors, "key"),
            _strings([f[3] for f in flats], errors, "type"),
            _published_at([f[7] for f in flats], errors),
            headers,
            _strings(bodies, errors, "body"),
            trace_ids,
        ]
        if any(errors):  # an entry that is not a valid envelope keeps its row, without a payload
            invalid = pa.array([e is not None for e in errors], type=pa.bool_())
            columns[8] = pc.if_else(invalid, pa.scalar(None, pa.string()), columns[8])
        typed = self._typed(bodies, errors) if self.typed else []
        columns.append(pa.array(errors, type=pa.string()))
        return pa.RecordBatch.from_arrays(columns + typed, schema=self.arrow_schema)

    def _canonical(self, flat: list[Any], i: int, errors: list[str | None]) -> list[Any]:
        """An entry in another field order (or invalid), rewritten in codec order; its error noted."""
        fields = dict(zip(flat[::2], flat[1::2], strict=False))
        try:
            decode_fields(fields, self.topic, "event")
        except DecodeError as exc:
            errors[i] = str(exc)
        out: list[Any] = []
        for name in (b"id", b"type", b"body", b"ts", b"key", b"headers"):
            out += (name, fields.get(name))
        return out

    def _headers(self, raw: list[bytes | None], errors: list[str | None]) -> tuple[pa.Array, pa.Array]:
        loads = orjson.loads
        try:
            parsed = [loads(h) if h is not None else None for h in raw]
        except orjson.JSONDecodeError:
            parsed = []
            for i, blob in enumerate(raw):
                try:
                    parsed.append(loads(blob) if blob is not None else None)
                except orjson.JSONDecodeError as exc:
                    parsed.append(None)
                    errors[i] = errors[i] or f"malformed envelope field: {exc}"
        for i, value in enumerate(parsed):
            if value is not None and type(value) is not dict:
                errors[i] = errors[i] or "field 'headers' is not a JSON object"
        dicts = [h if type(h) is dict else _NO_HEADERS for h in parsed]
        names = [k for h in dicts for k in h]
        values = [v for h in dicts for v in h.values()]
        try:
            value_array = pa.array(values, type=pa.string())
        except (pa.ArrowInvalid, pa.ArrowTypeError):  # a header that is not a string: keep it as JSON text
            value_array = pa.array(
                [v if isinstance(v, str) else orjson.dumps(v).decode() for v in values], type=pa.string()
            )
        array = pa.MapArray.from_arrays(
            pa.array([0, *accumulate(map(len, dicts))], type=pa.int32()),
            pa.array(names, type=pa.string()),
            value_array,
            type=self.headers_type,
        )
        parents = [h.get(TRACEPARENT) for h in dicts]
        try:
            parent_array = pa.array(parents, type=pa.string())
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            parent_array = pa.array([p if isinstance(p, str) else None for p in parents], type=pa.string())
        # traceparent is version-traceid-spanid-flags: the trace id is the second field
        if pc.all(pc.equal(pc.utf8_length(parent_array), _TRACEPARENT_LENGTH)).as_py() is not False:
            trace_ids = pc.utf8_slice_codeunits(parent_array, 3, 35)  # all version 00: cut, no regex needed
        else:
            trace_ids = pc.extract_regex(parent_array, r"^[^-]*-(?P<trace>[^-]*)-[^-]*-").field("trace")
        return array, trace_ids

    def _typed(self, bodies: list[bytes | None], errors: list[str | None]) -> list[pa.Array]:
        columns: list[list[Any]] = [[] for _ in self.typed]
        loads = orjson.loads
        for body, error in zip(bodies, errors, strict=True):
            obj = None
            if body is not None and error is None:
                try:
                    obj = loads(body)
                except orjson.JSONDecodeError:
                    obj = None
            if not isinstance(obj, dict):
                obj = {}
            for column, (name, convert, _) in zip(columns, self.typed, strict=True):
                column.append(convert(obj.get(name)))
        types = [arrow_type for _, _, arrow_type in self.typed]
        return [pa.array(values, type=arrow_type) for values, arrow_type in zip(columns, types, strict=True)]
