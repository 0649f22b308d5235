"""The outbox relay: publishes committed outbox rows to the broker, in order per key, and marks them sent.

Claiming work
    PostgreSQL: each batch is one transaction. It locks up to ``max_shards`` rows of
    ``framework_outbox_shards`` that have pending messages (``FOR UPDATE SKIP LOCKED``, the shard
    with the oldest pending message first), reads the oldest pending rows of those shards in
    ``seq`` order, publishes them in one pipeline, marks them sent and commits. Other relays skip
    the locked shards and take the rest, so every key (it lives in one shard) is published by one
    relay at a time, in order, and several relays can run at once.
    SQLite: a batch takes the database's write lock (``BEGIN IMMEDIATE``); relays take turns.

Crashes
    Rows are marked sent in the transaction that published them. A relay that dies between the
    publish and the commit leaves the rows pending: the next batch publishes them again with the
    same message ids, which downstream inboxes drop. Nothing is lost; copies are possible.

Waking
    On PostgreSQL a statement trigger on the outbox table NOTIFYs ``framework_outbox`` at commit
    and the relay LISTENs on a connection of its own, polling only as a fallback (default every
    2 s). On SQLite it polls (default every 50 ms) with a read that takes no lock.

Cleanup
    Every ``cleanup_interval`` it deletes sent rows older than ``retention`` and inbox records
    older than ``inbox_retention``, in chunks. A message the broker refuses for good (a name
    declared as a queue used as a topic, say) is set aside with its reason in ``error`` and logged;
    ``framework outbox retry`` puts such rows back once the cause is fixed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import anyio.abc
import orjson
from sqlalchemy import BigInteger, Row, SmallInteger, any_, bindparam, delete, inspect, select, text, tuple_, update
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from broker import ConfigurationError, DestinationSpec, Envelope, RedisBroker, validate_name
from framework.logs import get_logger
from framework.outbox import NOTIFY_CHANNEL, inbox_table, outbox_table
from framework.sql import DatabaseUnavailable, libpq_url, ping, redact_url

__all__ = ["OutboxRelay"]

log = get_logger("framework.outbox")

_BACKOFF_MIN, _BACKOFF_MAX = 0.1, 15.0
_BATCH_TIMEOUT = 60.0  # a batch in progress is finished even when cancelled, but not forever
_CLEANUP_CHUNK = 5000
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MS = timedelta(milliseconds=1)

_o, _i = outbox_table, inbox_table
_PENDING = _o.c.sent_at.is_(None) & _o.c.error.is_(None)
_ROWS = (
    select(_o.c.seq, _o.c.message_id, _o.c.destination, _o.c.kind, _o.c.type, _o.c.key, _o.c.headers, _o.c.body,
           _o.c.spec, _o.c.created_at)
    .where(_PENDING)
    .order_by(_o.c.seq)
    .limit(bindparam("limit"))
)
_MARK_FAILED = update(_o).where(_o.c.seq == bindparam("b_seq")).values(error=bindparam("b_error"))

# PostgreSQL: shards are the unit of claiming; the oldest pending message picks which go first.
_PG_CLAIM = text("""
    SELECT s.shard FROM framework_outbox_shards AS s
    WHERE EXISTS (SELECT 1 FROM framework_outbox AS o
                  WHERE o.shard = s.shard AND o.sent_at IS NULL AND o.error IS NULL)
    ORDER BY (SELECT min(o.seq) FROM framework_outbox AS o
              WHERE o.shard = s.shard AND o.sent_at IS NULL AND o.error IS NULL)
    LIMIT :limit
    FOR UPDATE OF s SKIP LOCKED
""")
_PG_ROWS = _ROWS.where(_o.c.shard == any_(bindparam("shards", type_=ARRAY(SmallInteger))))
_PG_MARK_SENT = (update(_o).where(_o.c.seq == any_(bindparam("seqs", type_=ARRAY(BigInteger))))
                 .values(sent_at=bindparam("now")))

# SQLite: one writer at a time; a lock-free read decides whether to take the write lock at all.
_SQLITE_ANY_PENDING = select(_o.c.seq).where(_PENDING).limit(1)
_SQLITE_MARK_SENT = update(_o).where(_o.c.seq.in_(bindparam("seqs", expanding=True))).values(sent_at=bindparam("now"))


def _cleanup_statements(postgres: bool) -> tuple[Any, Any]:
    sent = select(_o.c.seq).where(_o.c.sent_at < bindparam("cutoff")).limit(bindparam("limit"))
    seen = (select(_i.c.group_name, _i.c.message_id).where(_i.c.processed_at < bindparam("cutoff"))
            .limit(bindparam("limit")))
    if postgres:  # two relays cleaning at once split the rows instead of waiting for each other
        sent, seen = sent.with_for_update(skip_locked=True), seen.with_for_update(skip_locked=True)
    return (delete(_o).where(_o.c.seq.in_(sent)),
            delete(_i).where(tuple_(_i.c.group_name, _i.c.message_id).in_(seen)))


def _ms(value: datetime) -> int:
    if value.tzinfo is None:  # SQLite hands back naive datetimes; they are stored in UTC
        value = value.replace(tzinfo=UTC)
    return (value - _EPOCH) // _MS


class OutboxRelay:
    """Publishes committed outbox messages to ``broker`` with their own ids; marks them sent.

    ``batch_size`` messages go per transaction and pipeline. ``poll_interval`` (seconds) is how
    often an idle relay looks for work: only a fallback on PostgreSQL, where NOTIFY wakes it
    (default 2 s); the wake-up on SQLite (default 0.05 s). ``retention`` (seconds, default a
    day) is how long sent rows are kept; ``inbox_retention`` (default a week) how long inbox
    records are. ``max_shards`` (of 64) bounds what one PostgreSQL batch claims, so that other
    relays find work too. ``published`` counts the messages this instance published.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        broker: RedisBroker,
        *,
        batch_size: int = 1000,
        poll_interval: float | None = None,
        retention: float = 24 * 3600.0,
        inbox_retention: float = 7 * 24 * 3600.0,
        cleanup_interval: float = 60.0,
        max_shards: int = 16,
    ) -> None:
        if engine.dialect.name not in ("postgresql", "sqlite"):
            raise ValueError(f"the outbox relay supports PostgreSQL and SQLite, not {engine.dialect.name!r}")
        if batch_size < 1 or max_shards < 1:
            raise ValueError("batch_size and max_shards must be at least 1")
        self.engine = engine
        self.broker = broker
        self.batch_size = batch_size
        self.postgres = engine.dialect.name == "postgresql"
        self.poll_interval = poll_interval if poll_interval is not None else (2.0 if self.postgres else 0.05)
        self.retention = retention
        self.inbox_retention = inbox_retention
        self.cleanup_interval = cleanup_interval
        self.max_shards = max_shards
        self.published = 0
        self._accepted: set[tuple[str, str]] = set()
        self._cleanup_sent, self._cleanup_inbox = _cleanup_statements(self.postgres)
        self._stopping = False
        self._wake: anyio.Event | None = None
        self._stopped: anyio.Event | None = None

    # -- one batch ----------------------------------------------------------------------------

    async def run_once(self) -> int:
        """Publish one batch of pending messages; return how many rows it settled (0: nothing to do).

        Settled rows are published and marked sent, or (rarely) set aside because the broker
        refuses them for good. Raises on database or broker errors, leaving the rows pending.
        """
        if self.postgres:
            async with self.engine.begin() as conn:
                shards = list((await conn.execute(_PG_CLAIM, {"limit": self.max_shards})).scalars())
                if not shards:
                    return 0
                rows = (await conn.execute(_PG_ROWS, {"shards": shards, "limit": self.batch_size})).all()
                return await self._publish(conn, rows)
        async with self.engine.connect() as conn:
            if (await conn.execute(_SQLITE_ANY_PENDING)).first() is None:
                return 0
            await conn.exec_driver_sql("BEGIN IMMEDIATE")
            rows = (await conn.execute(_ROWS, {"limit": self.batch_size})).all()
            settled = await self._publish(conn, rows)
            await conn.commit()
            return settled

    async def drain(self) -> int:
        """Run batches until nothing is pending (or left to this relay); return the rows settled."""
        total = 0
        while settled := await self.run_once():
            total += settled
        return total

    async def _publish(self, conn: AsyncConnection, rows: Sequence[Row[Any]]) -> int:
        if not rows:
            return 0
        seqs: list[int] = []
        envelopes: list[Envelope] = []
        specs: dict[str, str] = {}
        for seq, message_id, destination, kind, type_, key, headers, body, spec, created_at in rows:
            seqs.append(seq)
            envelopes.append(Envelope(
                destination=destination, kind=kind, type=type_, body=body if type(body) is bytes else bytes(body),
                key=key, headers=orjson.loads(headers) if headers != "{}" else {}, id=message_id,
                published_at=_ms(created_at),
            ))
            if spec is not None:
                specs[destination] = spec
        failed: list[dict[str, Any]] = []
        refused = await self._refused(envelopes, specs)
        if refused:
            kept = [(s, e) for s, e in zip(seqs, envelopes, strict=True) if (e.destination, e.kind) not in refused]
            for seq, env in zip(seqs, envelopes, strict=True):
                reason = refused.get((env.destination, env.kind))
                if reason is not None:
                    failed.append({"b_seq": seq, "b_error": reason})
                    log.error("outbox message refused by the broker; set aside (fix it, then `framework outbox "
                              "retry`)", message_id=env.id, destination=env.destination, error=reason)
            seqs, envelopes = [s for s, _ in kept], [e for _, e in kept]
        if envelopes:
            await self.broker.publish(envelopes)
            mark = _PG_MARK_SENT if self.postgres else _SQLITE_MARK_SENT
            await conn.execute(mark, {"now": datetime.now(UTC), "seqs": seqs})
        if failed:
            await conn.execute(_MARK_FAILED, failed)
        self.published += len(envelopes)
        log.debug("outbox batch published", count=len(envelopes), refused=len(failed))
        return len(envelopes) + len(failed)

    async def _refused(self, envelopes: list[Envelope], specs: dict[str, str]) -> dict[tuple[str, str], str]:
        """Destinations the broker will never accept these messages for, with the reason."""
        out: dict[tuple[str, str], str] = {}
        for destination, kind in {(e.destination, e.kind) for e in envelopes}:
            if (destination, kind) in self._accepted:
                continue
            try:
                validate_name("destination", destination)
                if destination in specs:
                    await self.broker.declare(DestinationSpec.from_json(orjson.loads(specs[destination])))
                declared = await self.broker.get_destination(destination)
                if declared is not None and declared.kind != kind:
                    noun = "a queue (commands)" if declared.kind == "command" else "a topic (events)"
                    raise ConfigurationError(f"{destination!r} is declared as {noun}, but this message is a {kind}")
            except (ConfigurationError, ValueError, TypeError) as exc:
                out[(destination, kind)] = str(exc)
            else:
                self._accepted.add((destination, kind))
        return out

    # -- housekeeping -------------------------------------------------------------------------

    async def cleanup(self) -> tuple[int, int]:
        """Delete sent rows older than ``retention`` and inbox records older than ``inbox_retention``.

        Returns (outbox rows deleted, inbox rows deleted). Pending rows are never deleted.
        """
        now = datetime.now(UTC)
        sent = await self._delete_in_chunks(self._cleanup_sent, now - timedelta(seconds=self.retention))
        seen = await self._delete_in_chunks(self._cleanup_inbox, now - timedelta(seconds=self.inbox_retention))
        if sent or seen:
            log.info("outbox cleanup", sent_rows_deleted=sent, inbox_rows_deleted=seen)
        return sent, seen

    async def _delete_in_chunks(self, statement: Any, cutoff: datetime) -> int:
        total = 0
        while True:
            async with self.engine.begin() as conn:
                deleted = (await conn.execute(statement, {"cutoff": cutoff, "limit": _CLEANUP_CHUNK})).rowcount
            total += deleted
            if deleted < _CLEANUP_CHUNK:
                return total

    async def check(self) -> None:
        """Check the database answers and has the outbox tables; raise DatabaseUnavailable if not."""
        await ping(self.engine)
        async with self.engine.connect() as conn:
            present = await conn.run_sync(lambda c: inspect(c).has_table(outbox_table.name))
        if not present:
            raise DatabaseUnavailable(
                f"the outbox tables do not exist in {redact_url(self.engine.url)}: run `framework outbox migrate "
                "--database-url URL` (or apply `framework outbox ddl` with your migration tool)"
            )

    # -- the loop -----------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask :meth:`run` to return once the batch in progress is published and marked."""
        self._stopping = True
        for event in (self._wake, self._stopped):
            if event is not None:
                event.set()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Publish until cancelled or :meth:`stop` is called; survives database and broker outages.

        A batch in progress is finished (for up to a minute) even when the task is cancelled.
        Errors are logged and retried with exponential backoff (up to 15 s); cleanup runs at start
        and every ``cleanup_interval``.
        """
        self._wake, self._stopped = anyio.Event(), anyio.Event()
        if self._stopping:
            self._stopped.set()
        log.info("outbox relay started", database=redact_url(self.engine.url), namespace=self.broker.namespace,
                 batch_size=self.batch_size, wake="notify" if self.postgres else "poll", poll_interval=self.poll_interval)
        try:
            async with anyio.create_task_group() as tg:
                if self.postgres:
                    await tg.start(self._listen)
                task_status.started()
                await self._loop()
                tg.cancel_scope.cancel()
        finally:
            log.info("outbox relay stopped", published=self.published)

    async def _loop(self) -> None:
        assert self._stopped is not None
        backoff = _BACKOFF_MIN
        next_cleanup = 0.0
        while not self._stopping:
            self._wake = wake = anyio.Event()  # a NOTIFY from now on cuts the next idle wait short
            failure: BaseException | None = None
            settled = 0
            with anyio.move_on_after(_BATCH_TIMEOUT, shield=True) as scope:
                try:
                    settled = await self.run_once()
                    if anyio.current_time() >= next_cleanup:
                        next_cleanup = anyio.current_time() + self.cleanup_interval
                        await self.cleanup()
                except Exception as exc:
                    failure = exc
            if scope.cancelled_caught:
                failure = TimeoutError(f"a batch took longer than {_BATCH_TIMEOUT:.0f} s")
            if failure is not None:
                log.warning("outbox relay cannot publish; retrying", error=str(failure).splitlines()[0] if str(failure)
                            else type(failure).__name__, error_type=type(failure).__name__, retry_in=round(backoff, 2))
                with anyio.move_on_after(backoff):
                    await self._stopped.wait()
                backoff = min(backoff * 2, _BACKOFF_MAX) * random.uniform(0.8, 1.0)
                continue
            if backoff > _BACKOFF_MIN:
                log.info("outbox relay recovered")
                backoff = _BACKOFF_MIN
            if settled == 0 and not self._stopping:
                with anyio.move_on_after(self.poll_interval):
                    await wake.wait()

    async def _listen(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Set the wake event on every NOTIFY; reconnect with backoff, polling meanwhile."""
        import psycopg

        conninfo = libpq_url(self.engine.url)
        backoff = _BACKOFF_MIN
        started = False
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True) as conn:
                    await conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                    if not started:
                        started = True
                        task_status.started()
                    elif self._wake is not None:
                        self._wake.set()  # catch up with whatever committed while we were not listening
                    backoff = _BACKOFF_MIN
                    async for _ in conn.notifies():
                        if self._wake is not None:
                            self._wake.set()
            except (psycopg.Error, OSError) as exc:
                log.warning("outbox relay cannot LISTEN; polling meanwhile", error=str(exc).strip().splitlines()[0]
                            if str(exc).strip() else type(exc).__name__, retry_in=round(backoff, 2))
                if not started:
                    started = True
                    task_status.started()
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX)
