"""The framework's pytest plugin: a real broker per test session and a fresh namespace per test.

Loaded by pytest through the ``framework`` entry point; it gives every test suite:

* ``framework_redis_url`` (session): ``$REDIS_URL`` if set, else an embedded Valkey started for the
  session in a temporary directory and stopped afterwards;
* ``framework_namespace``: a fresh key prefix per test; its keys are deleted after the test, and
  nothing else on the server is touched (never a FLUSHDB).

The harness itself (:class:`framework.testing.ServiceHarness`) does not need pytest.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from framework.testing import delete_namespace, embedded_server, unique_namespace

__all__ = ["framework_namespace", "framework_redis_url"]


def pytest_configure(config: pytest.Config) -> None:
    """Give tests plain, fast console logs unless the application configured structlog itself."""
    import structlog

    from framework.logconfig import configure_logging

    if not structlog.is_configured():
        configure_logging(fmt="console")


@pytest.fixture(scope="session")
def framework_redis_url() -> Iterator[str]:
    """``$REDIS_URL``, or a session-wide embedded Valkey."""
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    with embedded_server() as url:
        yield url


@pytest.fixture
def framework_namespace(framework_redis_url: str) -> Iterator[str]:
    """A fresh namespace for one test; its keys are deleted afterwards."""
    namespace = unique_namespace()
    yield namespace
    delete_namespace(framework_redis_url, namespace)
