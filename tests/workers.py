"""Worker processes for fault tests: `python -m framework run` subprocesses, their logs, and waiting."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path


class Workers:
    """Starts `python -m framework run` workers and cleans them up."""

    def __init__(self, env: dict[str, str], tmp: Path) -> None:
        self.env = env
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, target: str, consumer: str, *extra: str, **env: str) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{consumer}.log", "ab")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            [sys.executable, "-m", "framework", "run", target, "--consumer", consumer, *extra],
            env={**self.env, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.procs.append(proc)
        return proc

    def log(self, consumer: str) -> str:
        return (self.tmp / f"{consumer}.log").read_text(errors="replace")

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> None:
    """Poll ``predicate`` until it is true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
