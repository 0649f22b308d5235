"""Services for the supervisor and health tests (``framework run --workers N``, ``--health-port``)."""

from __future__ import annotations

import time

import anyio

from framework import Service

stuck = Service("stuck")


@stuck.command("stuck.jobs")
async def block(cmd: dict) -> None:
    """Blocks the worker's event loop (a sync sleep in an async handler) for ``cmd["seconds"]``."""
    time.sleep(cmd["seconds"])  # noqa: ASYNC251 - blocking the loop is the point


slow = Service("slow")


@slow.command("slow.jobs")
async def linger(cmd: dict) -> None:
    """Takes ``cmd["seconds"]`` without blocking the event loop."""
    await anyio.sleep(cmd["seconds"])
