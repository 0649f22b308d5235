"""Names of the headers and dead-letter metadata fields the framework reads and writes.

Headers travel with a message (``Envelope.headers``); dead-letter fields are stored beside the
original message in a DLQ entry. Both are written down once here so every part agrees on them.
"""

from __future__ import annotations

__all__ = [
    "BAGGAGE",
    "CAUSATION_ID",
    "CONTENT_TYPE",
    "CORRELATION_ID",
    "DEADLINE",
    "DELIVER_AT",
    "DLQ_ATTEMPTS",
    "DLQ_DEAD_AT",
    "DLQ_DESTINATION",
    "DLQ_ENTRY_ID",
    "DLQ_ERROR_MESSAGE",
    "DLQ_ERROR_TYPE",
    "DLQ_FIRST_FAILED_AT",
    "DLQ_GROUP",
    "DLQ_HANDLER",
    "DLQ_PARTITION",
    "DLQ_REASON",
    "DLQ_TRACEBACK",
    "FIRST_FAILED_AT",
    "IDEMPOTENCY_KEY",
    "IN_REPLY_TO",
    "REPLY_STATUS",
    "REPLY_TO",
    "TRACEPARENT",
    "TRACESTATE",
]

# --- message headers (Envelope.headers) --------------------------------------------------------
TRACEPARENT = "traceparent"  # W3C trace context of the producing span
TRACESTATE = "tracestate"
BAGGAGE = "baggage"  # W3C baggage of the producing context
CORRELATION_ID = "correlation-id"  # id of the first message of a conversation
CAUSATION_ID = "causation-id"  # id of the message whose handler sent this one
CONTENT_TYPE = "content-type"  # of the body; "application/json" unless bytes were sent raw
IDEMPOTENCY_KEY = "idempotency-key"  # producer-chosen key for publish dedup
DELIVER_AT = "deliver-at"  # Unix ms: publish stores the message until then (broker/redis/scheduling.py)
REPLY_TO = "reply-to"  # a request: the reply destination of its requester (framework/requests.py)
DEADLINE = "deadline"  # a request: Unix ms after which its handler does not start it
IN_REPLY_TO = "in-reply-to"  # a reply: the id of the request it answers
REPLY_STATUS = "reply-status"  # a reply: "ok" (body: the handler's return value) or "error" (body: the fault)

# --- dead-letter entry fields (stored next to the original message's fields) --------------------
DLQ_REASON = "dlq-reason"  # one line: why the message is here
DLQ_ERROR_TYPE = "dlq-error-type"  # exception class, qualified
DLQ_ERROR_MESSAGE = "dlq-error-message"
DLQ_TRACEBACK = "dlq-traceback"  # trimmed
DLQ_ATTEMPTS = "dlq-attempts"
DLQ_HANDLER = "dlq-handler"
DLQ_DESTINATION = "dlq-destination"  # where the message was consumed from
DLQ_PARTITION = "dlq-partition"
DLQ_GROUP = "dlq-group"
DLQ_FIRST_FAILED_AT = "dlq-first-failed-at"  # Unix ms
DLQ_DEAD_AT = "dlq-dead-at"  # Unix ms
DLQ_ENTRY_ID = "dlq-entry-id"  # the stream entry id it had where it failed
FIRST_FAILED_AT = "first-failed-at"  # Unix ms; carried by retried copies so dead letters can report it
