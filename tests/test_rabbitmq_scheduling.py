"""Scheduled messages and recurring jobs on RabbitMQ, kept in the Redis beside it
(``broker/redis/side_schedule.py``): listed and cancelled with ``framework schedule``, delivered once
when due, and a recurring job's tick run once across two runtimes.

Runs on the local RabbitMQ (skipped when unreachable, failed under CI) and the session's Redis server.
"""

from __future__ import annotations

import json
import os
import uuid
from collections import Counter
from urllib.parse import quote

import anyio
import attrs
import pytest

from broker.capabilities import as_scheduler
from broker.envelope import now_ms
from framework import Context, Runtime, Service, SyncClient
from framework.scheduling import Tick
from framework.testing import TEST_SETTINGS, ServiceHarness
from tests.conftest import run_cli

pytestmark = [pytest.mark.slow]


@pytest.fixture
def url(rabbitmq_url: str, redis_url: str) -> str:
    return f"{rabbitmq_url}?inbox={quote(redis_url, safe='')}"


def test_framework_schedule_lists_and_cancels_messages_waiting_on_rabbitmq(url: str) -> None:
    namespace = f"rsched-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "BROKER_URL")}
    env.update(BROKER_URL=url, FRAMEWORK_NAMESPACE=namespace)
    with SyncClient(url, namespace=namespace) as client:
        a = client.send("rsched.target", {"n": "a"}, delay=600)
        b = client.send("rsched.target", {"n": "b"}, delay=900)
    listed = run_cli("schedule", "list", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert [row["message_id"] for row in rows] == [a, b]
    assert rows[0]["destination"] == "rsched.target" and json.loads(rows[0]["body"]) == {"n": "a"}
    cancelled = run_cli("schedule", "cancel", a, "--json", env=env)
    assert cancelled.returncode == 0, cancelled.stderr
    assert json.loads(cancelled.stdout) == {"cancelled": [a], "not_scheduled": []}
    status = run_cli("status", "rsched.target", "--json", env=env)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)[0]["scheduled"] == 1
    assert run_cli("schedule", "cancel", b, env=env).returncode == 0  # leave nothing waiting


@attrs.frozen
class Reminder:
    n: int


@pytest.mark.anyio
async def test_due_messages_are_delivered_once_and_cancelled_ones_never(url: str) -> None:
    svc = Service("rsched-reminders")
    got: list[int] = []

    @svc.command("rsched.remind")
    async def remind(r: Reminder) -> None:
        got.append(r.n)

    async with ServiceHarness([svc], url=url) as h:
        kept = [await h.client.send("rsched.remind", Reminder(n), delay=1.0) for n in range(5)]
        dropped = await h.client.send("rsched.remind", Reminder(99), delay=1.0)
        assert await h.client.cancel_scheduled(dropped)
        listed = await as_scheduler(h.broker).scheduled_messages(destination="rsched.remind")
        assert sorted(m.message_id for m in listed) == sorted(kept)
        with anyio.fail_after(20):
            while len(got) < 5:
                await anyio.sleep(0.05)
        await anyio.sleep(1.5)  # a second copy or the cancelled message would arrive now
    assert sorted(got) == list(range(5)), got


@pytest.mark.anyio
async def test_a_recurring_job_runs_each_tick_once_across_two_runtimes(url: str) -> None:
    svc = Service("rsched-jobs")
    ticks: Counter[int] = Counter()

    @svc.every(1)
    async def heartbeat(tick: Tick, ctx: Context) -> None:
        ticks[int(tick.at.timestamp() * 1000)] += 1

    namespace = f"rsched-{uuid.uuid4().hex[:8]}"
    async with ServiceHarness([], url=url, namespace=namespace) as h:
        a = Runtime([svc], broker=h.broker, settings=attrs.evolve(TEST_SETTINGS, consumer="a"))
        b = Runtime([svc], broker=h.broker, settings=attrs.evolve(TEST_SETTINGS, consumer="b"))
        async with anyio.create_task_group() as tg:
            await tg.start(a.run)
            await tg.start(b.run)
            with anyio.fail_after(20):
                while len(ticks) < 3:
                    await anyio.sleep(0.05)
            a.stop()
            b.stop()
    assert set(ticks.values()) == {1}, f"a tick ran twice: {ticks}"
    assert sorted(ticks)[-1] - sorted(ticks)[0] == 1000 * (len(ticks) - 1), f"ticks were skipped: {sorted(ticks)}"


@pytest.mark.anyio
async def test_a_due_message_whose_forwarding_failed_is_published_by_the_next_sweep(url: str) -> None:
    """The mover publishes to RabbitMQ before the schedule forgets a message: when that publish fails
    (here: refused once), the message stays in the hand-off stream and a later sweep publishes it."""
    svc = Service("rsched-forward")
    got: list[int] = []

    @svc.command("rsched.forward")
    async def handle(r: Reminder) -> None:
        got.append(r.n)

    async with ServiceHarness([], url=url) as h:
        broker = h.broker
        schedule = broker.side_schedule  # type: ignore[attr-defined]
        mid = await h.client.send("rsched.forward", Reminder(7), delay=0.2)
        await anyio.sleep(0.3)

        async def refused(envelopes: object) -> None:
            raise ConnectionError("the server went away mid-publish")

        with pytest.raises(ConnectionError):
            await schedule.move(now_ms(), 100, True, refused)
        assert await as_scheduler(broker).count_scheduled("rsched.forward") == 0  # moved: in the hand-off
        assert (await as_scheduler(broker).move_scheduled(now_ms(), sweep=True)).moved == 0  # not stale yet
        schedule.stale_ms = 0  # as if its mover had died STALE_MS ago
        assert (await as_scheduler(broker).move_scheduled(now_ms(), sweep=True)).moved == 1
        h.services = [svc]
        await h.start()
        with anyio.fail_after(30):  # a runtime's start on RabbitMQ takes seconds on a loaded machine
            while not got:
                await anyio.sleep(0.05)
        await h.run_until_idle()
    assert got == [7], f"message {mid} was lost or delivered twice: {got}"
