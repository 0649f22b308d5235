"""Network faults between a worker and the broker: silent stalls and abrupt resets, through a TCP proxy.

Workers are real ``python -m framework run`` processes (uvloop, as the CLI runs by default) whose
broker URL points at :class:`tests.netproxy.NetProxy`. Each credit records its processing in
Redis atomically with its inbox mark and ack, so the tests count lost and doubled messages.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from framework import Queue, SyncClient
from tests.netproxy import NetProxy

pytestmark = [pytest.mark.fault, pytest.mark.slow]

CREDITS = Queue("wallet.credit", partitions=2)  # as declared by tests/apps/faultapp.py
COMMAND_TIMEOUT = "2"  # seconds: the worker notices a silent connection within BLOCK + 2 s
SHUTDOWN_TIMEOUT = 4.0


class Worker:
    """One worker process with its log."""

    def __init__(self, env: dict[str, str], log: Path, consumer: str, url: str, *extra: str) -> None:
        """Start ``faultapp:wallet`` with ``REDIS_URL=url``."""
        self.log_path = log
        out = open(log, "ab")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "framework",
                "run",
                "faultapp:wallet",
                "--consumer",
                consumer,
                "--shutdown-timeout",
                str(SHUTDOWN_TIMEOUT),
                *extra,
            ],
            env={**env, "REDIS_URL": url, "FRAMEWORK_COMMAND_TIMEOUT": COMMAND_TIMEOUT},
            stdout=out,
            stderr=subprocess.STDOUT,
        )

    def lines(self) -> list[dict[str, object]]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                out.append({"event": line})
        return out

    def events(self, text: str) -> list[dict[str, object]]:
        return [e for e in self.lines() if text in str(e.get("event", ""))]

    def stop(self) -> tuple[int, float]:
        """SIGTERM; return the exit code and the seconds it took."""
        began = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=SHUTDOWN_TIMEOUT + 20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            code = -9
        return code, time.monotonic() - began


@pytest.fixture
def start(worker_env: dict[str, str], tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    env = {k: v for k, v in worker_env.items() if k != "FRAMEWORK_EVENT_LOOP"}  # the CLI's default: uvloop
    started: list[Worker] = []

    def _start(consumer: str, url: str, *extra: str, **more: str) -> Worker:
        w = Worker({**env, **more}, tmp_path / f"{consumer}.log", consumer, url, *extra)
        started.append(w)
        return w

    yield _start
    for w in started:
        if w.proc.poll() is None:
            w.proc.kill()
            w.proc.wait()


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll until ``predicate``; return the seconds it took."""
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if predicate():
            return time.monotonic() - began
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def send_credits(redis_url: str, namespace: str, total: int, first: int = 0) -> None:
    with SyncClient(redis_url, namespace=namespace) as client:
        client.send_many(CREDITS, [{"n": str(i), "account": f"acct-{i % 7}", "amount": 1} for i in range(first, total)])


class Ledger:
    """What the handlers recorded (read straight from the server, not through the proxy)."""

    def __init__(self, redis_url: str, namespace: str) -> None:
        self.r = redis.Redis.from_url(redis_url)
        self.ns = namespace

    def applied(self) -> int:
        return int(self.r.hlen(f"{self.ns}:test:applied"))

    def queued(self) -> int:
        return sum(int(self.r.xlen(f"{self.ns}:{{wallet.credit:{p}}}")) for p in (0, 1))

    def assert_exactly_once(self, total: int) -> None:
        counts = [int(v) for v in self.r.hvals(f"{self.ns}:test:applied")]
        assert len(counts) == total, f"{total - len(counts)} credits lost"
        assert set(counts) == {1}, f"{sum(c > 1 for c in counts)} credits applied twice"
        assert self.queued() == 0, "entries left in the queue"


OPTS = ("--visibility-timeout", "6", "--prefetch", "20", "--concurrency", "4")
SLOW = {"JOB_SLEEP": "0.01"}


def test_a_silent_stall_is_survived_drained_exactly_once_and_shutdown_keeps_its_bound(
    proxy: NetProxy, start: Callable[..., Worker], redis_url: str, namespace: str
) -> None:
    ledger = Ledger(redis_url, namespace)
    total = 800
    send_credits(redis_url, namespace, total)
    w = start("w", proxy.url(redis_url), *OPTS, **SLOW)
    wait_for(lambda: ledger.applied() >= 150, 30, "the worker to get going")
    proxy.stall()
    time.sleep(3)
    during = ledger.applied()
    assert during < total, "the stall came too late to test anything"
    proxy.resume()
    # The stalled connections never carry bytes again: the worker must notice and reconnect.
    wait_for(lambda: ledger.applied() > during + 20, 6, "processing to resume within the visibility timeout")
    wait_for(lambda: ledger.applied() == total and ledger.queued() == 0, 30, "every credit")
    ledger.assert_exactly_once(total)
    code, seconds = w.stop()
    assert code == 0
    assert seconds < SHUTDOWN_TIMEOUT + 3, f"shutdown took {seconds:.1f}s"


def test_b_sigterm_during_a_stall_exits_in_time_and_loses_nothing(
    proxy: NetProxy, start: Callable[..., Worker], redis_url: str, namespace: str
) -> None:
    ledger = Ledger(redis_url, namespace)
    total = 600
    send_credits(redis_url, namespace, total)
    w = start("w", proxy.url(redis_url), *OPTS, **SLOW)
    wait_for(lambda: ledger.applied() >= 100, 30, "the worker to get going")
    proxy.stall()
    time.sleep(1)
    code, seconds = w.stop()
    assert code == 0, w.log_path.read_text()[-3000:]
    assert seconds < SHUTDOWN_TIMEOUT + 3, f"shutdown during a stall took {seconds:.1f}s"
    proxy.resume()
    assert ledger.applied() < total
    other = start("other", redis_url, *OPTS, JOB_SLEEP="0")  # straight to the server: takes over what was left pending
    wait_for(lambda: ledger.applied() == total and ledger.queued() == 0, 40, "every credit")
    ledger.assert_exactly_once(total)
    assert other.stop()[0] == 0


def _flap(proxy: NetProxy, times: int, every: float) -> None:
    """Reset every connection ``times`` times, ``every`` seconds apart (no wait after the last)."""
    for i in range(times):
        if i:
            time.sleep(every)
        proxy.reset_all()


def test_c_repeated_resets_reconnect_at_once_and_log_one_pair_per_outage(
    proxy: NetProxy, start: Callable[..., Worker], redis_url: str, namespace: str
) -> None:
    ledger = Ledger(redis_url, namespace)
    w = start("w", proxy.url(redis_url), *OPTS)
    send_credits(redis_url, namespace, 1)
    wait_for(lambda: ledger.applied() == 1, 30, "the first credit")
    flaps = 10  # 0.5 s apart: before the fix a fetcher failing at the last one slept 3.2 s
    _flap(proxy, flaps, 0.5)
    send_credits(redis_url, namespace, 2, first=1)
    latency = wait_for(lambda: ledger.applied() == 2, 15, "a credit after the last reset")
    # before the fix this was the 3.2 s back-off plus the work; 2.5 s leaves room for a loaded machine
    assert latency < 2.5, f"{latency:.1f}s to process again after the network came back"
    wait_for(
        lambda: len(w.events("connection to the broker restored")) == len(w.events("connection to the broker lost")),
        5,
        "a 'restored' line for every 'lost' line",
    )
    lost = w.events("connection to the broker lost")
    assert 1 <= len(lost) <= flaps, [e.get("actor") for e in lost]
    assert not w.events("broker unreachable"), "a line per retry per task"
    assert not w.events("actor crashed")
    ledger.assert_exactly_once(2)
    assert w.stop()[0] == 0


def test_d_resets_under_uvloop_are_connection_errors_not_crashes(
    proxy: NetProxy, start: Callable[..., Worker], redis_url: str, namespace: str
) -> None:
    ledger = Ledger(redis_url, namespace)
    total = 1500
    send_credits(redis_url, namespace, total)
    opts = ("--visibility-timeout", "3", "--prefetch", "50", "--concurrency", "8")
    w = start("w", proxy.url(redis_url), *opts, JOB_SLEEP="0.002")
    wait_for(lambda: ledger.applied() >= 100, 30, "the worker to get going")
    _flap(proxy, 6, 0.3)
    wait_for(lambda: ledger.applied() == total and ledger.queued() == 0, 40, "every credit")
    ledger.assert_exactly_once(total)
    assert w.stop()[0] == 0
    text = w.log_path.read_text(errors="replace")
    for crash in ("actor crashed", "processing failed", "could not count a redelivery", "TCPTransport closed"):
        assert crash not in text, f"{crash!r} in the worker's log:\n{text[-4000:]}"
