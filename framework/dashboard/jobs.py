"""Bulk actions run as jobs: started by a POST, shown with their progress until done."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import attrs

from framework.operations import ActionResult

__all__ = ["Job", "Jobs"]


@attrs.define
class Job:
    """One bulk action: what, how far (``done`` of ``total``), and its result or error when over."""

    id: str
    label: str
    total: int
    done: int = 0
    result: ActionResult | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        """Whether the job is over (done or failed)."""
        return self.result is not None or self.error is not None

    def progress(self, done: int, total: int) -> None:
        """Record progress (the actions call it as they go)."""
        self.done, self.total = done, total


class Jobs:
    """The jobs of one dashboard app (the last 100 kept)."""

    def __init__(self) -> None:
        self.jobs: dict[str, Job] = {}

    def get(self, job_id: str) -> Job | None:
        """The job with this id, or None."""
        return self.jobs.get(job_id)

    def start(self, label: str, total: int, run: Callable[[Job], Awaitable[ActionResult]]) -> Job:
        """Start ``run(job)`` in the background of the event loop; return the job at once."""
        job = Job(secrets.token_urlsafe(12), label, total)
        self.jobs[job.id] = job
        while len(self.jobs) > 100:
            del self.jobs[next(iter(self.jobs))]

        async def go() -> None:
            try:
                job.result = await run(job)
            except Exception as exc:
                job.error = f"{type(exc).__name__}: {exc}"

        _spawn(go)
        return job


def _spawn(fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run ``fn`` in the background (a reference is kept until it ends)."""
    task: asyncio.Task[None] = asyncio.get_running_loop().create_task(fn())
    _running.add(task)
    task.add_done_callback(_running.discard)


_running: set[asyncio.Task[None]] = set()
