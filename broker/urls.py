"""Broker URLs: the deployment namespace and redacting passwords before a URL reaches a message."""

from __future__ import annotations

import os
import re
from urllib.parse import urlsplit, urlunsplit

__all__ = ["default_namespace", "redact"]


def default_namespace() -> str:
    """``$FRAMEWORK_NAMESPACE`` or ``fw``."""
    return os.environ.get("FRAMEWORK_NAMESPACE") or "fw"


def redact(url: str) -> str:
    """The URL with any password replaced by ``***`` (for messages and logs)."""
    try:
        parts = urlsplit(url)
        password, port = parts.password, parts.port
    except ValueError:  # unparsable: show nothing that could be a secret
        return "<unparsable URL>"
    if password:
        netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{port}" if port else "")
        url = urlunsplit(parts._replace(netloc=netloc))
    return re.sub(r"([?&]password=)[^&#]*", r"\1***", url)  # redis-py also takes ?password=...
