"""Building outgoing envelopes from payloads (shared by the client, handler contexts and the outbox).

Internal: users send through :class:`framework.Client`, ``ctx.send``/``ctx.publish`` or
:func:`framework.outbox.add`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from broker import COMMAND, EVENT, DestinationSpec, Envelope, Kind, new_id
from broker.headers import CONTENT_TYPE, IDEMPOTENCY_KEY
from framework._payloads import RAW_CONTENT_TYPE, encode_payload, type_name
from framework.handlers import Queue, Topic

__all__ = ["Outgoing", "build_envelope"]

Outgoing = tuple[Envelope, DestinationSpec | None]


def build_envelope(
    destination: str | Queue | Topic,
    kind: Kind,
    payload: Any,
    *,
    key: str | None = None,
    headers: Mapping[str, str] | None = None,
    type: str | None = None,
    message_id: str | None = None,
    idempotency_key: str | None = None,
) -> Outgoing:
    """An envelope for ``payload`` and, when ``destination`` is a Queue/Topic object, its spec."""
    spec: DestinationSpec | None = None
    if isinstance(destination, Queue | Topic):
        if (kind == EVENT) != isinstance(destination, Topic):
            verb = "publish() takes a Topic" if kind == EVENT else "send() takes a Queue"
            raise TypeError(f"{verb}, not {destination!r}")
        spec = destination.spec()
        name = destination.name
    else:
        name = destination
    if kind not in (COMMAND, EVENT):
        raise ValueError(f"kind must be 'command' or 'event', not {kind!r}")
    if key is not None and not isinstance(key, str):
        key = str(key)
    body, content_type = encode_payload(payload)
    hdrs: dict[str, str] = dict(headers) if headers else {}
    if content_type == RAW_CONTENT_TYPE:
        hdrs.setdefault(CONTENT_TYPE, content_type)
    if idempotency_key is not None:
        hdrs[IDEMPOTENCY_KEY] = idempotency_key
    env = Envelope(
        destination=name,
        kind=kind,
        type=type or type_name(payload),
        body=body,
        key=key,
        headers=hdrs,
        id=message_id or new_id(),
    )
    return env, spec
