"""Lifespan: a service's resources open once per worker process, reach its handlers, and close after
the drain on SIGTERM; a startup hook that raises stops the worker with one line naming it."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
import redis

from framework import Context, HandlerError, Queue, Service
from framework.client import SyncClient
from framework.lifespan import EXIT_STARTUP_FAILED, StartupError
from framework.testing import ServiceHarness
from tests.workers import Workers, wait_for


def _lines(path: Path) -> list[list[str]]:
    return [line.split(" ", 2) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_resource_opens_once_per_worker_reaches_handlers_and_closes_after_the_drain_on_sigterm(
    workers: Workers, worker_env: dict[str, str], tmp_path: Path
) -> None:
    log = tmp_path / "lifespan.log"
    procs = [workers.start("lifespanapp:service", f"w{i}", LIFESPAN_LOG=str(log)) for i in range(2)]
    # both workers up before any SIGTERM: one still importing has no signal handler yet (dies with -15),
    # and one stopped while its lifespan opens never opens the resource this test counts per worker
    for i in range(2):
        wait_for(lambda i=i: "runtime started" in workers.log(f"w{i}"), 60, f"worker w{i} to start")
    pids = {str(p.pid) for p in procs}
    wait_for(lambda: pids <= {parts[0] for parts in _lines(log) if parts[1:2] == ["open"]}, 30, "both resources open")
    with SyncClient(worker_env["REDIS_URL"], namespace=worker_env["FRAMEWORK_NAMESPACE"]) as client:
        client.send_many(Queue("lifesvc.jobs"), [{"n": n} for n in range(20)])
        wait_for(lambda: sum(parts[1] == "handled" for parts in _lines(log)) == 20, 60, "20 jobs handled")
        client.send("lifesvc.jobs", {"n": "slow", "sleep": 1.5})
        wait_for(lambda: any(parts[1:] == ["slow", "slow started"] for parts in _lines(log)), 30, "the slow job")
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        assert p.wait(timeout=30) == 0
    lines = _lines(log)
    by_pid: dict[str, list[str]] = {}
    for pid, *rest in lines:
        by_pid.setdefault(pid, []).append(" ".join(rest))
    assert set(by_pid) == {str(p.pid) for p in procs}, lines
    handled_total = 0
    for events in by_pid.values():
        opened = [e for e in events if e.startswith("open ")]
        closed = [e for e in events if e.startswith("close ")]
        assert len(opened) == 1 and len(closed) == 1, events  # once per worker process
        resource_id = opened[0].split()[1]
        handled = [e for e in events if e.startswith("handled ")]
        assert all(e.endswith(f"with {resource_id}") for e in handled), events  # every run got this one
        assert closed[0] == f"close {resource_id} after {len(handled)}"
        handled_total += len(handled)
        # declaration order on the way up, the reverse on the way down, after every handler finished
        assert events[0] == "startup" and events[1] == f"open {resource_id}", events
        assert events[-2:] == ["shutdown", closed[0]], events
    assert handled_total == 21  # the slow job in flight at SIGTERM finished before its worker closed


def test_a_startup_hook_that_raises_exits_with_one_line_naming_it_and_consumes_nothing(
    worker_env: dict[str, str], tmp_path: Path, redis_url: str
) -> None:
    log = tmp_path / "lifespan.log"
    namespace = worker_env["FRAMEWORK_NAMESPACE"]
    with SyncClient(redis_url, namespace=namespace) as client:
        client.send(Queue("broken.jobs"), {"n": 1})
    out = subprocess.run(
        [sys.executable, "-m", "framework", "run", "lifespanapp:broken"],
        env={**worker_env, "LIFESPAN_LOG": str(log), "FRAMEWORK_LOG_FORMAT": "console"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == EXIT_STARTUP_FAILED, out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    last = out.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"framework run: startup hook broken\.connect_database failed: ConnectionRefusedError at "
        r"\S*lifespanapp\.py:\d+: database at db:5432 refused the connection",
        last,
    ), out.stderr
    assert [parts[1] for parts in _lines(log)] == ["connecting"]  # the handler never ran
    r = redis.Redis.from_url(redis_url)
    try:
        groups = r.xinfo_groups(f"{namespace}:{{broken.jobs:0}}")
    finally:
        r.close()
    assert len(groups) == 1 and groups[0]["pending"] == 0 and groups[0]["last-delivered-id"] == b"0-0", groups


@pytest.mark.anyio
async def test_the_harness_opens_resources_for_handlers_and_closes_them_after_in_flight_work(
    redis_url: str, namespace: str
) -> None:
    events: list[str] = []
    svc = Service("harnessed")

    @svc.resource
    async def pool() -> AsyncIterator[list[str]]:
        events.append("open")
        yield events
        events.append("close")

    @svc.on_shutdown
    async def flush() -> None:
        events.append("shutdown hook")

    @svc.command("harnessed.jobs")
    def job(cmd: dict, ctx: Context) -> None:  # sync handlers (worker threads) see the resources too
        ctx.resources[pool].append(f"job {cmd['n']}")

    @svc.command("harnessed.slow")
    async def slow(cmd: dict, ctx: Context) -> None:
        await anyio.sleep(0.5)
        ctx.resources[pool].append("slow done")

    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as h:
        await h.client.send_many("harnessed.jobs", [{"n": n} for n in range(3)])
        await h.run_until_idle()
        assert events[0] == "open" and sorted(events[1:]) == ["job 0", "job 1", "job 2"]
        await h.client.send("harnessed.slow", {})
        with anyio.fail_after(10):
            while not h.runtime or not h.runtime.in_flight:
                await anyio.sleep(0.01)
    # leaving the harness stops the runtime: the slow run finishes, then the hooks close, in reverse
    assert events[-3:] == ["slow done", "shutdown hook", "close"], events
    assert events.count("open") == 1


@pytest.mark.anyio
async def test_a_failing_startup_hook_stops_the_harness_naming_it_and_closes_what_opened(
    redis_url: str, namespace: str
) -> None:
    closed: list[str] = []
    svc = Service("halfway")

    @svc.resource
    async def first() -> AsyncIterator[int]:
        yield 1
        closed.append("first")

    @svc.on_startup
    async def check_schema() -> None:
        raise RuntimeError("table orders is missing")

    @svc.command("halfway.jobs")
    async def job(cmd: dict) -> None: ...

    with pytest.raises(Exception) as caught:
        async with ServiceHarness([svc], url=redis_url, namespace=namespace):
            pass
    from framework.lifespan import startup_failure

    failure = startup_failure(caught.value)
    assert isinstance(failure, StartupError)
    assert str(failure) == "startup hook halfway.check_schema failed: RuntimeError: table orders is missing"
    assert closed == ["first"]


def test_hooks_are_checked_when_declared_and_an_unopened_resource_is_named() -> None:
    svc = Service("decl")
    with pytest.raises(HandlerError, match=r"@decl.resource decl.engine: expected an async generator function"):

        @svc.resource  # type: ignore[arg-type]
        async def engine() -> str:
            return "no yield"

    with pytest.raises(HandlerError, match=r"@decl.on_startup decl.setup: expected an async function"):

        @svc.on_startup  # type: ignore[type-var]
        def setup() -> None: ...

    @svc.resource
    async def cache() -> AsyncIterator[dict[str, str]]:
        yield {}

    from framework.lifespan import RESOURCES

    with pytest.raises(LookupError, match=r"resource decl.cache is not open here"):
        RESOURCES[cache]


_TYPED = """
from collections.abc import AsyncIterator

from framework import Context, Resource, Service

svc = Service("typed")


class Engine:
    async def dispose(self) -> None: ...


@svc.resource
async def engine() -> AsyncIterator[Engine]:
    e = Engine()
    yield e
    await e.dispose()


@svc.command("typed.jobs")
async def job(cmd: dict[str, int], ctx: Context) -> None:
    reveal_type(ctx.resources[engine])


declared: Resource[Engine] = engine
wrong: Resource[str] = engine
"""


def test_a_resource_is_typed_by_its_declaration(tmp_path: Path) -> None:
    (tmp_path / "typed.py").write_text(_TYPED)
    (tmp_path / "mypy.ini").write_text("[mypy]\nstrict = True\n[mypy-framework.*,broker.*]\nfollow_imports = silent\n")
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--no-incremental", "typed.py"],
        cwd=tmp_path,
        env={"MYPYPATH": str(Path(__file__).resolve().parents[1]), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = run.stdout
    assert 'Revealed type is "typed.Engine"' in out, out
    assert re.search(
        r'typed.py:\d+: error: Incompatible types in assignment .*"Resource\[Engine\]".*"Resource\[str\]"', out
    ), out
    assert out.count("error:") == 1, out


def test_sigterm_during_a_hanging_startup_hook_stops_the_worker_and_closes_what_opened(
    workers: Workers, tmp_path: Path
) -> None:
    log = tmp_path / "lifespan.log"
    proc = workers.start("lifespanapp:hanging", "hang", LIFESPAN_LOG=str(log))
    wait_for(lambda: any(parts[1] == "waiting" for parts in _lines(log)), 30, "the hanging startup hook")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0
    assert [" ".join(parts[1:]) for parts in _lines(log)] == ["open cache", "waiting", "close cache"]
