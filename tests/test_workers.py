"""``framework run --workers N`` (a supervisor over real worker processes), ``--reload``, and the
health endpoints (``--health-port``: /livez, /readyz) against real servers."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import redis

from framework import Queue, SyncClient
from tests.conftest import run_cli
from tests.workers import Workers, wait_for

pytestmark = [pytest.mark.fault, pytest.mark.slow]

JOBS = Queue("jobs", partitions=2)  # as declared by tests/apps/faultapp.py


def free_port(count: int = 1) -> int:
    """A port p such that p .. p+count-1 are free now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + count > 65535:
            continue
        try:
            for p in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return base
    raise AssertionError("no free port range")


def get(port: int, path: str, timeout: float = 5) -> tuple[int, dict]:
    """(status, JSON body) of GET http://127.0.0.1:port/path; (0, {}) when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        body = exc.read()
        try:
            return exc.code, json.loads(body or b"{}")
        except ValueError:
            return exc.code, {"text": body.decode()}
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, {}


def events(log: str, event: str) -> list[dict]:
    """The JSON log lines whose event is ``event``."""
    out = []
    for line in log.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == event:
            out.append(record)
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_three_workers_survive_a_sigkill_lose_nothing_and_all_drain_on_sigterm(
    workers: Workers, redis_url: str, namespace: str
) -> None:
    r = redis.Redis.from_url(redis_url)
    total = 1500
    with SyncClient(redis_url, namespace=namespace) as client:
        client.send_many(JOBS, [{"n": str(i)} for i in range(total)], key=lambda c: c["n"])
    health = free_port(4)
    opts = (
        "--workers",
        "3",
        "--lease-ttl",
        "2",
        "--prefetch",
        "20",
        "--concurrency",
        "4",
        "--health-port",
        str(health),
    )
    sup = workers.start("faultapp:worker", "w", *opts, JOB_SLEEP="0.004")
    wait_for(lambda: len(events(workers.log("w"), "runtime started")) == 3, 60, "three workers to start")
    wait_for(lambda: get(health, "/readyz")[0] == 200, 30, "the supervisor's /readyz to say ready")
    status, body = get(health, "/readyz")
    assert status == 200
    assert [w["worker"] for w in body["workers"]] == [0, 1, 2] and all(w["running"] for w in body["workers"])
    wait_for(lambda: r.hlen(f"{namespace}:test:done") > 100, 60, "some jobs to be processed")
    started = {e["worker"]: e["pid"] for e in events(workers.log("w"), "worker started")}
    victim = started[1]
    os.kill(victim, signal.SIGKILL)
    wait_for(
        lambda: any(e["worker"] == 1 and e["start"] == 2 for e in events(workers.log("w"), "worker started")),
        30,
        "worker 1 to be started again",
    )
    assert any(
        e["pid"] == victim and e["status"] == -9 for e in events(workers.log("w"), "worker exited; restarting it")
    )
    # (its new process may still be importing when the others finish the jobs: a SIGTERM then ends
    # it before it has a runtime to drain, which the supervisor counts as clean)
    wait_for(lambda: len(events(workers.log("w"), "runtime started")) == 4, 60, "worker 1's new runtime to start")
    wait_for(lambda: r.hlen(f"{namespace}:test:done") == total, 120, "every job to be processed")
    assert r.hlen(f"{namespace}:test:done") == total  # none lost
    pids = [e["pid"] for e in events(workers.log("w"), "worker started")]
    sup.send_signal(signal.SIGTERM)
    assert sup.wait(timeout=60) == 0
    log = workers.log("w")
    assert len(events(log, "runtime stopped")) == 3  # each of the three running workers drained
    assert not any(alive(pid) for pid in pids)
    pending = sum(g["pending"] for p in (0, 1) for g in r.xinfo_groups(f"{namespace}:{{jobs:{p}}}"))
    assert pending == 0


def test_a_worker_whose_startup_hook_fails_is_restarted_with_backoff_then_given_up(
    workers: Workers, tmp_path: Path
) -> None:
    hooks = tmp_path / "hooks.log"
    began = time.monotonic()
    sup = workers.start("lifespanapp:broken", "b", "--workers", "2", LIFESPAN_LOG=str(hooks))
    assert sup.wait(timeout=120) == 1
    log = workers.log("b")
    given_up = re.search(r"worker (\d) failed at start 5 times in a row \(last exit status 3\); giving up", log)
    assert given_up, log[-2000:]
    starts = [e for e in events(log, "worker started") if e["worker"] == int(given_up[1])]
    assert len(starts) == 5  # given up after 5 failures at start, not restarted in a loop
    stamps = [time.mktime(time.strptime(e["timestamp"][:19], "%Y-%m-%dT%H:%M:%S")) for e in starts]
    assert stamps[-1] - stamps[0] >= 3  # waits 0.5 + 1 + 2 + 4 s between them (second resolution)
    assert time.monotonic() - began >= 7
    assert "startup hook" in log and "database at db:5432 refused the connection" in log  # the worker's own line
    hooked = {int(line.split()[0]) for line in hooks.read_text().splitlines() if line.endswith("connecting")}
    assert {e["pid"] for e in starts} <= hooked  # each of the 5 starts ran the hook, and failed in it


def test_an_import_error_is_not_restarted(workers: Workers) -> None:
    sup = workers.start("importfails", "i", "--workers", "3")
    assert sup.wait(timeout=60) == 1
    log = workers.log("i")
    assert "RuntimeError at" in log and "this module cannot be imported" in log
    assert "exited with status 2 (a usage error, see above); not restarting it" in log
    assert len([e for e in events(log, "worker started") if e["worker"] == 0]) == 1


@pytest.mark.parametrize("value", ["0", "-2"])
def test_workers_below_one_is_a_one_line_error(worker_env: dict[str, str], value: str) -> None:
    result = run_cli("run", "faultapp:worker", "--workers", value, env=worker_env)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"framework run: error: argument --workers: must be at least 1, got {int(value)} (see framework run --help)"
    ]


def test_a_health_port_in_use_is_a_one_line_error(worker_env: dict[str, str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for extra in ((), ("--workers", "2")):
            result = run_cli("run", "faultapp:worker", "--health-port", str(port), *extra, env=worker_env)
            assert result.returncode == 1, result.stderr
            assert result.stderr.strip().splitlines()[-1] == (
                f"framework run: health port {port} on 127.0.0.1 is in use (--health-port): "
                "pick another port or stop what listens there"
            )


def test_readyz_follows_the_broker_while_livez_stays_up(worker_env: dict[str, str], tmp_path: Path) -> None:
    from broker.redis.embedded import EmbeddedServer

    server = EmbeddedServer(tmp_path / "valkey")
    url = server.ensure_running()
    port = free_port()
    workers = Workers({**worker_env, "REDIS_URL": url}, tmp_path)
    try:
        workers.start("faultapp:worker", "h", "--health-port", str(port), "--ownership", "off")
        wait_for(lambda: get(port, "/readyz")[0] == 200, 60, "/readyz to say ready")
        assert get(port, "/livez")[0] == 200
        assert get(port, "/nope")[0] == 404
        server.stop()
        wait_for(lambda: get(port, "/readyz")[0] == 503, 30, "/readyz to say unready without the broker")
        assert "broker" in get(port, "/readyz")[1]["reason"]
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:  # the outage does not make the worker look dead
            assert get(port, "/livez")[0] == 200
            time.sleep(0.2)
        assert server.ensure_running() == url  # the same port again
        wait_for(lambda: get(port, "/readyz")[0] == 200, 60, "/readyz to say ready again")
        assert get(port, "/livez")[0] == 200
    finally:
        workers.stop_all()
        server.stop()


def test_the_metrics_port_answers_404_off_metrics(worker_env: dict[str, str], workers: Workers) -> None:
    port = free_port()
    workers.start("faultapp:worker", "m", "--metrics-port", str(port))
    wait_for(lambda: _raw_status(port, "/metrics") == 200, 60, "the metrics endpoint")
    assert _raw_status(port, "/livez") == 404
    assert _raw_status(port, "/anything") == 404


def _raw_status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


APP = """
from framework import Service

reloaded = Service("reloaded")


@reloaded.command("reloaded.jobs")
async def job(cmd: dict) -> None:
    '''Version {version}.'''
"""


def test_reload_restarts_the_worker_when_a_python_file_changes(worker_env: dict[str, str], tmp_path: Path) -> None:
    app = tmp_path / "app"
    app.mkdir()
    (app / "reloadapp.py").write_text(APP.format(version=1))
    log_path = tmp_path / "reload.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "framework", "run", "reloadapp:reloaded", "--reload"],
            cwd=app,
            env=worker_env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        read = lambda: log_path.read_text(errors="replace")  # noqa: E731
        wait_for(lambda: len(events(read(), "runtime started")) == 1, 60, "the worker to start")
        time.sleep(1.0)  # a full polling round sees the file as it is
        (app / "reloadapp.py").write_text(APP.format(version=2))
        wait_for(lambda: len(events(read(), "runtime started")) == 2, 60, "the worker to start again")
        changed = events(read(), "file changed: restarting the workers")
        assert changed and changed[0]["file"].endswith("reloadapp.py")
        assert [e["start"] for e in events(read(), "worker started")] == [1, 2]
        assert len(events(read(), "runtime stopped")) == 1  # the first one drained before the restart
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_livez_fails_while_a_workers_event_loop_is_blocked(workers: Workers, redis_url: str, namespace: str) -> None:
    health = free_port(3)
    workers.start("workersapp:stuck", "s", "--workers", "2", "--health-port", str(health))
    wait_for(lambda: get(health, "/readyz")[0] == 200, 60, "both workers to be ready")
    assert get(health, "/livez")[0] == 200
    with SyncClient(redis_url, namespace=namespace) as client:
        client.send("stuck.jobs", {"seconds": 6})
    wait_for(lambda: get(health, "/livez")[0] == 503, 10, "/livez to notice the blocked event loop")
    status, body = get(health, "/livez")
    assert status == 503
    stuck = [w for w in body["workers"] if not w["ok"]]
    assert len(stuck) == 1 and stuck[0]["reason"] == "its event loop did not answer", body
    wait_for(lambda: get(health, "/livez")[0] == 200, 20, "/livez to recover once the loop runs again")


def test_readyz_says_draining_after_sigterm_while_livez_stays_up(
    workers: Workers, redis_url: str, namespace: str
) -> None:
    port = free_port()
    worker = workers.start("workersapp:slow", "d", "--health-port", str(port))
    wait_for(lambda: get(port, "/readyz")[0] == 200, 60, "the worker to be ready")
    with SyncClient(redis_url, namespace=namespace) as client:
        client.send("slow.jobs", {"seconds": 4})
    wait_for(lambda: get(port, "/livez")[1].get("in_flight") == 1, 30, "the message to be in flight")
    worker.send_signal(signal.SIGTERM)
    wait_for(lambda: get(port, "/readyz")[0] == 503, 5, "/readyz to say unready once draining")
    assert get(port, "/readyz")[1]["reason"].startswith("draining")
    assert get(port, "/livez")[0] == 200
    assert worker.wait(timeout=30) == 0


def test_every_worker_gets_the_options_given_to_the_supervisor() -> None:
    from framework.cli import build_parser
    from framework.cli.workers import worker_argv

    parser = build_parser()
    argv = ["run", "faultapp:worker", "--workers", "3", "--concurrency", "8", "--visibility-timeout", "2.5"]
    argv += ["--group-commit-ms", "0.5", "--outbox-relay", "--ownership", "off", "--log-level", "debug"]
    argv += ["--namespace", "ns", "--consumer", "c", "--metrics-port", "9000", "--health-port", "8000", "--reload"]
    args = parser.parse_args(argv)
    again = parser.parse_args(["run", "faultapp:worker", *worker_argv(args, args.run_parser)])
    per_worker = {"workers", "reload", "consumer", "metrics_port", "health_port", "run_parser"}
    for key, value in vars(args).items():
        if key not in per_worker:
            assert getattr(again, key) == value, key
    assert (again.workers, again.reload, again.consumer, again.metrics_port) == (1, False, None, None)


def test_a_sigterm_while_the_workers_start_stops_them_all_and_exits_zero(workers: Workers) -> None:
    sup = workers.start("faultapp:worker", "e", "--workers", "2")
    wait_for(lambda: len(events(workers.log("e"), "worker started")) == 2, 30, "the workers to be spawned")
    sup.send_signal(signal.SIGTERM)  # the workers are still importing, or just connecting
    assert sup.wait(timeout=60) == 0
    pids = [e["pid"] for e in events(workers.log("e"), "worker started")]
    assert len(pids) == 2 and not any(alive(pid) for pid in pids)
