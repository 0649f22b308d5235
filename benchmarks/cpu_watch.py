"""The CPU time of the benchmark's worker child, all its threads, sampled from ``/proc``."""

from __future__ import annotations

import os
import threading
import time

__all__ = ["CpuWatch"]


class CpuWatch:
    """Samples the CPU time of this process's worker child, all its threads, every 5 ms.

    Throughput on a shared 2-core machine moves with the other processes' load; CPU seconds per
    message move far less, so they cross-check the throughput ratios. The worker is the child
    whose command line holds ``bench-worker`` (one at a time: the drain runs one worker). The
    time comes from each thread's ``/proc/<pid>/task/<tid>/schedstat`` (nanoseconds; ``utime`` and
    ``stime`` count 10 ms ticks, too coarse for a drain of a fraction of a second); a thread that
    ends keeps the last time it was seen with. With ``server_pid`` (a server on this machine) the
    server's CPU time is sampled beside it (:meth:`server_between`); with ``pid`` that process is
    watched instead of the ``bench-worker`` child (a latency trial's consumer, whichever it is).
    """

    def __init__(self, interval: float = 0.005, server_pid: int | None = None, pid: int | None = None) -> None:
        self.interval = interval
        self.samples: list[tuple[int, float]] = []  # (Unix ns, CPU seconds)
        self.server_samples: list[tuple[int, float]] = []  # the same for the server, when sampled
        self.pid: int | None = pid
        self.server_pid = server_pid
        self._threads: dict[str, int] = {}  # tid -> its CPU ns when last seen
        self._server_threads: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-cpu", daemon=True)

    def __enter__(self) -> CpuWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _find(self) -> int | None:
        me = str(os.getpid())
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    if f.read().rsplit(b")", 1)[1].split()[1].decode() != me:
                        continue
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    if b"bench-worker" in f.read():
                        return int(entry.name)
            except (OSError, IndexError):
                continue
        return None

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.pid is None:
                self.pid = self._find()
                if self.pid is None:  # not started yet (it imports for a while before it drains)
                    self._stop.wait(0.05)
                    continue
            else:
                now = time.time_ns()
                worker = _cpu_s(self.pid, self._threads)
                if worker is None:
                    return  # the worker is gone
                self.samples.append((now, worker))
                if self.server_pid and (server := _cpu_s(self.server_pid, self._server_threads)) is not None:
                    self.server_samples.append((now, server))
            self._stop.wait(self.interval)

    def between(self, start_ns: int, end_ns: int) -> float:
        """The worker's CPU seconds from ``start_ns`` to ``end_ns`` (Unix ns)."""
        return _at(self.samples, end_ns) - _at(self.samples, start_ns)

    def server_between(self, start_ns: int, end_ns: int) -> float | None:
        """The server's CPU seconds from ``start_ns`` to ``end_ns``; None when it was not sampled."""
        if not self.server_samples:
            return None
        return _at(self.server_samples, end_ns) - _at(self.server_samples, start_ns)


def _cpu_s(pid: int, threads: dict[str, int]) -> float | None:
    """CPU seconds of every thread of ``pid`` (``threads`` keeps each one's last value); None if gone."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                threads[tid] = int(f.read().split()[0])
        except (OSError, IndexError, ValueError):
            continue  # the thread just ended: its last value stays
    return sum(threads.values()) / 1e9


def _at(samples: list[tuple[int, float]], t_ns: int) -> float:
    """CPU seconds at ``t_ns``, interpolated between the samples around it."""
    before = [s for s in samples if s[0] <= t_ns]
    after = [s for s in samples if s[0] >= t_ns] or samples[-1:]  # exited: its last sample
    if not before or not after:
        raise RuntimeError("the CPU time was not sampled around the timed span")
    (t0, c0), (t1, c1) = before[-1], after[0]
    return c0 if t1 == t0 else c0 + (c1 - c0) * (t_ns - t0) / (t1 - t0)
