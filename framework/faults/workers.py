"""Services as real worker processes (``python -m framework run``), and the faults a fleet sees.

:class:`WorkerPool` starts workers with their logs in files and, optionally, a Prometheus port;
it SIGKILLs one (:meth:`~WorkerPool.kill`), pauses one with SIGSTOP past its partition lease and
resumes it (:meth:`~WorkerPool.pause`), stops the rest with SIGTERM. What the framework did about
each fault is read back from the workers themselves, never guessed: :meth:`~WorkerPool.recovery`
counts the take-overs, claims and lost leases their JSON logs report, and
:meth:`~WorkerPool.counters` scrapes their per-service counters (processed, retried, dead-lettered,
duplicates) from ``/metrics``, keeping the last values of a worker that died.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

__all__ = ["COUNTERS", "Fault", "Recovery", "WorkerPool", "free_port", "scrape_counters", "wait_for"]

COUNTERS = ("processed", "retried", "dead_lettered", "duplicates", "failed")
"""The per-service counters :func:`scrape_counters` returns (``framework_messages_<name>_total``)."""

_LINE = re.compile(r"^framework_messages_(\w+?)_total\{([^}]*)\}\s+([0-9.eE+-]+)$", re.M)
_SERVICE = re.compile(r'framework_service="([^"]+)"')


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], object], timeout: float, what: str, *, poll: float = 0.05) -> None:
    """Poll ``predicate`` until it is true; raise TimeoutError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(poll)


def scrape_counters(port: int, host: str = "127.0.0.1", timeout: float = 2.0) -> dict[str, dict[str, int]]:
    """``service -> counter -> value`` from a worker's Prometheus endpoint (summed over its handlers)."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as response:
        text = response.read().decode()
    found: dict[str, dict[str, int]] = {}
    for name, labels, value in _LINE.findall(text):
        service = _SERVICE.search(labels)
        if name in COUNTERS and service:
            counters = found.setdefault(service.group(1), dict.fromkeys(COUNTERS, 0))
            counters[name] += int(float(value))
    return found


@attrs.frozen
class Fault:
    """A fault injected into a worker: what, when (monotonic seconds), and for how long (pauses)."""

    kind: str  # "SIGKILL", "SIGSTOP"
    worker: str
    at: float
    seconds: float = 0.0


@attrs.frozen
class Recovery:
    """What the workers' logs say the framework did (counts of entries and of events)."""

    taken_over: int = 0  # pending entries of an owned partition taken over from a dead or paused owner
    claimed: int = 0  # entries claimed after the visibility timeout (partitions nobody owns)
    reread: int = 0  # a restarted worker's own pending entries read again
    leases_lost: int = 0  # partitions a paused worker found taken when it woke (fenced: its acks refused)
    leases_acquired: int = 0  # partitions acquired, at start and in take-overs

    @classmethod
    def from_events(cls, events: Sequence[Mapping[str, Any]]) -> Recovery:
        """Count the recovery lines among a worker's JSON log records."""
        counts = dict.fromkeys(("taken_over", "claimed", "reread", "leases_lost", "leases_acquired"), 0)
        for e in events:
            what = str(e.get("event", ""))
            if what.startswith("took over pending entries"):
                counts["taken_over"] += int(e.get("count", 0))
            elif what.startswith("claimed entries idle"):
                counts["claimed"] += int(e.get("count", 0))
            elif what.startswith("re-reading own pending"):
                counts["reread"] += int(e.get("count", 0))
            elif what.startswith("lost ownership of a partition"):
                counts["leases_lost"] += 1
            elif what == "acquired partitions":
                counts["leases_acquired"] += len(e.get("partitions", ()))
        return cls(**counts)


class WorkerPool:
    """Starts ``python -m framework run`` workers, injects faults, stops them; see the module docstring.

    ``env`` is the workers' environment (the broker URL, the namespace, ``DATABASE_URL``...); logs
    go to ``logs/<name>.log`` as JSON lines."""

    def __init__(self, env: Mapping[str, str], logs: Path) -> None:
        self.env = {**env, "FRAMEWORK_LOG_FORMAT": "json"}
        self.logs = Path(logs)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.metrics_ports: dict[str, int] = {}
        self.faults: list[Fault] = []
        self._last: dict[str, dict[str, dict[str, int]]] = {}  # worker -> its last scraped counters
        self._timers: list[threading.Timer] = []

    def start(
        self,
        target: str | Sequence[str],
        name: str,
        *extra: str,
        metrics: bool = True,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start a worker running ``target`` (``module:service``, or several) as consumer ``name``;
        ``extra`` are more ``framework run`` options, ``env`` more environment variables."""
        targets = [target] if isinstance(target, str) else list(target)
        args = [sys.executable, "-m", "framework", "run", *targets, "--consumer", name, *extra]
        if metrics:
            self.metrics_ports[name] = free_port()
            args += ["--metrics-port", str(self.metrics_ports[name])]
        return self.spawn(name, args, env=env)

    def spawn(self, name: str, args: Sequence[str], *, env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start any command as a member of the pool (a relay, a web server), logging to ``logs/<name>.log``."""
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - lives as long as the process
        proc = subprocess.Popen(list(args), env={**self.env, **(env or {})}, stdout=log, stderr=subprocess.STDOUT)
        log.close()  # the child holds its own descriptor
        self.procs[name] = proc
        return proc

    def alive(self, name: str) -> bool:
        """Whether the worker's process is running (a paused one counts as running)."""
        return self.procs[name].poll() is None

    def kill(self, name: str) -> None:
        """SIGKILL the worker: no drain, no acks; what it held stays pending for the others."""
        self.counters()  # keep its last counters
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait()
        self.faults.append(Fault("SIGKILL", name, time.monotonic()))

    def pause(self, name: str, seconds: float) -> threading.Timer:
        """SIGSTOP the worker now and SIGCONT it after ``seconds`` (pass more than its lease TTL)."""
        proc = self.procs[name]
        proc.send_signal(signal.SIGSTOP)
        self.faults.append(Fault("SIGSTOP", name, time.monotonic(), seconds))

        def resume() -> None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)

        timer = threading.Timer(seconds, resume)
        timer.daemon = True
        timer.start()
        self._timers.append(timer)
        return timer

    def counters(self) -> dict[str, dict[str, int]]:
        """``service -> counter -> total`` over every worker (a dead worker's last scraped values count)."""
        for name, port in self.metrics_ports.items():
            if self.alive(name):
                with contextlib.suppress(OSError):  # starting, paused or just killed: keep its last values
                    self._last[name] = scrape_counters(port, timeout=0.5)
        total: dict[str, dict[str, int]] = {}
        for per_service in self._last.values():
            for service, counters in per_service.items():
                into = total.setdefault(service, dict.fromkeys(COUNTERS, 0))
                for k, v in counters.items():
                    into[k] += v
        return total

    def log(self, name: str) -> str:
        """The worker's log so far."""
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        """The JSON records of one worker's log (every worker's when ``name`` is None)."""
        names = [name] if name else list(self.procs)
        found: list[dict[str, Any]] = []
        for n in names:
            for line in self.log(n).splitlines():
                if line.startswith("{"):
                    try:
                        record = json.loads(line)
                    except ValueError:
                        continue
                    record.setdefault("worker", n)
                    found.append(record)
        return found

    def recovery(self) -> Recovery:
        """What the framework did about the faults, from every worker's log."""
        return Recovery.from_events(self.events())

    def stop_all(self, timeout: float = 30.0) -> dict[str, int]:
        """SIGTERM every live process (resuming paused ones), wait ``timeout``, SIGKILL what is left."""
        for timer in self._timers:
            timer.cancel()
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.send_signal(signal.SIGTERM)
        codes: dict[str, int] = {}
        deadline = time.monotonic() + timeout
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
        return codes

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all(timeout=10.0)


def python_path(*extra: str | os.PathLike[str]) -> str:
    """``PYTHONPATH`` for workers: ``extra`` directories first, then the current one."""
    return os.pathsep.join([*map(str, extra), os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)
