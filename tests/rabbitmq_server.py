"""The local RabbitMQ server for tests: a fresh virtual host per test session, deleted afterwards.

``RABBITMQ_URL`` (default ``amqp://guest:guest@127.0.0.1:5672/``) names the server; tests get
``{RABBITMQ_URL without vhost}/{vhost}``. When the server is unreachable the tests are skipped with
the reason, except under CI (``CI=true``), where they fail: CI must run them.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import uuid
from urllib.parse import urlsplit, urlunsplit

import pytest

__all__ = ["BASE_URL", "VirtualHost", "unavailable"]

BASE_URL = os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")


def unavailable() -> str | None:
    """Why the RabbitMQ tests cannot run here, or None when they can."""
    parts = urlsplit(BASE_URL)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 5672), timeout=2):
            pass
    except OSError as exc:
        where = f"{parts.hostname}:{parts.port or 5672}"
        return f"RabbitMQ is not reachable at {where} ({exc}); start it: rabbitmq-server -detached"
    if shutil.which("rabbitmqctl") is None:
        return "rabbitmqctl is not installed (the tests create a virtual host of their own with it)"
    return None


def skip_or_fail() -> None:
    """Skip the calling test when RabbitMQ is unavailable, or fail it under CI."""
    reason = unavailable()
    if reason is None:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI must run the RabbitMQ tests: {reason}")
    pytest.skip(reason)


def _ctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", *args], check=True, capture_output=True, timeout=60)


class VirtualHost:
    """A virtual host of this test run on the local server (``url``), removed by :meth:`delete`."""

    def __init__(self) -> None:
        self.name = f"fw-test-{uuid.uuid4().hex[:12]}"
        user = urlsplit(BASE_URL).username or "guest"
        _ctl("add_vhost", self.name)
        _ctl("set_permissions", "-p", self.name, user, ".*", ".*", ".*")
        self.url = urlunsplit(urlsplit(BASE_URL)._replace(path=f"/{self.name}"))

    def delete(self) -> None:
        """Delete the virtual host with every queue and exchange the tests made in it."""
        _ctl("delete_vhost", self.name)
