"""Starting a saga step on its instance (run it, start the instance, or ignore the message); the SQL path."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast

import orjson

from framework._payloads import converter
from framework.handlers import HandlerError
from framework.logs import get_logger
from framework.saga.step_context import SagaContext
from framework.saga.timeouts import TimeoutWrites

if TYPE_CHECKING:
    from framework.context import Context
    from framework.saga.steps import _Step

__all__ = ["StepDispatch"]

log = get_logger("framework.saga")

S = TypeVar("S")


class StepDispatch(TimeoutWrites[S]):
    """The part of :class:`~framework.saga.Saga` that decides how a message's step runs on its
    instance, for either store, and runs steps whose state is in SQL (``sql=``)."""

    state_type: Callable[[], S]
    _sql: Any
    _keep: timedelta
    _state_decode: Callable[[bytes], Any] | None

    async def _run_sql(self, step: _Step, source: str, body: bytes, ctx: Context) -> None:
        from framework import _saga_sql

        async with ctx.sql_transaction(self._engine()) as conn:
            assert ctx.key is not None
            row = await _saga_sql.load(conn, self.label, ctx.key, self._keep)
            version = row.version or None
            sctx = self._begin(step, source, ctx, ctx.key, version, row.state, row.timeouts, row.completed, conn)
            if sctx is None:
                return  # the block commits the message's inbox row alone
            await step.run(body, sctx)
            if sctx.completed:
                await _saga_sql.complete(conn, self.label, sctx.correlation, row, self._keep)
                return
            state = orjson.dumps(converter.unstructure(sctx.state)).decode()
            await _saga_sql.save(conn, self.label, sctx.correlation, row, state, orjson.dumps(sctx._pending).decode())
            for timeout_id, payload, due in sctx._timeouts:  # outbox rows of this transaction
                ctx._outgoing.append(self._timeout_envelope(ctx, sctx, timeout_id, payload, due, spec=True))

    def _begin(
        self,
        step: _Step,
        source: str,
        ctx: Context,
        correlation: str,
        version: int | None,
        state_raw: bytes | str | None,
        pending_raw: bytes | str | None,
        done: bool,
        conn: Any,
        loaded: tuple[Any, dict[str, str]] | None = None,
    ) -> SagaContext[S] | None:
        """Decide on the loaded instance (``loaded``: its state and timeouts decoded already): the
        step's context to run it with, or None when the message is ignored."""
        if done:
            log.debug("message for a completed saga ignored", saga=self.label, correlation=correlation, input=source)
            return None
        if version is None:
            if not step.starts:
                log.info(
                    "message ignored: no running saga for it and its step does not start one",
                    saga=self.label,
                    correlation=correlation,
                    input=source,
                    message_id=ctx.message_id,
                )
                return None
            version = 0
            state = self.state_type()
            pending: dict[str, str] = {}
        elif loaded is not None:
            state, pending = loaded
        else:
            state = self._load_state(state_raw)
            pending = orjson.loads(pending_raw) if pending_raw else {}
        if step.timeout and pending.pop(ctx.message_id, None) is None:
            log.debug("cancelled or stale timeout ignored", saga=self.label, correlation=correlation)
            return None
        return SagaContext(ctx, self, state, correlation, version, pending, conn)

    def _engine(self) -> Any:
        engine = self._sql
        if not hasattr(engine, "sync_engine"):  # a function giving the engine: called once, on first use
            engine = self._sql = engine()
            if not hasattr(engine, "sync_engine"):
                raise HandlerError(f"saga {self.label}: sql= gave {engine!r}, not an SQLAlchemy AsyncEngine")
        return engine

    def _load_state(self, raw: bytes | str | None) -> S:
        data = raw.encode() if isinstance(raw, str) else raw or b"{}"
        if self._state_decode is not None:
            state: S = self._state_decode(data)
            return state
        return cast(S, converter.structure(orjson.loads(data), Any))
