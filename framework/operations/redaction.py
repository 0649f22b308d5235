"""Secret fields taken out of message bodies and headers before an operator's screen shows them.

A JSON body's values under a secret-looking key (``password``, ``token``, ``card_number``, ...;
matched in any case, anywhere in the key, at any depth) are replaced by ``"[redacted]"``; more
key fragments come from ``$FRAMEWORK_REDACT_FIELDS`` (comma separated). A body that is not JSON is
shown as text (or hex) as it is: the framework cannot tell its fields apart.
"""

from __future__ import annotations

import os
from typing import Any

import orjson

__all__ = ["REDACTED", "redact_body", "redact_value", "secret_key"]

REDACTED = "[redacted]"
_DEFAULT = (
    "password",
    "passwd",
    "secret",
    "token",
    "api_key",
    "apikey",
    "authorization",
    "cookie",
    "credential",
    "private_key",
    "card_number",
    "cardnumber",
    "cvv",
    "cvc",
    "iban",
    "ssn",
    "pin",
)


def _fragments() -> tuple[str, ...]:
    extra = os.environ.get("FRAMEWORK_REDACT_FIELDS", "")
    return _DEFAULT + tuple(f.strip().lower() for f in extra.split(",") if f.strip())


def secret_key(key: str) -> bool:
    """Whether a field named ``key`` holds a secret (a listed fragment appears in it, any case)."""
    k = key.lower().replace("-", "_")
    return any(f in k for f in _fragments())


def redact_value(value: Any) -> Any:
    """``value`` with every secret field's value (at any depth) replaced by :data:`REDACTED`."""
    if isinstance(value, dict):
        return {k: REDACTED if isinstance(k, str) and secret_key(k) else redact_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_value(v) for v in value]
    return value


def redact_body(body: bytes) -> str:
    """The body as an operator may see it: JSON re-indented with secrets redacted, else text, else hex."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        try:
            return body.decode()
        except UnicodeDecodeError:
            return "(binary) " + body.hex()
    return orjson.dumps(redact_value(data), option=orjson.OPT_INDENT_2).decode()
