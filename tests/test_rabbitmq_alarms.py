"""RabbitMQ under a resource alarm: publishers blocked by the server get one line, not a hang, and
services go on by themselves once the alarm clears, losing nothing and running nothing twice.

The alarm is raised on the local server for a few seconds by lowering its memory watermark
(``rabbitmqctl set_vm_memory_high_watermark absolute 1``) and put back to the value it had; the
server blocks every publishing connection meanwhile (the tests' virtual host included).
"""

from __future__ import annotations

import fcntl
import re
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest

from broker import connect
from broker.conformance.support import command, numbers
from broker.topology import DestinationSpec
from framework import Context, Service
from framework.testing import ServiceHarness

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


def _ctl(*args: str) -> str:
    return subprocess.run(["rabbitmqctl", *args], check=True, capture_output=True, text=True, timeout=60).stdout


_LOCK = Path(tempfile.gettempdir()) / "fw-test-rabbitmq-alarm.lock"
_SANE_ABSOLUTE = 64 * 1024 * 1024  # an absolute watermark below this is an alarm left on, not a setting
_DEFAULT = "0.4"  # RabbitMQ's default relative watermark


@pytest.fixture
def alarm(rabbitmq_url: str) -> Iterator[Any]:
    """``alarm(True)`` raises a memory alarm on the server, ``alarm(False)`` clears it (also at the end).

    Two test runs on one machine share its server: a lock file (released when it closes) keeps one
    run's alarm from blocking, or being cleared by, the other's test; a tiny absolute watermark
    found at the start (an alarm left on by a run that was killed) is replaced by RabbitMQ's default."""
    with _LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield from _alarm()


def _alarm() -> Iterator[Any]:
    before = _ctl("eval", "vm_memory_monitor:get_vm_memory_high_watermark().").strip()  # 0.4 or {absolute,N}
    absolute = re.fullmatch(r"\{absolute,([0-9]+)\}", before)
    if absolute and int(absolute[1]) < _SANE_ABSOLUTE:  # an alarm left on: cleared before the test starts
        _ctl("set_vm_memory_high_watermark", _DEFAULT)
        restore = [_DEFAULT]
    elif absolute:
        restore = ["absolute", absolute[1]]
    elif re.fullmatch(r"[0-9.]+", before):
        restore = [before]
    else:
        pytest.skip(f"cannot read the server's memory watermark to restore it: {before!r}")

    def set_alarm(on: bool) -> None:
        _ctl("set_vm_memory_high_watermark", *(["absolute", "1"] if on else restore))
        deadline = time.monotonic() + 20
        while ("memory" in _ctl("eval", "rabbit_alarm:get_alarms().")) != on:
            assert time.monotonic() < deadline, f"the memory alarm did not turn {'on' if on else 'off'}"
            time.sleep(0.1)

    try:
        yield set_alarm
    finally:
        _ctl("set_vm_memory_high_watermark", *restore)


async def test_a_publish_blocked_by_an_alarm_fails_in_one_line_and_works_again_after(
    rabbitmq_url: str, alarm: Any
) -> None:
    broker = await connect(f"{rabbitmq_url}?timeout=2&inbox=none", namespace=f"alarm-{uuid.uuid4().hex[:8]}")
    try:
        spec = await broker.declare(DestinationSpec("alarm.jobs", "command"))
        [view] = await broker.subscribe(spec, "alarmed")
        await broker.publish([command(spec.name, 0)])  # the publishing channel is open before the alarm
        alarm(True)
        started = time.monotonic()
        with pytest.raises(TimeoutError) as caught:
            await broker.publish([command(spec.name, 1)])
        assert time.monotonic() - started < 6, "a blocked publish waited past its timeout"
        message = str(caught.value)
        assert "\n" not in message and "alarm" in message and "rabbitmqctl" in message, message
        alarm(False)
        await broker.publish([command(spec.name, 2)])  # the same connection works again
        seen: set[int] = set()
        with anyio.fail_after(20):
            while 2 not in seen:
                got = await broker.read(view, "c", 10, 200)
                seen.update(numbers(got))
                await broker.ack(view, got)
        assert {0, 2} <= seen, seen  # 1 may or may not be stored, as the error says
    finally:
        await broker.close()


@attrs.frozen
class Job:
    n: int


async def test_services_go_on_by_themselves_after_an_alarm_losing_and_repeating_nothing(
    rabbitmq_url: str, redis_url: str, alarm: Any
) -> None:
    """Handlers that publish while the server blocks publishers fail their attempts (retried, not lost);
    when the alarm clears every job is handled and every event it sends exists once."""
    jobs, done = Service("alarm-jobs"), Service("alarm-done")
    handled: list[int] = []
    events: list[int] = []
    gate = anyio.Event()

    @jobs.command("alarm.work")
    async def work(job: Job, ctx: Context) -> None:
        if job.n >= 10:
            await gate.wait()  # these run into the alarm: their events cannot be published
        ctx.publish("alarm.worked", Job(job.n))
        handled.append(job.n)

    @done.event("alarm.worked")
    async def worked(job: Job) -> None:
        events.append(job.n)

    url = f"{rabbitmq_url}?timeout=2&inbox={redis_url}"
    async with ServiceHarness([jobs, done], url=url) as harness:
        for n in range(20):
            await harness.client.send("alarm.work", Job(n))
        deadline = time.monotonic() + 30
        while len(events) < 10:
            assert time.monotonic() < deadline, f"handled {handled}, events {events}, stats {harness.stats()}"
            await anyio.sleep(0.05)
        alarm(True)
        gate.set()
        await anyio.sleep(5)  # past the publish timeout: attempts fail, their retries cannot be sent either
        assert len(set(events)) == 10, "events were delivered while the server blocked publishers"
        alarm(False)
        with anyio.fail_after(60):
            while sorted(set(events)) != list(range(20)):
                await anyio.sleep(0.1)
        await harness.run_until_idle(timeout=30)
        stats = harness.stats()
    assert sorted(set(handled)) == list(range(20)), handled
    assert sorted(events) == list(range(20)), f"an event was lost or delivered twice: {sorted(events)}"
    assert len(handled) > 20, f"no attempt met the alarm (runs: {len(handled)}, stats {stats})"
