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
    ends keeps the last time it was seen with.
    """

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.samples: list[tuple[int, float]] = []  # (Unix ns, CPU seconds)
        self.pid: int | None = None
        self._threads: dict[str, int] = {}  # tid -> its CPU ns when last seen
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
                try:
                    tids = os.listdir(f"/proc/{self.pid}/task")
                except OSError:
                    return  # the worker is gone
                for tid in tids:
                    try:
                        with open(f"/proc/{self.pid}/task/{tid}/schedstat", "rb") as f:
                            self._threads[tid] = int(f.read().split()[0])
                    except (OSError, IndexError, ValueError):
                        continue  # the thread just ended: its last value stays
                self.samples.append((time.time_ns(), sum(self._threads.values()) / 1e9))
            self._stop.wait(self.interval)

    def _at(self, t_ns: int) -> float:
        """CPU seconds at ``t_ns``, interpolated between the samples around it."""
        before = [s for s in self.samples if s[0] <= t_ns]
        after = [s for s in self.samples if s[0] >= t_ns] or self.samples[-1:]  # exited: its last sample
        if not before or not after:
            raise RuntimeError("the worker's CPU time was not sampled around the timed span")
        (t0, c0), (t1, c1) = before[-1], after[0]
        return c0 if t1 == t0 else c0 + (c1 - c0) * (t_ns - t0) / (t1 - t0)

    def between(self, start_ns: int, end_ns: int) -> float:
        """The worker's CPU seconds from ``start_ns`` to ``end_ns`` (Unix ns)."""
        return self._at(end_ns) - self._at(start_ns)
