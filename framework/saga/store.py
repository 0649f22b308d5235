"""Running a saga step on its state in the transport's state store: start from the state kept or read, save it.

The store is the transport's ``state`` capability (:class:`broker.capabilities.StateStore`). The save
goes with the message's ack on an owned partition (a step that only changes its state), else into
the step's effects commit (typed operations, :mod:`broker.state`, with its messages and timeouts),
guarded by the version read.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import orjson

from broker import GuardedWrite
from broker.errors import EffectsConflict
from broker.state import DeleteKey, Effects, ExpireKey, SetFields
from framework.saga.dispatch import StepDispatch
from framework.saga.kept import _SAVED, _SAVED_WITH_TIMEOUTS, _STATE_FIELDS, _Kept, _state_json, _StateWrite

if TYPE_CHECKING:
    from framework.context import Context
    from framework.saga.step_context import SagaContext
    from framework.saga.steps import _Step

__all__ = ["StoreSteps"]

S = TypeVar("S")


class StoreSteps(StepDispatch[S]):
    """The part of :class:`~framework.saga.Saga` that runs steps whose state is in the transport's
    state store (the states kept and read ahead are bounded by :class:`~framework.saga.Saga` itself)."""

    keep_completed_ms: int
    _cached: OrderedDict[str, _Kept]
    _cached_bytes: int
    _cache_ttl: float
    _careful: OrderedDict[str, None]
    _note: Callable[[GuardedWrite], None]
    _ahead: OrderedDict[str, tuple[int | None, list[Any], int]]
    _ahead_bytes: int

    if TYPE_CHECKING:

        def _keep_state(
            self,
            entry: _Kept,
            version: int | None,
            state: Any,
            pending: dict[str, str],
            size: int,
            fence: int | None,
            until: float | None = None,
        ) -> None: ...

    # -- running a step ----------------------------------------------------------------------------

    def state_key(self, ctx: Context, correlation: str | None = None) -> str:
        """The instance's state key in the store (on Redis under the saga queue partition's hash tag);
        ``correlation``: the message's key, when the caller has it at hand."""
        key: str = ctx._broker.state_key(self.queue.name, ctx._delivery.source.partition, correlation or ctx.key or "")
        return key

    def _drop_ahead(self, key: str) -> tuple[int | None, list[Any], int] | None:
        """Take ``key``'s state read ahead out (None if there is none)."""
        row = self._ahead.pop(key, None)
        if row is not None:
            self._ahead_bytes -= row[2]
        return row

    async def _run_store(self, step: _Step, source: str, body: bytes, ctx: Context, correlation: str) -> None:
        key = self.state_key(ctx, correlation)
        fence = ctx._fence
        now = time.monotonic()
        # The state this process saved last, if recent and saved in this tenure of the partition
        # (taken out: it is put back once this step's outcome is decided).
        cached = self._cached.pop(key, None)
        ahead = self._drop_ahead(key) if self._ahead else None
        last: _Kept | None = None  # the instance's entry, kept in this tenure: its last save, maybe unsent
        loaded: tuple[Any, dict[str, str]] | None = None
        version: int | None = None
        state_raw = pending_raw = None
        size = 0  # bytes of the kept state's JSON
        if cached is not None:
            self._cached_bytes -= cached.size
            if cached.fence == fence:
                last = cached
                if cached.until > now:
                    version = cached.version
                    loaded = (cached.state, cached.pending)  # (the step changes them in place)
                    size = cached.size
        if loaded is None:
            if last is not None and last.write is not None:
                assert ctx._flush is not None  # (a write waits for its ack only on the path that has one)
                await ctx._flush()  # read after this process's own last write of it, not before
                ahead = None  # (which a read ahead may predate)
            last = None
            if ahead is not None and ahead[0] == fence:  # read with its batch
                version_raw, state_raw, pending_raw, done = ahead[1]
            else:  # (sent with the other lanes' reads: one write for many steps)
                version_raw, state_raw, pending_raw, done = await ctx._broker.read_state(key, _STATE_FIELDS)
            version = None if version_raw is None else int(version_raw)
            had_timeouts = bool(pending_raw) and pending_raw != b"{}"
        else:
            done = None
            had_timeouts = bool(loaded[1])
        try:
            sctx = self._begin(
                step, source, ctx, correlation, version, state_raw, pending_raw, bool(done), None, loaded
            )
            if sctx is not None:
                await step.run(body, sctx)
        except BaseException:
            if last is not None and last.write is not None:  # (the state was changed in place: not kept, but
                self._keep_state(last, 0, None, {}, 0, fence, until=0.0)  # the next read waits for the write)
            raise
        # Owned partition (a fencing token): only this process writes the instance in this tenure,
        # so a step that only changes the state needs no commit of its own: the write goes with the
        # ack (guarded by the version all the same) and the next step starts on the state kept here.
        fast = (
            fence is not None
            and ctx._flush is not None
            and ctx._effects is None
            and not ctx._outgoing
            and key not in self._careful
        )
        if sctx is not None:
            if fast and not sctx._timeouts and not sctx._completed:
                self._save_with_ack(ctx, sctx, key, version or 0, had_timeouts, now, cached)
                return
            if last is not None:
                if last.write is not None:
                    assert ctx._flush is not None
                    await ctx._flush()  # its previous state write first (this commit builds on it)
                if not last.applied:  # (the tenure is over: this run commits nothing,
                    raise EffectsConflict(  # the next tenure runs it)
                        f"saga {self.label}: the instance's previous state write was not applied"
                    )
            tx = ctx._state_effects()
            tx.expect(key, "v", version)  # what the step decided is decided on this version
            self._save(ctx, tx, sctx, key, version or 0)
            return
        if version is None or done:  # ignored: nothing to keep
            if not fast:
                ctx._state_effects().expect(key, "v", version)
            return
        # ignored: the state stays as it was
        if loaded is None:
            assert state_raw is not None
            pending_raw = pending_raw or b"{}"
            loaded = (self._load_state(state_raw), orjson.loads(pending_raw))
            size = len(state_raw) + len(pending_raw)
        state, pending = loaded
        if fast:  # (its last write, if unsent, stays what the next read waits for)
            self._keep_state(last or _Kept(key), version, state, pending, size, fence)
        else:
            tx = ctx._state_effects()
            tx.expect(key, "v", version)
            self._cache_after_commit(tx, key, version, state, pending, size, fence)

    def _save_with_ack(
        self,
        ctx: Context,
        sctx: SagaContext[S],
        key: str,
        version: int,
        had_timeouts: bool,
        now: float,
        entry: _Kept | None,
    ) -> None:
        """Save the state with the message's ack (see :class:`~broker.GuardedWrite`), guarded by
        ``version``, and keep it for the instance's next step at once (``had_timeouts``: whether
        the stored timeouts field holds any, else it is written only when some are pending;
        ``entry``: the instance's entry taken from the kept ones, reused in this tenure)."""
        new = version + 1
        raw = _state_json(sctx.state)
        pending = sctx._pending
        if pending or had_timeouts:
            timeouts = orjson.dumps(pending)
            names: tuple[str, ...] = _SAVED_WITH_TIMEOUTS
            values: tuple[Any, ...] = (new, raw, timeouts)
            size = len(raw) + len(timeouts)
        else:  # (absent or {} stored: left as it is)
            names, values = _SAVED, (new, raw)
            size = len(raw) + 2
        fence = ctx._fence
        if entry is None or not entry.applied or (entry.fence != fence and entry.write is not None):
            entry = _Kept(key)  # (a write of an earlier tenure may still be noted on the old one)
        entry.write = ctx._ack_write = _StateWrite(entry, str(version) if version else "", names, values, self._note)
        self._keep_state(entry, new, sctx.state, pending, size, fence, now + self._cache_ttl)

    def _cache_after_commit(
        self,
        tx: Effects,
        key: str,
        version: int | None,
        state: Any,
        pending: dict[str, str],
        size: int,
        fence: int | None,
    ) -> None:
        """Keep ``key``'s state once the step's commit applied (with the guard passed, it is the
        stored one); ``size``: the bytes of its JSON, counted against the budget."""

        def keep() -> None:
            self._careful.pop(key, None)
            self._keep_state(_Kept(key), version, state, pending, size, fence)

        tx.after_commit(keep)

    def _save(self, ctx: Context, tx: Effects, sctx: SagaContext[S], key: str, version: int) -> None:
        """Record the step's save in ``tx`` (the step's commit): its state, or a tombstone kept
        ``keep_completed``, and the timeouts it requested."""
        new = version + 1
        if sctx.completed:
            tx.add(DeleteKey(key))
            tx.add(SetFields(key, {"v": new, "done": 1}))
            tx.add(ExpireKey(key, self.keep_completed_ms))
            tx.after_commit(lambda: self._drop_ahead(key))  # (a state read ahead before it: stale)
            return
        state = _state_json(sctx.state)
        pending = orjson.dumps(sctx._pending)
        tx.add(SetFields(key, {"v": new, "s": state, "t": pending}))
        self._cache_after_commit(tx, key, new, sctx.state, sctx._pending, len(state) + len(pending), ctx._fence)
        if sctx._timeouts:
            self._stage_timeouts(tx, ctx, sctx)
