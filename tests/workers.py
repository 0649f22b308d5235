"""Worker processes for fault tests: a thin layer over the framework's own ``WorkerPool``
(``framework.faults``, public as ``framework.testing.WorkerPool``), kept for the existing tests."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

from framework.faults import WorkerPool
from framework.faults import wait_for as _wait_for


class Workers:
    """Starts `python -m framework run` workers and cleans them up (every process, in start order)."""

    def __init__(self, env: dict[str, str], tmp: Path) -> None:
        self.tmp = tmp
        self.pool = WorkerPool(env, tmp)
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def env(self) -> dict[str, str]:
        """The environment workers start with; a test may replace it before starting them."""
        return self.pool.env

    @env.setter
    def env(self, env: dict[str, str]) -> None:
        self.pool.env = {**env, "FRAMEWORK_LOG_FORMAT": "json"}

    def start(self, target: str, consumer: str, *extra: str, **env: str) -> subprocess.Popen[bytes]:
        proc = self.pool.start(target, consumer, *extra, metrics=False, env=env)
        self.procs.append(proc)
        return proc

    def log(self, consumer: str) -> str:
        return self.pool.log(consumer)

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> None:
    """Poll ``predicate`` until it is true; fail the test after ``timeout`` seconds."""
    try:
        _wait_for(predicate, timeout, what)
    except TimeoutError as exc:
        raise AssertionError(str(exc)) from None


def whole_lines(text: str) -> list[str]:
    """The lines of a file a worker appends to that it has finished writing (it may be writing the last now)."""
    return text[: text.rfind("\n") + 1].splitlines()
