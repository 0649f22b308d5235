"""Broker URLs and local places: the deployment namespace, redacting passwords, the per-user home."""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

__all__ = ["default_namespace", "framework_home", "redact"]


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
    if "inbox=" in parts.query:  # an amqp URL naming its inbox's Redis (which may carry a password)
        query = [(k, redact(v) if k == "inbox" else v) for k, v in parse_qsl(parts.query, keep_blank_values=True)]
        url = urlunsplit(urlsplit(url)._replace(query=urlencode(query, safe=":/@*")))
    return re.sub(r"([?&]password=)[^&#]*", r"\1***", url)  # redis-py also takes ?password=...


def framework_home() -> Path:
    """The per-user home of the embedded servers and files, never the current directory.

    ``$FRAMEWORK_HOME`` when set, else ``$XDG_STATE_HOME/framework``, else ``~/.local/state/framework``.
    """
    home = os.environ.get("FRAMEWORK_HOME")
    if home:
        return Path(home).expanduser()
    state = os.environ.get("XDG_STATE_HOME")
    base = Path(state).expanduser() if state and Path(state).is_absolute() else Path.home() / ".local" / "state"
    return base / "framework"
