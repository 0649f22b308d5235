"""What the benchmarks ran on, and how busy the machine was meanwhile (others may share it).

:func:`describe` names the machine (cores, CPU model, memory, Python, server). :class:`Conditions`
samples the load average every few seconds in a thread and compares ``/proc/stat`` at the start and
the end, so the report can say how much CPU the whole machine used (ours and everyone else's) and
how much the hypervisor stole.
"""

from __future__ import annotations

import os
import platform
import threading
import time
from typing import Any

import redis

__all__ = ["Conditions", "describe", "server_pid"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def describe(url: str, embedded: bool) -> dict[str, Any]:
    """Cores, CPU model, memory, Python and server version and persistence."""
    client = redis.Redis.from_url(url, protocol=2)
    try:
        info = client.info("server")
        persistence = client.info("persistence")
        name = "Valkey" if "valkey_version" in info else "Redis"
        version = info.get("valkey_version") or info.get("redis_version")
        fsync = client.config_get("appendfsync").get("appendfsync", "?")
    finally:
        client.close()
    aof = "AOF on, appendfsync " + fsync if persistence.get("aof_enabled") else "AOF off"
    return {
        "cores": os.cpu_count(),
        "cpu": _cpu_model(),
        "memory_gib": round(_mem_total_gib(), 1),
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
        "server": f"{name} {version} ({'embedded' if embedded else 'REDIS_URL'}, {aof})",
    }


def _cpu_times() -> list[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def _loadavg() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def process_cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system) a local process used so far; 0 if it is not visible here."""
    if not pid:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def server_pid(url: str) -> int | None:
    """The server's process id when it runs on this machine (for its CPU use), else None."""
    if "127.0.0.1" not in url and "localhost" not in url and not url.startswith("unix:"):
        return None
    client = redis.Redis.from_url(url, protocol=2)
    try:
        return int(client.info("server")["process_id"])
    except (redis.RedisError, KeyError, ValueError):
        return None
    finally:
        client.close()


class Conditions:
    """Machine load while the benchmarks run: load average samples and CPU use from ``/proc/stat``."""

    def __init__(self, server_pid: int | None = None, interval: float = 5.0) -> None:
        self.server_pid = server_pid
        self._own_start = 0.0
        self._server_start = 0.0
        self.interval = interval
        self.loads: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="conditions", daemon=True)
        self._start_times: list[int] = []
        self._end_times: list[int] = []
        self._own_end = 0.0
        self._server_end = 0.0
        self.started = 0.0
        self.ended = 0.0

    def __enter__(self) -> Conditions:
        self._start_times = _cpu_times()
        self._own_start = _own_cpu_s()
        self._server_start = process_cpu_s(self.server_pid)
        self.started = time.time()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._end_times = _cpu_times()
        self._own_end = _own_cpu_s()
        self._server_end = process_cpu_s(self.server_pid)
        self.ended = time.time()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.loads.append(_loadavg())
            self._stop.wait(self.interval)

    def summary(self) -> dict[str, Any]:
        """Load average (first, median, max) and CPU use of the machine: busy, not ours, stolen (percent)."""
        end = self._end_times or _cpu_times()
        delta = [b - a for a, b in zip(self._start_times, end, strict=False)]
        total = sum(delta[:8]) or 1  # guest time is already counted in user and nice
        idle = delta[3] + (delta[4] if len(delta) > 4 else 0)  # idle + iowait
        steal = delta[7] if len(delta) > 7 else 0
        ticks = os.sysconf("SC_CLK_TCK")
        ours = (self._own_end - self._own_start) + (self._server_end - self._server_start)
        others = max(0.0, (total - idle - steal) / ticks - ours)
        loads = sorted(self.loads) or [_loadavg()]
        return {
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(self.started)),
            "minutes": round(((self.ended or time.time()) - self.started) / 60, 1),
            "load_first": self.loads[0] if self.loads else loads[0],
            "load_median": loads[len(loads) // 2],
            "load_max": loads[-1],
            "cpu_busy_pct": round(100 * (total - idle) / total, 1),
            "cpu_others_pct": round(100 * others * ticks / total, 1),
            "cpu_steal_pct": round(100 * steal / total, 1),
        }
