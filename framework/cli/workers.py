"""``framework run --workers N`` and ``--reload``: a supervisor process over N ``framework run`` workers.

The supervisor imports no service code: each worker is a fresh ``python -m framework run`` process
with the same arguments (spawned, never forked), in its own process group so a terminal's Ctrl-C
reaches the supervisor alone and each worker gets exactly one forwarded signal. What it does:

* starts N workers and logs each one's index, pid, start and exit;
* restarts a worker that exits without being asked to, after 0.5 s, doubling to 30 s (the delay
  starts again once a worker has run 10 s); a worker that fails 5 times in a row within 10 s of
  its start, or exits with status 2 (a usage error: an import error, a bad argument) before ever
  running that long, is not restarted again: the supervisor stops the others and exits 1 with one line;
* forwards SIGTERM/SIGINT to every worker (each drains gracefully, as a lone worker does) and
  exits once all have exited: 0 when every worker exited 0; a second signal is forwarded too
  (the workers then exit at once, as a lone worker does on a second signal);
* ``--reload``: restarts every worker when a ``.py`` file under the working directory or the
  service modules' directories changes (polled every 0.5 s; a failing worker waits for the next
  change instead of being given up);
* ports: worker ``i`` (from 0) serves metrics on ``--metrics-port`` + i, and health on
  ``--health-port`` + 1 + i on 127.0.0.1, while the supervisor serves ``--health-port`` itself,
  aggregating the workers (:mod:`framework.cli.workers_health`);
* consumer names: with ``--consumer NAME`` (or ``$FRAMEWORK_CONSUMER``) worker ``i`` is ``NAME-i``,
  kept across its restarts; otherwise each takes the host's lowest free slot, as lone workers do.

A worker whose supervisor disappears (SIGKILL) notices within a second and shuts down gracefully
(:func:`watch_supervisor`).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import Any

import anyio

from framework.cli.args import metrics_address
from framework.cli.common import UsageError
from framework.cli.reload import ChangeWatcher
from framework.logs import get_logger

__all__ = ["WorkerSlot", "supervise", "watch_supervisor", "worker_argv"]

INITIAL_BACKOFF = 0.5
MAXIMUM_BACKOFF = 30.0
STABLE_AFTER = 10.0  # seconds a worker must run for its exit not to count as a failure at start
GIVE_UP_AFTER = 5  # failures at start in a row
SUPERVISOR_PID = "FRAMEWORK_SUPERVISOR_PID"

# options the supervisor sets per worker (or handles itself), never copied as they are
_PER_WORKER = {"targets", "workers", "reload", "health_port", "health_host", "metrics_port", "metrics_host", "consumer"}

log = get_logger("framework.supervisor")


def worker_argv(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """The options of ``framework run`` that every worker gets as given (those differing from the
    defaults), rebuilt from the parsed ``args``; per-worker ones are left out."""
    out: list[str] = []
    for action in parser._actions:
        if not action.option_strings or action.dest in _PER_WORKER or action.dest == "help":
            continue
        if not hasattr(args, action.dest):  # SUPPRESS defaults (--log-level) not given
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        flag = max(action.option_strings, key=len)
        if isinstance(action, argparse._StoreTrueAction) or (action.nargs == "?" and value == action.const):
            out.append(flag)
        else:
            out += [flag, str(value)]
    return out


class WorkerSlot:
    """Worker ``index``: its current process, and its restart history."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.starts = 0
        self.failures = 0  # failures at start in a row
        self.backoff = INITIAL_BACKOFF
        self.next_start = 0.0  # monotonic time of the next start (when not running)
        self.restart_now = False  # --reload: start again as soon as it has exited
        self.stable = False  # ran STABLE_AFTER once: a usage error at exit is not final
        self.status: int | None = None  # exit status of the last process

    @property
    def running(self) -> bool:
        """Whether its process is alive (not yet reaped)."""
        return self.proc is not None and self.proc.returncode is None

    def describe(self) -> dict[str, Any]:
        """Its state for the supervisor's health answers and logs."""
        return {
            "worker": self.index,
            "pid": self.proc.pid if self.running and self.proc is not None else None,
            "running": self.running,
            "starts": self.starts,
            "last_exit": self.status,
        }


class Supervisor:
    """Runs the workers until they have all exited (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
        self.args = args
        self.count: int = args.workers
        self.common = worker_argv(args, parser)
        self.slots = [WorkerSlot(i) for i in range(self.count)]
        self.signals: list[int] = []
        self.stopping = False
        self.forced: int | None = None
        self.forwarded: int | None = None  # the first signal forwarded to the workers
        self.gave_up: str | None = None
        self.metrics_port, self.metrics_host = metrics_address(args)
        self.health_port: int | None = args.health_port
        self.consumer = args.consumer or os.environ.get("FRAMEWORK_CONSUMER") or None
        self.watcher = ChangeWatcher.for_targets(args.targets) if args.reload else None

    def worker_command(self, slot: WorkerSlot) -> tuple[list[str], dict[str, str]]:
        """The command line and environment of ``slot``'s worker."""
        cmd = [sys.executable, "-m", "framework", "run", *self.args.targets, *self.common]
        env = dict(os.environ, FRAMEWORK_WORKER_INDEX=str(slot.index), **{SUPERVISOR_PID: str(os.getpid())})
        if self.metrics_port is not None:
            cmd += ["--metrics-port", str(self.metrics_port + slot.index), "--metrics-host", self.metrics_host]
        if self.health_port is not None:
            cmd += ["--health-port", str(self.worker_health_port(slot.index)), "--health-host", "127.0.0.1"]
        if self.consumer:
            env["FRAMEWORK_CONSUMER"] = f"{self.consumer}-{slot.index}"
        return cmd, env

    def worker_health_port(self, index: int) -> int:
        """The port worker ``index`` serves its own health on (127.0.0.1)."""
        assert self.health_port is not None
        return self.health_port + 1 + index

    def start(self, slot: WorkerSlot) -> None:
        """Start ``slot``'s worker now."""
        cmd, env = self.worker_command(slot)
        slot.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, process_group=0)
        slot.started = time.monotonic()
        slot.starts += 1
        slot.restart_now = False
        log.info("worker started", worker=slot.index, pid=slot.proc.pid, start=slot.starts)

    def exited(self, slot: WorkerSlot, status: int) -> None:
        """Account for ``slot``'s worker having exited with ``status``; plan its restart."""
        assert slot.proc is not None
        ran = time.monotonic() - slot.started
        slot.status = status
        fields = {"worker": slot.index, "pid": slot.proc.pid, "status": status, "ran_s": round(ran, 2)}
        if self.stopping:
            log.info("worker exited", **fields)
            return
        if slot.restart_now:  # --reload asked for it
            return
        if ran >= STABLE_AFTER:
            slot.stable = True
            slot.failures, slot.backoff = 0, INITIAL_BACKOFF
        else:
            slot.failures += 1
        if self.watcher is not None and slot.failures:
            slot.next_start = float("inf")  # until a file changes
            log.warning("worker exited; waiting for a file change to restart it", **fields)
            return
        if status == 2 and not slot.stable:
            self.give_up(f"worker {slot.index} exited with status 2 (a usage error, see above); not restarting it")
            return
        if slot.failures >= GIVE_UP_AFTER:
            self.give_up(
                f"worker {slot.index} failed at start {slot.failures} times in a row (last exit status {status}); "
                "giving up (see its error above)"
            )
            return
        slot.next_start = time.monotonic() + slot.backoff
        log.warning("worker exited; restarting it", retry_in_s=slot.backoff, **fields)
        slot.backoff = min(slot.backoff * 2, MAXIMUM_BACKOFF)

    def give_up(self, why: str) -> None:
        """Stop every worker and remember ``why`` for the exit line."""
        self.gave_up = why
        self.stop(signal.SIGTERM)

    def stop(self, signum: int) -> None:
        """Forward ``signum`` to every running worker; a second call forces their exit."""
        if self.stopping:
            self.forced = signum
            log.warning("second signal: forwarding it, the workers exit now", signal=signal.Signals(signum).name)
        else:
            self.stopping = True
            self.forwarded = signum
            log.info("stopping the workers gracefully", signal=signal.Signals(signum).name)
        for slot in self.slots:
            if slot.running and slot.proc is not None:
                slot.proc.send_signal(signum)

    def reload(self, changed: str) -> None:
        """Restart every worker gracefully because ``changed`` changed."""
        log.info("file changed: restarting the workers", file=changed)
        for slot in self.slots:
            draining = slot.restart_now and slot.running  # signalled already: a second signal would force it
            slot.restart_now = True
            slot.failures, slot.backoff, slot.next_start = 0, INITIAL_BACKOFF, 0.0
            if slot.running and slot.proc is not None and not draining:
                slot.proc.send_signal(signal.SIGTERM)

    def step(self) -> bool:
        """One round: signals, exits, restarts, file changes; False once everything has exited."""
        while self.signals:
            self.stop(self.signals.pop(0))
        for slot in self.slots:
            if slot.proc is not None and slot.proc.returncode is None:
                status = slot.proc.poll()
                if status is not None:
                    self.exited(slot, status)
        if self.stopping:
            return any(slot.running for slot in self.slots)
        now = time.monotonic()
        for slot in self.slots:
            if not slot.running and (slot.restart_now or now >= slot.next_start):
                self.start(slot)
        if self.watcher is not None:
            changed = self.watcher.changed()
            if changed is not None:
                self.reload(changed)
        return True

    def run(self) -> int:
        """Supervise until every worker has exited; the exit status of the supervisor."""
        health = None
        if self.health_port is not None:
            from framework.cli.workers_health import AggregateHealth
            from framework.health import bind_error

            host = self.args.health_host or "127.0.0.1"
            try:
                health = AggregateHealth(self, host, self.health_port)
            except OSError as exc:
                print(f"framework run: {bind_error(exc, host, self.health_port)}", file=sys.stderr)
                return 1
        previous = {s: signal.signal(s, lambda n, _f: self.signals.append(n)) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            log.info("supervisor started", workers=self.count, pid=os.getpid(), reload=self.watcher is not None)
            while self.step():
                time.sleep(0.05)
        finally:
            if health is not None:
                health.close()
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            for slot in self.slots:  # an error in the loop: no worker outlives its supervisor
                if slot.running and slot.proc is not None:
                    slot.proc.kill()
                    slot.proc.wait()
        if self.gave_up is not None:
            print(f"framework run: {self.gave_up}", file=sys.stderr)
            return 1
        if self.forced is not None:
            return 128 + self.forced
        statuses = [slot.status for slot in self.slots if slot.status is not None]
        log.info("supervisor stopped", workers=self.count, exit_statuses=statuses)
        # killed by the forwarded signal itself: it came before the worker could handle it (while it
        # imported), so nothing had started there
        clean = (0, -self.forwarded if self.forwarded else 0)
        return 0 if all(s in clean for s in statuses) else 1


def supervise(args: argparse.Namespace) -> int:
    """Run ``framework run`` under a supervisor (``--workers N`` above 1, or ``--reload``)."""
    parser = args.run_parser
    if args.health_port is not None:
        last = args.health_port + args.workers
        if last > 65535:
            raise UsageError(f"--health-port {args.health_port} leaves no room for {args.workers} workers' ports")
        metrics_port, _ = metrics_address(args)
        if metrics_port is not None and set(range(args.health_port, last + 1)) & set(
            range(metrics_port, metrics_port + args.workers)
        ):
            raise UsageError(
                f"--health-port {args.health_port} and --metrics-port {metrics_port} overlap with {args.workers} "
                f"workers (health uses {args.health_port}-{last}, metrics {metrics_port}-"
                f"{metrics_port + args.workers - 1}): move one of them"
            )
    return Supervisor(args, parser).run()


async def watch_supervisor(runtime: Any) -> None:
    """In a worker started by a supervisor: stop gracefully once the supervisor is gone."""
    pid = os.environ.get(SUPERVISOR_PID, "")
    if not pid.isdigit():
        return
    while os.getppid() == int(pid):
        await anyio.sleep(1.0)
    log.warning("the supervisor is gone: shutting down", supervisor=int(pid))
    runtime.stop()
