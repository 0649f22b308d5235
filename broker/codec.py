"""Envelope <-> Redis stream entry fields.

An entry holds flat fields so that consumers in any language (and Spark) can read it:

    id       message id (UUID string)
    type     payload type name
    body     payload bytes (JSON unless content-type says otherwise)
    ts       published_at, Unix milliseconds
    key      partition/ordering key              (absent when the message has none)
    headers  JSON object of string headers       (absent when empty)
    attempt  attempt number through retry paths  (absent when 1)

Destination and kind are not stored: the stream a message sits in names them.

Bodies have a maximum size (:func:`max_body_bytes`, default 1 MiB): producers refuse larger ones
(:class:`~broker.errors.MessageTooLarge`) and decoding turns a larger stored one into a
:class:`~broker.errors.DecodeError`, so consumers dead-letter it with the size in the reason.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import orjson

from broker.envelope import Envelope, Kind
from broker.errors import ConfigurationError, DecodeError, MessageTooLarge

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "check_body_size",
    "decode_fields",
    "decode_flat",
    "encode_fields",
    "fields_of",
    "max_body_bytes",
]

DEFAULT_MAX_BODY_BYTES = 1024 * 1024
"""1 MiB: large enough for any business message, small enough that a runaway producer cannot fill
the server's memory (every entry stays in RAM) or stall consumers."""

MAX_BODY_ENV = "FRAMEWORK_MAX_BODY_BYTES"


def max_body_bytes(value: int | None = None) -> int:
    """The maximum body size: ``value`` when given, else ``$FRAMEWORK_MAX_BODY_BYTES``, else 1 MiB."""
    if value is None:
        raw = os.environ.get(MAX_BODY_ENV, "").strip()
        if not raw:
            return DEFAULT_MAX_BODY_BYTES
        try:
            value = int(raw)
        except ValueError:
            raise ConfigurationError(f"{MAX_BODY_ENV}={raw!r} is not a whole number of bytes (e.g. 1048576)") from None
    if value <= 0:
        raise ConfigurationError(f"the maximum body size must be a positive number of bytes, not {value}")
    return value


def check_body_size(envelope: Envelope, limit: int) -> None:
    """Raise :class:`MessageTooLarge` when ``envelope``'s body is over ``limit`` bytes."""
    if len(envelope.body) > limit:
        raise MessageTooLarge(envelope.destination, len(envelope.body), limit)


def _too_large(size: int, limit: int) -> DecodeError:
    return DecodeError(
        f"body is {size:,} bytes, over the limit of {limit:,} bytes ({MAX_BODY_ENV}); "
        "it was not handled: raise the limit and redrive it, or purge it"
    )


def encode_fields(envelope: Envelope) -> list[bytes | str | int]:
    """Flatten an envelope into XADD field/value arguments."""
    out: list[bytes | str | int] = [
        "id",
        envelope.id,
        "type",
        envelope.type,
        "body",
        envelope.body,
        "ts",
        envelope.published_at,
    ]
    if envelope.key is not None:
        out += ("key", envelope.key)
    if envelope.headers:
        out += ("headers", orjson.dumps(envelope.headers))
    if envelope.attempt != 1:
        out += ("attempt", envelope.attempt)
    return out


def decode_fields(fields: Mapping[bytes, bytes], destination: str, kind: Kind, max_body: int = 0) -> Envelope:
    """Rebuild the envelope of a stream entry; raise :class:`DecodeError` naming what is wrong.

    ``max_body`` (0: no limit) makes a larger body a :class:`DecodeError` too.
    """
    try:
        message_id = fields[b"id"].decode()
        body = fields[b"body"]
    except KeyError as exc:
        raise DecodeError(f"entry has no {exc.args[0].decode()!r} field") from None
    except UnicodeDecodeError:
        raise DecodeError("field 'id' is not UTF-8") from None
    if max_body and len(body) > max_body:
        raise _too_large(len(body), max_body)
    try:
        type_name = fields.get(b"type", b"").decode()
        ts = fields.get(b"ts")
        published_at = int(ts) if ts is not None else 0
        raw_key = fields.get(b"key")
        key = raw_key.decode() if raw_key is not None else None
        raw_headers = fields.get(b"headers")
        headers = orjson.loads(raw_headers) if raw_headers else {}
        attempt_raw = fields.get(b"attempt")
        attempt = int(attempt_raw) if attempt_raw is not None else 1
    except (ValueError, UnicodeDecodeError, orjson.JSONDecodeError) as exc:
        raise DecodeError(f"malformed envelope field: {exc}") from None
    if not isinstance(headers, dict):
        raise DecodeError("field 'headers' is not a JSON object")
    return Envelope(
        destination=destination,
        kind=kind,
        type=type_name,
        body=body,
        key=key,
        headers=headers,
        id=message_id,
        published_at=published_at,
        attempt=attempt,
    )


def fields_of(flat: list[bytes]) -> dict[bytes, bytes]:
    """The field/value list of a raw stream entry as a dict."""
    it = iter(flat)
    return dict(zip(it, it, strict=False))


def decode_flat(flat: list[bytes], destination: str, kind: Kind, max_body: int = 0) -> Envelope:
    """Like :func:`decode_fields` on a raw field/value list; fast when it is in :func:`encode_fields` order."""
    if len(flat) >= 8 and flat[0] == b"id" and flat[2] == b"type" and flat[4] == b"body" and flat[6] == b"ts":
        if max_body and len(flat[5]) > max_body:
            raise _too_large(len(flat[5]), max_body)
        key = None
        headers: dict[str, str] = {}
        attempt = 1
        try:
            for i in range(8, len(flat) - 1, 2):
                name = flat[i]
                if name == b"key":
                    key = flat[i + 1].decode()
                elif name == b"headers":
                    headers = orjson.loads(flat[i + 1])
                elif name == b"attempt":
                    attempt = int(flat[i + 1])
            env = Envelope(
                destination, kind, flat[3].decode(), flat[5], key, headers, flat[1].decode(), int(flat[7]), attempt
            )
        except (ValueError, UnicodeDecodeError, orjson.JSONDecodeError):
            return decode_fields(fields_of(flat), destination, kind, max_body)  # slow path names the problem
        if type(headers) is dict:
            return env
    return decode_fields(fields_of(flat), destination, kind, max_body)
