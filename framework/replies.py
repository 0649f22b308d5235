"""The replying side of request/reply: a request's reply envelope, its error reply, its deadline.

A request is a command with a ``reply-to`` header (its requester's reply destination) and a
``deadline`` (Unix ms). The runtime turns its handler's return value into a reply
(:func:`reply_for`), sent after the run succeeded and before its ack; a request that is
dead-lettered gets an error reply instead (:func:`error_reply`); one whose deadline passed
before its handler started is acked unrun (:func:`deadline_passed`). Replies carry the
request's id in ``in-reply-to`` and ``reply-status`` "ok" or "error".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from broker import COMMAND, Broker, Envelope, derive_id, now_ms
from broker import headers as h
from broker.capabilities import REPLIES, as_replies
from framework._payloads import RAW_CONTENT_TYPE, encode_payload, type_name
from framework.logs import get_logger

__all__ = ["OK", "ERROR", "deadline_passed", "error_reply", "reply_for", "send_replies"]

log = get_logger("framework.replies")

OK = "ok"
ERROR = "error"


def _reply(request: Envelope, status: str, body: bytes, type_: str, content_type: str | None = None) -> Envelope:
    headers = {h.IN_REPLY_TO: request.id, h.REPLY_STATUS: status}
    for name in (h.CORRELATION_ID, h.TRACEPARENT):
        if name in request.headers:
            headers[name] = request.headers[name]
    if content_type is not None:
        headers[h.CONTENT_TYPE] = content_type
    # a deterministic id: a redelivered request's second reply has the same id as its first
    return Envelope(
        destination=request.headers[h.REPLY_TO],
        kind=COMMAND,
        type=type_,
        body=body,
        headers=headers,
        id=derive_id(request.id, "reply"),
    )


def reply_for(request: Envelope, result: Any) -> Envelope | None:
    """The reply carrying ``result`` (a handler's return value), or None when ``request`` asked none.

    Raises ``TypeError`` when ``result`` cannot be encoded (the attempt fails, as for a bad send)."""
    if h.REPLY_TO not in request.headers:
        return None
    body, content_type = encode_payload(result)
    return _reply(request, OK, body, type_name(result), content_type if content_type == RAW_CONTENT_TYPE else None)


def error_reply(request: Envelope | None, reason: Mapping[str, str]) -> Envelope | None:
    """The error reply of a dead-lettered request (``reason``: its dead-letter fields), or None
    when it asked no reply."""
    if request is None or h.REPLY_TO not in request.headers:
        return None
    fault = {
        "error_type": reason.get(h.DLQ_ERROR_TYPE, ""),
        "error_message": reason.get(h.DLQ_ERROR_MESSAGE, ""),
        "reason": reason.get(h.DLQ_REASON, ""),
        "handler": reason.get(h.DLQ_HANDLER, ""),
        "attempts": int(reason.get(h.DLQ_ATTEMPTS) or 0),
    }
    return _reply(request, ERROR, orjson.dumps(fault), "fault")


def deadline_passed(request: Envelope, now: int | None = None) -> bool:
    """Whether ``request`` carries a deadline that is over (a malformed one counts as none)."""
    raw = request.headers.get(h.DEADLINE)
    if not raw:
        return False
    try:
        deadline = int(raw)
    except ValueError:
        return False
    return deadline <= (now_ms() if now is None else now)


async def send_replies(broker: Broker, replies: Sequence[Envelope]) -> int:
    """Store ``replies`` on their requesters' reply destinations; how many were stored (a reply to
    a requester that is gone is dropped). On a transport without the ``replies`` capability, 0."""
    if not replies:
        return 0
    if REPLIES not in broker.capabilities:
        log.warning(
            "a request asked for a reply, but this transport has no reply destinations (capability 'replies'): "
            "reply dropped, its requester will time out",
            transport=broker.transport,
            count=len(replies),
        )
        return 0
    return await as_replies(broker).send_replies(replies)
