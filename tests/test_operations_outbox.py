"""The service layer behind the dashboard's Outbox page: refused rows listed (bodies redacted),
retried and discarded by message id only, each action in the audit log (SQLite + embedded Valkey)."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog.testing
from sqlalchemy import select

from broker.capabilities import as_dead_letter_admin
from broker.redis import RedisBroker
from framework import Queue, outbox
from framework.operations.outbox import discard_refused, refused_outbox, retry_refused
from framework.outbox import OutboxRelay, outbox_table

pytestmark = pytest.mark.anyio


async def _states(engine: object) -> dict[str, str | None]:
    async with engine.connect() as conn:  # type: ignore[attr-defined]
        rows = (await conn.execute(select(outbox_table.c.message_id, outbox_table.c.error))).all()
    return {r.message_id: r.error for r in rows}


async def test_refused_rows_are_listed_retried_and_discarded_only_by_the_ids_named(
    broker: RedisBroker, tmp_path: Path
) -> None:
    engine = outbox.create_engine(f"sqlite:///{tmp_path / 'outbox.db'}")
    await outbox.create_tables(engine)
    await broker.declare(Queue("opo.jobs").spec())
    async with engine.begin() as conn:  # events for a name declared as a queue: refused for good
        bad1 = await outbox.add_event(conn, "opo.jobs", {"n": 1, "password": "hunter2"})
        bad2 = await outbox.add_event(conn, "opo.jobs", {"n": 2})
    assert await OutboxRelay(engine, broker).drain() == 2
    async with engine.begin() as conn:
        waiting = await outbox.add_event(conn, "opo.placed", {"n": 3})

    rows, total = await refused_outbox(engine)
    assert total == 2 and [r["id"] for r in rows] == [bad1, bad2]
    assert "declared as a queue" in rows[0]["reason"] and rows[0]["destination"] == "opo.jobs"
    assert "hunter2" not in rows[0]["body"] and "[redacted]" in rows[0]["body"]

    with pytest.raises(ValueError, match="nothing selected"):  # an empty selection never means "all"
        await discard_refused(engine, [], who="ops@test")
    with pytest.raises(ValueError, match="nothing selected"):
        await retry_refused(engine, broker, [""], who="ops@test")

    with structlog.testing.capture_logs() as logged:
        result = await retry_refused(engine, broker, [bad1], who="ops@test")
        # a waiting row named to discard is kept, and counted as not discarded
        gone = await discard_refused(engine, [bad2, waiting], who="ops@test")
    assert result.requeued == 0 and list(result.still_refused) == [bad1]
    assert (gone.asked, gone.done) == (2, 1)
    states = await _states(engine)
    assert set(states) == {bad1, waiting} and states[bad1] is not None and states[waiting] is None
    audits = {e["action"]: e for e in logged if e.get("who") == "ops@test"}
    assert audits["outbox.retry"]["still_refused"] == 1 and audits["outbox.retry"]["ids"] == [bad1]
    assert audits["outbox.discard"]["discarded"] == 1 and audits["outbox.discard"]["ids"] == [bad2, waiting]

    # the operator fixes the cause (the queue goes): the same retry now puts the row back in line
    await as_dead_letter_admin(broker).delete_destination(Queue("opo.jobs").spec(), force=True)
    broker._specs.clear()
    result = await retry_refused(engine, broker, [bad1], who="ops@test")
    assert result.requeued == 1 and not result.still_refused
    assert (await _states(engine))[bad1] is None and (await refused_outbox(engine))[1] == 0
    await engine.dispose()
