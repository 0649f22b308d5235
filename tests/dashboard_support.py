"""Helpers of the dashboard tests: serve the app in a thread, read dead letters, find Chromium."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from broker import connect
from framework.operations import DeadLetterFilter, page

ROOT = Path(__file__).resolve().parent.parent
SHOTS = (
    Path(os.environ["FRAMEWORK_SCREENSHOTS"])
    if os.environ.get("FRAMEWORK_SCREENSHOTS")
    else Path(tempfile.mkdtemp(prefix="dashboard-shots-"))
)
"""Where the tests write their screenshots: ``$FRAMEWORK_SCREENSHOTS`` (``docs/img`` to refresh
docs/dashboard.md's pictures: ``FRAMEWORK_SCREENSHOTS=docs/img make test``), else a temporary folder,
so a test run leaves the checkout as it was."""
CHROMIUM = os.environ.get("FRAMEWORK_CHROMIUM", "/usr/bin/chromium")


def chromium_or_skip() -> str:
    """The system Chromium's path; skip without one (fail under CI=true: CI must run these)."""
    if Path(CHROMIUM).exists() or shutil.which(CHROMIUM):
        return CHROMIUM
    message = f"no Chromium at {CHROMIUM}: `make test` installs Debian's chromium (apt-get install -y chromium)"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def outside_address() -> str | None:
    """An address of this machine that is not loopback (None when it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            addr = str(s.getsockname()[0])
        except OSError:
            return None
    return None if addr.startswith("127.") else addr


class Served:
    """An ASGI app served by uvicorn in a thread (its own event loop), until :meth:`close`."""

    def __init__(self, app: Any, host: str = "127.0.0.1") -> None:
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise AssertionError("the dashboard did not start")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def dead_letters(url: str, namespace: str) -> list[Any]:
    """Every dead letter of the namespace, newest first."""

    async def go() -> list[Any]:
        broker = await connect(url, namespace=namespace)
        try:
            return (await page(broker, DeadLetterFilter(), limit=500)).items
        finally:
            await broker.close()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # (Playwright's sync API runs a loop in this thread)
        return pool.submit(anyio.run, go).result()
