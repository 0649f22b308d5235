"""``framework outbox list|show|retry|discard`` on refused rows, against SQLite and the real embedded Valkey."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy import select

from broker.redis import RedisBroker
from framework import Queue, outbox
from framework.outbox import OutboxRelay, outbox_table
from tests.conftest import run_cli

pytestmark = pytest.mark.anyio


async def _states(engine: object) -> dict[str, str | None]:
    async with engine.connect() as conn:  # type: ignore[attr-defined]
        rows = (await conn.execute(select(outbox_table.c.message_id, outbox_table.c.error))).all()
    return {r.message_id: r.error for r in rows}


async def test_refused_rows_are_listed_shown_retried_only_when_accepted_and_discarded(
    broker: RedisBroker, worker_env: dict[str, str], tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    engine = outbox.create_engine(url)
    await outbox.create_tables(engine)
    await broker.declare(Queue("ob.jobs").spec())
    async with engine.begin() as conn:  # events for a name declared as a queue: refused for good
        bad1 = await outbox.add_event(conn, "ob.jobs", {"n": 1, "token": "s3cret"}, key="k")
        bad2 = await outbox.add_event(conn, "ob.jobs", {"n": 2}, key="k")
        good = await outbox.add_event(conn, "ob.placed", {"n": 3}, key="k")
    assert await OutboxRelay(engine, broker).drain() == 3
    db = ["--database-url", url]

    listed = run_cli("outbox", "list", "--json", *db, env=worker_env)
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert [r["message_id"] for r in rows] == [bad1, bad2]
    assert all(r["state"] == "refused" and "declared as a queue" in r["error"] for r in rows)
    table = run_cli("outbox", "list", *db, env=worker_env).stdout
    assert bad1 in table and bad2 in table and good not in table
    shown = json.loads(run_cli("outbox", "show", bad1, "--json", *db, env=worker_env).stdout)
    assert shown["destination"] == "ob.jobs" and json.loads(shown["body"]) == {"n": 1, "token": "[redacted]"}
    missing = run_cli("outbox", "show", "no-such-id", *db, env=worker_env)
    assert missing.returncode == 2 and "no outbox message 'no-such-id'" in missing.stderr

    # nothing fixed yet: retry --all puts back nothing and says why, instead of a round trip to refused
    again = run_cli("outbox", "retry", "--all", *db, env=worker_env)
    assert again.returncode == 1, again.stderr
    assert "0 refused message(s) will be published again" in again.stdout
    assert "2 stay refused" in again.stdout and "declared as a queue" in again.stdout
    assert await OutboxRelay(engine, broker).drain() == 0  # nothing went back in line
    assert set((await _states(engine)).keys()) == {bad1, bad2}

    # the operator fixes the cause (the queue goes), then retries one of them
    assert run_cli("delete", "ob.jobs", "--force", "--yes", env=worker_env).returncode == 0
    broker._specs.clear()
    retried = run_cli("outbox", "retry", bad1, *db, env=worker_env)
    assert retried.returncode == 0 and "1 refused message(s) will be published again" in retried.stdout
    states = await _states(engine)
    assert states[bad1] is None and states[bad2] is not None

    # discard: refused rows only, with confirmation
    refused = run_cli("outbox", "discard", "--all", *db, env=worker_env)
    assert refused.returncode == 2 and "without confirmation: pass --yes" in refused.stderr
    done = run_cli("outbox", "discard", "--all", "--yes", *db, env=worker_env)
    assert done.returncode == 0 and "discarded 1 refused message(s)" in done.stdout
    assert await _states(engine) == {bad1: None}  # the waiting row stays
    await OutboxRelay(engine, broker).drain()
    assert await _states(engine) == {}
    await engine.dispose()
