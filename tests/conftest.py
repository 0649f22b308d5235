"""Shared fixtures: a real broker for the session (embedded Valkey unless REDIS_URL is set).

``framework_redis_url`` and ``framework_namespace`` come from the framework's own pytest plugin
(``framework.pytest_plugin``); the names below are short aliases used throughout the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from broker import connect
from broker.redis import RedisBroker
from tests.netproxy import NetProxy
from tests.workers import Workers

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def redis_url(framework_redis_url: str) -> str:
    return framework_redis_url


@pytest.fixture
def namespace(framework_namespace: str) -> str:
    return framework_namespace


@pytest.fixture
def no_bench_child_left() -> Iterator[None]:
    """After a benchmark test: stop every child process it left running, and fail it for that."""
    from benchmarks import procs

    yield
    leftover = list(procs._running.values())
    procs.stop_all()
    assert not leftover, f"child processes left running: {[c.name for c in leftover]}"


@pytest.fixture
async def broker(redis_url: str, namespace: str) -> AsyncIterator[RedisBroker]:
    b = await connect(redis_url, namespace=namespace)
    yield b
    await b.close()


@pytest.fixture(scope="session")
def rabbitmq_url() -> Iterator[str]:
    """A fresh virtual host on the local RabbitMQ for this session (skipped when unreachable, failed
    under CI); deleted with everything in it afterwards."""
    from tests.rabbitmq_server import VirtualHost, skip_or_fail

    skip_or_fail()
    vhost = VirtualHost()
    yield vhost.url
    vhost.delete()


@pytest.fixture
def worker_env(redis_url: str, namespace: str, tmp_path: Path) -> Iterator[dict[str, str]]:
    """Environment for worker subprocesses: same server and namespace, test modules importable."""
    env = dict(os.environ)
    env.update(
        REDIS_URL=redis_url,
        FRAMEWORK_NAMESPACE=namespace,
        PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "apps"), str(ROOT), env.get("PYTHONPATH", "")]),
        FRAMEWORK_LOG_FORMAT="json",
    )
    yield env


@pytest.fixture
def workers(worker_env: dict[str, str], tmp_path: Path) -> Iterator[Workers]:
    """Start worker processes in the test's server and namespace; whatever is left is killed after."""
    w = Workers(worker_env, tmp_path)
    yield w
    w.stop_all()


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``python -m framework ARGS`` and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "framework", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="session")
def pg_server() -> Iterator[str]:
    """``$DATABASE_URL`` (used only to create scratch databases on its server), else an embedded PostgreSQL."""
    url = os.environ.get("DATABASE_URL")
    if url:
        from framework.sql import resolve_url

        if resolve_url(url).get_backend_name() != "postgresql":
            pytest.skip("DATABASE_URL is not PostgreSQL")
        yield url
        return
    from framework.testing import embedded_postgres

    with embedded_postgres() as url:
        yield url


@pytest.fixture
def pg_url(pg_server: str) -> Iterator[str]:
    """A fresh database on the test PostgreSQL server, dropped after the test."""
    from framework.testing import temporary_database

    with temporary_database(pg_server, prefix="framework_test") as url:
        yield url


@pytest.fixture
def proxy(redis_url: str) -> Iterator[NetProxy]:
    """A TCP proxy in front of the Redis server (``proxy.url(redis_url)``), to stall or reset
    connections; skipped where the URL is not TCP."""
    if not redis_url.startswith("redis://"):
        pytest.skip("the proxy forwards TCP only")
    p = NetProxy.for_url(redis_url)
    yield p
    p.close()
