"""Child processes of the benchmarks: start them, sample their memory, and always stop them.

Every child is started through :func:`child`, a context manager that stops it on the way out
(SIGTERM, then SIGKILL after a grace period), whatever happened inside. Children also land in a
registry that :func:`stop_all` empties, which ``python -m benchmarks`` calls on exit and on SIGTERM,
so an interrupted run leaves no worker behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = ["ROOT", "Child", "RssSampler", "child", "remove_logs", "rss_kib", "stop_all"]

ROOT = Path(__file__).resolve().parent.parent
"""The repository root: children run there, so ``benchmarks`` and ``framework`` import."""

_log_dir: Path | None = None  # created with the first child
_running: dict[int, Child] = {}
_lock = threading.Lock()


def _logs() -> Path:
    global _log_dir
    if _log_dir is None:
        _log_dir = Path(tempfile.mkdtemp(prefix="framework-bench-logs-"))
    return _log_dir


def rss_kib(pid: int) -> int | None:
    """Resident set size of ``pid`` in KiB (``VmRSS``), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


class Child:
    """A running child process with its output in a log file."""

    def __init__(self, name: str, args: Sequence[str], env: dict[str, str], *, finishes: bool = False) -> None:
        self.name = name
        self.finishes = finishes  # exiting with status 0 is how it ends (not an error)
        self.log_path = _logs() / f"{name}-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        full_env = {**os.environ, **env}
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), full_env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, *args],
            cwd=ROOT,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.pid = self.proc.pid
        with _lock:
            _running[self.pid] = self

    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the child's output (for error messages)."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def check(self) -> None:
        """Raise if the child failed (or, unless it ``finishes``, exited); the error carries its log's end."""
        code = self.proc.poll()
        if code is not None and (code != 0 or not self.finishes):
            raise RuntimeError(f"{self.name} exited with status {code}; its log ends:\n{self.log_tail()}")

    def wait(self, timeout: float) -> int:
        """Wait for the child to exit on its own; kill it and raise after ``timeout`` seconds."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop(grace=0)
            raise RuntimeError(
                f"{self.name} did not finish within {timeout:.0f}s; its log ends:\n{self.log_tail()}"
            ) from None

    def stop(self, grace: float = 30.0) -> int | None:
        """SIGTERM (a graceful stop for workers), SIGKILL after ``grace`` seconds; return the exit status."""
        try:
            if self.proc.poll() is None:
                if grace > 0:
                    self.proc.send_signal(signal.SIGTERM)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self.proc.wait(grace)
                if self.proc.poll() is None:
                    self.proc.kill()
                    self.proc.wait()
            return self.proc.returncode
        finally:
            self._log.close()
            with _lock:
                _running.pop(self.pid, None)


@contextlib.contextmanager
def child(
    name: str, args: Sequence[str], env: dict[str, str] | None = None, *, grace: float = 30.0, finishes: bool = False
) -> Iterator[Child]:
    """Run ``python ARGS`` for the duration of the block; it is always stopped afterwards.

    ``finishes`` marks a child that ends on its own (exit status 0 is then no error).
    """
    proc = Child(name, args, env or {}, finishes=finishes)
    try:
        yield proc
    finally:
        proc.stop(grace)


def stop_all() -> None:
    """Kill every child still running (on interrupt or exit)."""
    with _lock:
        children = list(_running.values())
    for c in children:
        c.stop(grace=2.0)


def remove_logs(*, keep: bool = False) -> None:
    """Delete the children's logs (or, with ``keep``, say where they are)."""
    if _log_dir is None:
        return
    if keep:
        print(f"logs of the benchmark's child processes: {_log_dir}", file=sys.stderr)
    else:
        shutil.rmtree(_log_dir, ignore_errors=True)


class RssSampler:
    """Samples a process's RSS every ``interval`` seconds in a thread; keeps the peak."""

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        self.pid = pid
        self.interval = interval
        self.samples: list[tuple[float, int]] = []  # (monotonic seconds, KiB)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rss-{pid}", daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            value = rss_kib(self.pid)
            if value is not None:
                self.samples.append((time.monotonic(), value))
            self._stop.wait(self.interval)

    @property
    def peak_kib(self) -> int:
        """The largest RSS seen (0 before the first sample)."""
        return max((v for _, v in self.samples), default=0)

    def halves_mib(self, drain_seconds: float) -> tuple[float, float]:
        """Peak RSS (MiB) in the first and the second half of the last ``drain_seconds`` sampled."""
        if not self.samples:
            return 0.0, 0.0
        end = self.samples[-1][0]
        middle = end - drain_seconds / 2
        start = end - drain_seconds
        first = [v for t, v in self.samples if start <= t < middle] or [self.samples[0][1]]
        second = [v for t, v in self.samples if t >= middle]
        return max(first) / 1024, max(second) / 1024

    def last_kib(self) -> int:
        """The latest RSS sample."""
        return self.samples[-1][1] if self.samples else 0
