"""The outbox relay: publishes committed outbox rows to the broker, in order per key, and marks them sent.

Claiming work
    PostgreSQL: each batch is one transaction. It locks up to ``max_shards`` rows of
    ``framework_outbox_shards`` that have waiting messages (``FOR UPDATE SKIP LOCKED``, the shard
    with the oldest waiting message first), reads the oldest waiting rows of those shards in
    ``seq`` order, publishes them in one pipeline, moves them to ``framework_outbox_sent`` and
    commits. Other relays, and the relay's own other lanes, skip the locked shards and take the
    rest, so a key (it lives in one shard) is published by one batch at a time, in order.
    SQLite: a batch takes the database's write lock (``BEGIN IMMEDIATE``); relays take turns.

Crashes
    Rows leave the outbox in the transaction that published them. A relay that dies between the
    publish and the commit leaves them in place: the next batch publishes them again with the
    same message ids, which downstream inboxes drop. Nothing is lost; copies are possible.

Waking
    On PostgreSQL a statement trigger on the outbox table NOTIFYs ``framework_outbox`` at commit
    and the relay LISTENs on a connection of its own, polling only as a fallback (default every
    2 s). On SQLite it polls (default every 50 ms) with a read that takes no lock.

Housekeeping
    Every ``cleanup_interval`` it deletes sent rows older than ``retention`` and inbox records
    older than ``inbox_retention``, in chunks. A message the broker refuses for good (a name
    declared as a queue used as a topic, say) is set aside with the reason in ``error`` and
    logged, so it cannot block its shard; ``framework outbox retry`` puts it back once fixed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import anyio
import anyio.abc
import anyio.lowlevel
import orjson
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from broker import Broker, Envelope, Kind
from framework.logs import get_logger
from framework.observability import hooks
from framework.outbox import _statements as statements
from framework.outbox.refusals import refusal
from framework.outbox.schema import NOTIFY_CHANNEL
from framework.sql import libpq_url, redact_url

__all__ = ["OutboxRelay"]

log = get_logger("framework.outbox")

_BACKOFF_MIN, _BACKOFF_MAX = 0.1, 15.0
_BATCH_TIMEOUT = 60.0  # a batch in progress is finished even when cancelled, but not forever
_CLEANUP_CHUNK = 5000
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MS = timedelta(milliseconds=1)


def _ms(value: datetime) -> int:
    if value.tzinfo is None:  # SQLite hands back naive datetimes; they are stored in UTC
        value = value.replace(tzinfo=UTC)
    return (value - _EPOCH) // _MS


def _reason(exc: BaseException) -> str:
    text_ = str(getattr(exc, "orig", None) or exc).strip()
    return text_.splitlines()[0] if text_ else type(exc).__name__


class OutboxRelay:
    """Publishes committed outbox messages to ``broker`` with their own ids; marks them sent.

    ``batch_size`` messages go per transaction and pipeline; on PostgreSQL ``concurrency``
    batches are in flight at once (one waits on the broker while another reads or commits), each
    claiming up to ``max_shards`` of the 64 shards, which leaves shards for other relays too.
    ``poll_interval`` (seconds) is how often an idle relay looks for work: a fallback on
    PostgreSQL, where NOTIFY wakes it (default 2 s), the wake-up on SQLite (default 0.05 s).
    ``retention`` (seconds, default a day) is how long sent rows are kept, ``inbox_retention``
    (default a week) how long inbox records are. ``published`` counts what this instance published.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        broker: Broker,
        *,
        batch_size: int = 1000,
        poll_interval: float | None = None,
        retention: float = 24 * 3600.0,
        inbox_retention: float = 7 * 24 * 3600.0,
        cleanup_interval: float = 60.0,
        concurrency: int = 2,
        max_shards: int = 16,
    ) -> None:
        if engine.dialect.name not in ("postgresql", "sqlite"):
            raise ValueError(f"the outbox relay supports PostgreSQL and SQLite, not {engine.dialect.name!r}")
        if engine.dialect.name == "postgresql" and engine.dialect.driver != "psycopg":
            raise ValueError(
                f"the outbox relay reads PostgreSQL through psycopg 3, not {engine.dialect.driver!r}: "
                "use outbox.create_engine() or a postgresql+psycopg:// URL"
            )
        if min(batch_size, concurrency, max_shards) < 1:
            raise ValueError("batch_size, concurrency and max_shards must be at least 1")
        self.engine = engine
        self.broker = broker
        self.postgres = engine.dialect.name == "postgresql"
        self.batch_size = batch_size
        self.poll_interval = poll_interval if poll_interval is not None else (2.0 if self.postgres else 0.05)
        self.retention = retention
        self.inbox_retention = inbox_retention
        self.cleanup_interval = cleanup_interval
        self.concurrency = concurrency if self.postgres else 1  # SQLite has one writer anyway
        self.max_shards = max_shards
        self.published = 0
        self._accepted: set[tuple[str, str]] = set()
        self._cleanup_sent, self._cleanup_inbox = statements.cleanup_statements(self.postgres)
        self._stopping = False
        self._wakes: list[anyio.Event] = []
        self._stopped: anyio.Event | None = None

    # -- one batch ----------------------------------------------------------------------------

    async def run_once(self) -> int:
        """Publish one batch of waiting messages; return how many rows it settled (0: nothing to do).

        Settled rows are published and moved to the sent table, or (rarely) set aside because the
        broker refuses them for good. Raises on database or broker errors, leaving the rows waiting.
        """
        if self.postgres:
            async with self.engine.begin() as conn:
                raw: Any = (await conn.get_raw_connection()).driver_connection
                async with raw.cursor(binary=True) as cur:
                    await cur.execute(statements.PG_CLAIM, {"limit": self.max_shards})
                    shards = [r[0] for r in await cur.fetchall()]
                    if not shards:
                        return 0
                    await cur.execute(statements.PG_ROWS, {"shards": shards, "limit": self.batch_size})
                    rows: list[Any] = await cur.fetchall()
                return await self._settle(conn, rows)
        async with self.engine.connect() as conn:
            if (await conn.execute(statements.SQLITE_ANY_WAITING)).first() is None:
                return 0
            await conn.exec_driver_sql("BEGIN IMMEDIATE")
            rows = [(*r[:9], _ms(r[9])) for r in await conn.execute(statements.SQLITE_ROWS, {"limit": self.batch_size})]
            settled = await self._settle(conn, rows)
            await conn.commit()
            return settled

    async def drain(self) -> int:
        """Run batches until nothing is waiting (or left to this relay); return the rows settled."""
        total = 0

        async def lane() -> None:
            nonlocal total
            while settled := await self.run_once():
                total += settled

        async with anyio.create_task_group() as tg:
            for _ in range(self.concurrency):
                tg.start_soon(lane)
        return total

    async def _settle(self, conn: AsyncConnection, rows: Sequence[statements.Row]) -> int:
        if not rows:
            return 0
        seqs: list[int] = []
        envelopes: list[Envelope] = []
        specs: dict[str, str] = {}
        for seq, message_id, destination, kind, type_, key, headers, body, spec, created_ms in rows:
            seqs.append(seq)
            envelopes.append(
                Envelope(
                    destination=destination,
                    kind=cast(Kind, kind),
                    type=type_,
                    body=body if type(body) is bytes else bytes(body),
                    key=key,
                    headers=orjson.loads(headers) if headers != "{}" else {},
                    id=message_id,
                    published_at=created_ms,
                )
            )
            if spec is not None:
                specs[destination] = spec
        failed: list[dict[str, Any]] = []
        refused = await self._refused(envelopes, specs)
        if refused:
            kept_seqs, kept = [], []
            for seq, env in zip(seqs, envelopes, strict=True):
                reason = refused.get((env.destination, env.kind))
                if reason is None:
                    kept_seqs.append(seq)
                    kept.append(env)
                    continue
                failed.append({"b_seq": seq, "b_error": reason})
                log.error(
                    "outbox message refused by the broker and set aside; fix the cause, then run "
                    "`framework outbox retry`",
                    message_id=env.id,
                    destination=env.destination,
                    error=reason,
                )
            seqs, envelopes = kept_seqs, kept
        if envelopes:
            if hooks.ANY:  # PRODUCER spans, children of the contexts stored with the rows; the sent counter
                await hooks.relay_publish(self.broker, envelopes)
            else:
                await self.broker.publish(envelopes)
            now = datetime.now(UTC)
            if self.postgres:
                raw: Any = (await conn.get_raw_connection()).driver_connection
                await raw.execute(statements.PG_MOVE, {"seqs": seqs, "now": now})
            else:
                await conn.execute(statements.SQLITE_COPY, {"now": now, "seqs": seqs})
                await conn.execute(statements.SQLITE_DELETE, {"seqs": seqs})
        if failed:
            await conn.execute(statements.MARK_REFUSED, failed)
        self.published += len(envelopes)
        return len(envelopes) + len(failed)

    async def _refused(self, envelopes: list[Envelope], specs: dict[str, str]) -> dict[tuple[str, str], str]:
        """Destinations the broker will never take these messages for, with the reason."""
        out: dict[tuple[str, str], str] = {}
        for destination, kind in {(e.destination, e.kind) for e in envelopes}:
            if (destination, kind) in self._accepted:
                continue
            reason = await refusal(self.broker, destination, kind, specs.get(destination))
            if reason is None:
                self._accepted.add((destination, kind))
            else:
                out[(destination, kind)] = reason
        return out

    # -- housekeeping -------------------------------------------------------------------------

    async def cleanup(self) -> tuple[int, int]:
        """Delete sent rows older than ``retention`` and inbox records older than ``inbox_retention``.

        Returns (sent rows deleted, inbox records deleted). Waiting rows are never deleted.
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

    # -- the loop -----------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask :meth:`run` to return once the batches in progress are published and marked."""
        self._stopping = True
        for event in (*self._wakes, self._stopped):
            if event is not None:
                event.set()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Publish until cancelled or :meth:`stop` is called; survives database and broker outages.

        Batches in progress are finished (for up to a minute) even when the task is cancelled.
        Errors are logged and retried with exponential backoff (up to 15 s). Cleanup runs at start
        and every ``cleanup_interval``.
        """
        self._stopped = anyio.Event()
        self._wakes = [anyio.Event() for _ in range(self.concurrency)]
        if self._stopping:
            self._stopped.set()
        log.info(
            "outbox relay started",
            database=redact_url(self.engine.url),
            namespace=self.broker.namespace,
            batch_size=self.batch_size,
            concurrency=self.concurrency,
            wake="notify" if self.postgres else "poll",
            poll_interval=self.poll_interval,
        )
        try:
            async with anyio.create_task_group() as tg:
                if self.postgres:
                    await tg.start(self._listen)
                if hooks.METRICS:  # the backlog and the age of its oldest row, read every few seconds
                    tg.start_soon(hooks.track_relay(), self)
                task_status.started()
                async with anyio.create_task_group() as lanes:
                    for lane in range(self.concurrency):
                        lanes.start_soon(self._loop, lane)
                tg.cancel_scope.cancel()
        finally:
            log.info("outbox relay stopped", published=self.published)

    def _wake_all(self) -> None:
        for event in self._wakes:
            event.set()

    async def _loop(self, lane: int) -> None:
        assert self._stopped is not None
        backoff = _BACKOFF_MIN
        next_cleanup = anyio.current_time() if lane == 0 else float("inf")
        while not self._stopping:
            await anyio.lowlevel.checkpoint()  # a cancellation lands between batches (they are shielded)
            self._wakes[lane] = wake = anyio.Event()  # a NOTIFY from now on cuts the next idle wait short
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
                log.warning(
                    "outbox relay cannot publish; retrying",
                    error=_reason(failure),
                    error_type=type(failure).__name__,
                    retry_in=round(backoff, 2),
                    lane=lane,
                )
                with anyio.move_on_after(backoff):
                    await self._stopped.wait()
                backoff = min(backoff * 2, _BACKOFF_MAX) * random.uniform(0.8, 1.0)
                continue
            if backoff > _BACKOFF_MIN:
                log.info("outbox relay recovered", lane=lane)
                backoff = _BACKOFF_MIN
            if settled:
                self._wake_all()  # more may be waiting in shards this batch did not claim
            elif not self._stopping:
                with anyio.move_on_after(self.poll_interval):
                    await wake.wait()

    async def _listen(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Wake the lanes on every NOTIFY; reconnect with backoff, polling meanwhile."""
        import psycopg

        conninfo = libpq_url(self.engine.url)
        backoff = _BACKOFF_MIN
        started = False
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True) as conn:
                    await conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                    if started:
                        self._wake_all()  # catch up with whatever committed while we were not listening
                    else:
                        started = True
                        task_status.started()
                    backoff = _BACKOFF_MIN
                    async for _ in conn.notifies():
                        self._wake_all()
            except (psycopg.Error, OSError) as exc:
                log.warning(
                    "outbox relay cannot LISTEN; polling meanwhile", error=_reason(exc), retry_in=round(backoff, 2)
                )
                if not started:
                    started = True
                    task_status.started()
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX)
