"""Process managers (sagas): state keyed by a correlation id, one message per saga at a time.

A saga is declared on a service and handles several message types for one business process (an
order's fulfilment), in any order::

    shipping = Service("shipping")
    fulfilment = shipping.saga("order_fulfilment", state=Fulfilment, timeout=timedelta(hours=1))

    @fulfilment.event("payments.captured", correlate=lambda e: e.order_id)
    async def captured(event: PaymentCaptured, ctx: SagaContext[Fulfilment]) -> None:
        ctx.state.paid = True
        ...

What it promises (see ``docs/sagas.md``):

* **Routing.** Every input (``event``/``command`` steps) is subscribed by a small forwarding
  handler of the service that re-sends the message to the saga's own queue
  ``<service>.saga.<name>`` with key = its correlation id (derived ids plus the inboxes make the
  hop exactly once). So one saga instance's messages share one partition and one per-key lane.
* **State** lives in the transport's state store (the ``state`` capability,
  :class:`broker.capabilities.StateStore`), one hash per instance beside the saga queue's
  partition (on Redis ``<ns>:{<service>.saga.<name>:<p>}:saga:<correlation id>``, under the
  partition's hash tag) with fields ``v`` (version), ``s`` (the state, JSON via the payload
  converter) and ``t`` (pending timeout ids). A step loads it, runs, and saves it as typed
  operations (:mod:`broker.state`) committed with the inbox mark, the ack and the outgoing
  messages in one atomic step (one ``commit_effects.lua`` call on Redis).
* **One message per saga at a time.** The save is guarded by the version read at the start
  (``ExpectField``): if another step committed meanwhile (two processes on a shared
  partition, a paused ex-owner), nothing is written, sent or acked and the step runs again on the
  new state. Conflicts are retried at once and do not count towards the saga's retry policy's
  dead-lettering (up to ``MAX_CONFLICTS`` in a row).
* **State kept by the worker.** A worker keeps the state it saved last per instance (up to
  ``STATE_CACHE_SIZE`` instances and ``STATE_CACHE_BYTES``, each for ``STATE_CACHE_SECONDS``), so
  the next step of the instance (the partition's owner runs them all) starts without a read. It is
  guarded like a read: a kept state another process has moved on from conflicts, is dropped, and
  the step runs again on a fresh read.
* **Timeouts** (``ctx.request_timeout``) are scheduled messages to the saga's own queue, stored by
  the same atomic commit (the scheduled zset shares the partition's hash tag), so a timeout exists
  only if the state that requested it was saved. A timeout that fires after the saga completed, or
  that was cancelled, is ignored.
* **Complete** (``ctx.complete()``) replaces the state by a tombstone (kept ``keep_completed``,
  default one day) in the same commit: late or duplicate messages for a completed saga, and its
  timeouts, are ignored rather than starting it again.
* **State in SQL** (``sql=engine``): one row per instance in ``framework_saga_state``
  (:mod:`framework._saga_sql`), read ``FOR UPDATE`` and saved with the same version guard inside
  the step's ``ctx.sql_transaction``; the step's own rows (``ctx.sql``), its messages and its
  timeouts (outbox rows with a due time) commit in that transaction.

This module holds :class:`Saga` with its budget of kept states (``STATE_CACHE_*``: set them
here); the class is built in layers, each a module of this package, bottom up:
:mod:`~framework.saga.policy` (``SAGA_INPUT``, errors, retries), :mod:`~framework.saga.step_context`
(:class:`SagaContext`), :mod:`~framework.saga.steps` (declaring steps),
:mod:`~framework.saga.timeouts`, :mod:`~framework.saga.dispatch` (deciding a step; the SQL
path), :mod:`~framework.saga.kept` and :mod:`~framework.saga.store` (the state store's path).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from broker import GuardedWrite
from broker.capabilities import STATE, as_state
from framework._payloads import decoder_for
from framework.context import Context
from framework.handlers import HandlerError, Queue
from framework.retries import RetryPolicy
from framework.saga.kept import _STATE_FIELDS, _Kept
from framework.saga.policy import (
    DEFAULT_KEEP_COMPLETED,
    MAX_CONFLICTS,
    SAGA_INPUT,
    SagaError,
    SagaRetryPolicy,
    _saga_policy,
)
from framework.saga.step_context import SagaContext
from framework.saga.store import StoreSteps

if TYPE_CHECKING:
    from broker import Broker, Delivery
    from framework.saga.steps import SagaService, _Step

__all__ = ["MAX_CONFLICTS", "SAGA_INPUT", "Saga", "SagaContext", "SagaError", "SagaRetryPolicy"]

S = TypeVar("S")

STATE_CACHE_SIZE = 10_000
"""Instances whose state a worker keeps after saving it (a step of one needs no read first)."""

STATE_CACHE_BYTES = 32 * 2**20
"""Bytes of kept state (JSON) per saga and worker at most; the least recently saved go first."""

STATE_CACHE_SECONDS = 30.0
"""How long a kept state is used (at most half of ``keep_completed``) before it is read again."""


class Saga(StoreSteps[S]):
    """A process manager of a service: steps per input, state per correlation id.

    Create with :meth:`framework.Service.saga`. ``state`` is the state's type (an attrs class, a
    dataclass or ``dict``; called with no arguments for a new instance); ``partitions`` the saga
    queue's partition count (> 1: partitions owned by one worker each, see
    ``docs/partition-ownership.md``); ``keep_completed`` how long a completed instance's
    tombstone stays (late messages within it are ignored, after it they would start a new one);
    ``sql`` an AsyncEngine (or a function returning one) to keep the state in instead of the
    transport's state store.
    """

    def __init__(
        self,
        service: SagaService,
        name: str,
        *,
        state: Callable[[], S],
        partitions: int = 4,
        retry: RetryPolicy | None = None,
        timeout: timedelta | float | None = None,
        keep_completed: timedelta | float = DEFAULT_KEEP_COMPLETED,
        sql: Any = None,
    ) -> None:
        self.service = service
        self.name = name
        self.state_type = state
        self.queue = Queue(f"{service.name}.saga.{name}", partitions=partitions)
        keep = keep_completed.total_seconds() if isinstance(keep_completed, timedelta) else float(keep_completed)
        if keep <= 0:
            raise HandlerError(f"saga {service.name}.{name}: keep_completed must be positive")
        self.keep_completed_ms = int(keep * 1000)
        self._keep = timedelta(seconds=keep)
        if sql is not None and not (hasattr(sql, "sync_engine") or callable(sql)):
            raise HandlerError(
                f"saga {service.name}.{name}: sql= takes an SQLAlchemy AsyncEngine (framework.outbox.create_engine) "
                "or a function returning one"
            )
        self._sql: Any = sql
        self._steps: dict[str, _Step] = {}  # source destination -> step
        self._timeout_steps: dict[str, _Step] = {}  # payload type name -> step
        self._retry = _saga_policy(retry or service.retry)
        self._state_decode = decoder_for(state) if isinstance(state, type) else None
        # Stored state of instances this process saved last (:class:`_Kept`). The commit's version
        # guard checks it as it checks a fresh read (a stale entry conflicts and the step runs again
        # on a fresh read); an entry lives less than keep_completed, so a completed instance's key
        # cannot expire and climb back to a cached version meanwhile. Decoded, so a step of a kept
        # instance neither reads nor decodes it.
        self._cached: OrderedDict[str, _Kept] = OrderedDict()
        self._cached_bytes = 0
        self._cache_ttl = min(STATE_CACHE_SECONDS, keep / 2)
        # instances whose state write sent with the acks was not applied: their next step commits
        # by the general path (which dead-letters a write the server refuses, with the reason)
        self._careful: OrderedDict[str, None] = OrderedDict()
        self._note = self._written  # (bound once: every state write sent with the acks carries it)
        # States read ahead for fetched batches (:meth:`_read_ahead`): key -> (fencing token, the
        # HMGET row, its bytes); a step takes its instance's out, and a state kept for it drops it.
        # Bounded like the kept states (rows whose steps never ran, their works given up, go first).
        self._ahead: OrderedDict[str, tuple[int | None, list[Any], int]] = OrderedDict()
        self._ahead_bytes = 0

        async def step(body: bytes, ctx: Context) -> None:
            env = ctx.envelope
            source = env.headers.get(SAGA_INPUT, "")
            found = self._steps.get(source)
            if found is None and source.startswith("timeout:"):
                found = self._timeout_steps.get(source[8:])
            if found is None:
                raise SagaError(f"saga {self.label}: no step for input {source!r} (message type {env.type})")
            if not env.key:
                raise SagaError(f"saga {self.label}: message {env.id} on the saga queue has no correlation key")
            if self._sql is None:
                await self._run_store(found, source, body, ctx, env.key)
            else:
                await self._run_sql(found, source, body, ctx)

        step.__name__ = f"saga_{name}"
        needs = (
            {}
            if self._sql is not None
            else {STATE: f"saga {self.label} keeps its state in the transport's state store (sql=: in a database)"}
        )
        service._register(self.queue, self._retry, None, "earliest", True, timeout, self._read_ahead, needs)(step)

    def __repr__(self) -> str:
        return f"Saga({self.label!r}, inputs={sorted(self._steps)}, timeouts={sorted(self._timeout_steps)})"

    # -- the states kept and read ahead (bounded by STATE_CACHE_SIZE and STATE_CACHE_BYTES) ----------

    async def _read_ahead(self, broker: Broker, deliveries: list[Delivery], fence: int | None, channel: Any) -> None:
        """Read, in one call, the states of a fetched batch's instances whose steps would read
        them (none kept, or kept too long) and keep them for those steps (see :meth:`_run_store`)."""
        if self._sql is not None:
            return
        store = as_state(broker)  # (the runtime checked the capability: Handler.needs)
        state_key = store.state_key
        queue = self.queue.name
        cache = self._cached
        ahead = self._ahead
        now = time.monotonic()
        keys: dict[str, None] = {}
        for d in deliveries:
            correlation = d.envelope.key if d.envelope is not None else None
            if not correlation:
                continue
            key = state_key(queue, d.source.partition, correlation)
            kept = cache.get(key)
            if kept is not None and kept.fence == fence and (kept.until > now or kept.write is not None):
                continue  # its step starts on the kept state, or reads after this process's own write
            keys[key] = None
        if not keys:
            return
        rows = await store.read_states(list(keys), _STATE_FIELDS, channel=channel)
        for key, row in zip(keys, rows, strict=True):
            if row is not None:  # (else not a hash: its step reads it and fails with the reason)
                self._drop_ahead(key)
                size = len(row[1] or b"") + len(row[2] or b"")
                ahead[key] = (fence, row, size)
                self._ahead_bytes += size
        while len(ahead) > STATE_CACHE_SIZE or self._ahead_bytes > STATE_CACHE_BYTES:
            _, dropped = ahead.popitem(last=False)
            self._ahead_bytes -= dropped[2]

    def _written(self, write: GuardedWrite) -> None:
        """The ack call ran a state write sent with it (or was refused): a write not applied (the
        settle stage logs why) may be what is kept for its instance, so that goes; the instance's
        next step reads and commits by the general path."""
        entry: _Kept = write.entry  # type: ignore[attr-defined]
        if entry.write is write:
            entry.write = None  # (the entry no longer holds it: it dies young)
        if write.outcome == GuardedWrite.APPLIED:
            return
        entry.applied = False
        key = write.key
        cached = self._cached.get(key)
        if cached is not None:
            del self._cached[key]
            self._cached_bytes -= cached.size
        careful = self._careful
        careful[key] = None
        while len(careful) > STATE_CACHE_SIZE:
            careful.popitem(last=False)

    def _keep_state(
        self,
        entry: _Kept,
        version: int | None,
        state: Any,
        pending: dict[str, str],
        size: int,
        fence: int | None,
        until: float | None = None,
    ) -> None:
        """Keep ``entry`` (its key's) with the state saved at ``version`` (``size``: the bytes of
        its JSON, counted against the budget) by the tenure of ``fence``, usable ``until``
        (monotonic; default: the cache's lifetime from now; 0: not usable, only its write - the
        last sent with the acks - is kept for the next read to wait for)."""
        cache = self._cached
        key = entry.key
        old = cache.pop(key, None)  # (only if another run of the instance went on meanwhile)
        if old is not None:
            self._cached_bytes -= old.size
        if self._ahead:
            self._drop_ahead(key)  # (read before this state: stale)
        entry.until = time.monotonic() + self._cache_ttl if until is None else until
        entry.version = version
        entry.state = state
        entry.pending = pending
        entry.size = size
        entry.fence = fence
        cache[key] = entry
        self._cached_bytes += size
        while len(cache) > STATE_CACHE_SIZE or self._cached_bytes > STATE_CACHE_BYTES:
            _, dropped = cache.popitem(last=False)
            self._cached_bytes -= dropped.size
