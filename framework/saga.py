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
* **State** lives in one Redis hash per instance under the saga queue partition's hash tag:
  ``<ns>:{<service>.saga.<name>:<p>}:saga:<correlation id>`` with fields ``v`` (version), ``s``
  (the state, JSON via the payload converter) and ``t`` (pending timeout ids). A step loads it,
  runs, and saves it with ``ctx.redis_transaction()``: the save, the inbox mark, the ack and the
  outgoing messages are one script call (``commit_effects.lua``).
* **One message per saga at a time.** The save is guarded by the version read at the start
  (``RedisEffects.expect``): if another step committed meanwhile (two processes on a shared
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
"""

from __future__ import annotations

import functools
import time
import typing
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import anyio
import orjson

from broker import COMMAND, GuardedWrite, derive_id
from broker.codec import encode_fields
from broker.errors import EffectsConflict
from broker.headers import CAUSATION_ID, CORRELATION_ID, DELIVER_AT
from framework._messages import Outgoing, build_envelope
from framework._payloads import converter, decoder_for, type_name
from framework.context import Context
from framework.logs import get_logger
from framework.retries import Decision, RetryPolicy
from framework.scheduling import due_ms
from framework.service import HandlerError, Queue, Topic, _inspect

if TYPE_CHECKING:
    from broker import Broker, Delivery
    from broker.redis.keys import KeySpace
    from framework.context import _Staged
    from framework.service import Service

__all__ = ["MAX_CONFLICTS", "SAGA_INPUT", "Saga", "SagaContext", "SagaError", "SagaRetryPolicy"]

log = get_logger("framework.saga")

S = TypeVar("S")
F = TypeVar("F", bound=Callable[..., Any])

SAGA_INPUT = "saga-input"
"""Header of a message on a saga's queue: which input it is (the source destination, or ``timeout:<type>``)."""

MAX_CONFLICTS = 100
"""Version conflicts retried at once before the saga's retry policy counts them as failures."""

DEFAULT_KEEP_COMPLETED = timedelta(days=1)

STATE_CACHE_SIZE = 10_000
"""Instances whose Redis state a worker keeps after saving it (a step of one needs no read first)."""

STATE_CACHE_BYTES = 32 * 2**20
"""Bytes of kept state (JSON) per saga and worker at most; the least recently saved go first."""

STATE_CACHE_SECONDS = 30.0
"""How long a kept state is used (at most half of ``keep_completed``) before it is read again."""


class _Kept:
    """An instance's state as this process saved it last, kept for its next step (see
    :meth:`Saga._keep_state`): one object an instance, reused by its next steps, so a step
    allocates nothing that outlives its ack (no garbage for the collector's older generations).
    ``write``: its last save sent with the acks while that ack has not run (see
    :meth:`Saga._save_with_ack`); ``applied``: False once a save sent with the acks was not."""

    __slots__ = ("applied", "fence", "key", "pending", "size", "state", "until", "version", "write")

    def __init__(self, key: str) -> None:
        self.key = key
        self.write: _StateWrite | None = None
        self.applied = True
        self.until = 0.0  # (monotonic) usable until then; 0: only its write is kept, for the next read to wait for
        self.version = 0
        self.state: Any = None
        self.pending: dict[str, str] = {}
        self.size = 0  # bytes of the state's JSON (and its timeouts'), counted against the budget
        self.fence: int | None = None  # the tenure that saved it


class _StateWrite(GuardedWrite):
    """A saga state write sent with the acks (see :meth:`Saga._save_with_ack`), for ``entry``;
    ``note`` is the saga's :meth:`Saga._written`."""

    __slots__ = ("entry",)

    def __init__(
        self,
        entry: _Kept,
        expected: str,
        names: tuple[str, ...],
        values: tuple[Any, ...],
        note: Callable[[GuardedWrite], None],
    ) -> None:
        super().__init__(entry.key, "v", expected, names, values, note)
        self.entry = entry


class SagaError(Exception):
    """A saga message that cannot be handled (no step for it): dead-lettered, never retried."""


class SagaRetryPolicy(RetryPolicy):
    """A :class:`RetryPolicy` that retries a version conflict at once, in the lane, without
    letting it dead-letter the message (other failures follow the policy as usual; conflicts do
    raise the attempt number the policy sees)."""

    def decide(self, attempt: int, exc: BaseException) -> Decision:
        """Retry a conflict now (up to :data:`MAX_CONFLICTS`); anything else per the policy."""
        if isinstance(exc, EffectsConflict) and attempt < MAX_CONFLICTS:
            return Decision("retry")
        return super().decide(attempt, exc)


def _saga_policy(policy: RetryPolicy) -> SagaRetryPolicy:
    fields = {a.name: getattr(policy, a.name) for a in type(policy).__attrs_attrs__}  # type: ignore[attr-defined]
    fields["fatal"] = (*policy.fatal, SagaError)
    return SagaRetryPolicy(**fields)


def _msgpack_strings(items: list[bytes]) -> bytes:
    """cmsgpack's encoding of a Lua array of strings (what ``schedule_add.lua`` stores, packed here
    so a timeout can be written by plain commands inside the step's commit)."""
    n = len(items)
    out = bytearray()
    if n < 16:
        out.append(0x90 | n)
    elif n < 1 << 16:
        out += b"\xdc" + n.to_bytes(2, "big")
    else:
        out += b"\xdd" + n.to_bytes(4, "big")
    for b in items:
        size = len(b)
        if size < 32:
            out.append(0xA0 | size)
        elif size < 1 << 8:
            out += b"\xd9" + size.to_bytes(1, "big")
        elif size < 1 << 16:
            out += b"\xda" + size.to_bytes(2, "big")
        else:
            out += b"\xdb" + size.to_bytes(4, "big")
        out += b
    return bytes(out)


def _as_bytes(value: bytes | str | int) -> bytes:
    if isinstance(value, bytes):
        return value
    return str(value).encode()


class _Step:
    """One input of a saga: its function, payload decoder and whether it may start an instance."""

    __slots__ = ("decode", "fn", "is_async", "name", "payload_type", "starts", "timeout")

    def __init__(self, fn: Callable[..., Any], where: str, starts: bool, *, timeout: bool = False) -> None:
        is_async, takes_ctx, payload_type = _inspect(fn, where)
        if not takes_ctx:
            raise HandlerError(f"{where}: a saga step takes (message, ctx: SagaContext)")
        try:
            self.decode = decoder_for(payload_type)
        except TypeError as exc:
            raise HandlerError(f"{where}: {exc}") from None
        self.fn = fn
        self.is_async = is_async
        self.payload_type = payload_type
        self.starts = starts
        self.timeout = timeout  # a timeout step (its message is a timeout this instance requested)
        self.name = getattr(fn, "__name__", None) or type(fn).__name__

    def run(self, body: bytes, sctx: SagaContext[Any]) -> Awaitable[Any]:
        """Decode ``body`` and run the step on it (a sync step in a worker thread): await the result."""
        payload = self.decode(body)
        if self.is_async:
            return self.fn(payload, sctx)  # type: ignore[no-any-return]
        return anyio.to_thread.run_sync(functools.partial(self.fn, payload, sctx))


def _no_delay(options: Mapping[str, Any]) -> None:
    # A scheduled send is stored by its own script before the step's commit, so it could leave
    # for a step whose save then fails: refused, with the way that commits atomically.
    if options.get("delay") is not None or options.get("at") is not None:
        raise SagaError(
            "a saga step cannot send with delay=/at=: call ctx.request_timeout(delay, payload) and send "
            "from the timeout step (a timeout is saved atomically with the state)"
        )


class SagaContext(Generic[S]):
    """What a saga step receives: the instance's ``state``, and ``send``/``publish``,
    ``request_timeout``, ``cancel_timeout`` and ``complete``.

    Everything a step does takes effect only if its state is saved: the state, its timeouts and
    its outgoing messages commit in one atomic step with the inbox mark and the ack. Change
    ``state`` in place (or assign a new one); it is saved when the step returns.
    """

    __slots__ = ("_completed", "_pending", "_saga", "_timeouts", "context", "correlation", "sql", "state", "version")

    def __init__(
        self,
        context: Context,
        saga: Saga[S],
        state: S,
        correlation: str,
        version: int,
        pending: dict[str, str],
        sql: Any = None,
    ) -> None:
        self.context = context
        """The plain handler :class:`~framework.Context` of the message (headers, ids, attempt)."""
        self._saga = saga
        self.state = state
        """The instance's state (a fresh ``state()`` when this message started it)."""
        self.correlation = correlation
        """The instance's correlation id (the key every message of it carries on the saga queue)."""
        self.version = version
        """The state's version as loaded (0: this message starts the instance)."""
        self.sql = sql
        """The SQL connection of the step's transaction when the saga keeps its state in SQL
        (``sql=``; else None): rows the step writes with it commit with the state, or not at all."""
        self._pending = pending
        self._timeouts: list[tuple[str, Any, int]] = []
        self._completed = False

    @property
    def message_id(self) -> str:
        """The id of the message this step handles (the forwarded copy's, derived from the original's)."""
        return self.context.message_id

    @property
    def is_new(self) -> bool:
        """Whether this message started the instance."""
        return self.version == 0

    @property
    def completed(self) -> bool:
        """Whether :meth:`complete` was called in this step."""
        return self._completed

    @property
    def pending_timeouts(self) -> Mapping[str, str]:
        """Timeouts requested and not fired or cancelled yet: id -> payload type name."""
        return dict(self._pending)

    def send(self, queue: str | Queue, command: Any, *, key: str | None = None, **kw: Any) -> _Staged:
        """Stage a command; it leaves only if this step's state is saved (``headers=``, ``type=`` as
        for :meth:`Context.send`; ``delay=``/``at=`` only when the state is in SQL, else use
        :meth:`request_timeout` and send from its step)."""
        if self.sql is None:
            _no_delay(kw)
        return self.context.send(queue, command, key=key, **kw)

    def publish(self, topic: str | Topic, event: Any, *, key: str | None = None, **kw: Any) -> _Staged:
        """Stage an event; it leaves only if this step's state is saved."""
        if self.sql is None:
            _no_delay(kw)
        return self.context.publish(topic, event, key=key, **kw)

    def request_timeout(self, delay: timedelta | float | None, payload: Any, *, at: datetime | None = None) -> str:
        """Deliver ``payload`` to this instance's timeout step for ``type(payload)`` after ``delay``
        (seconds or timedelta) or ``at`` (an aware datetime). Stored only if this step's state is
        saved; ignored when it fires after :meth:`complete` or :meth:`cancel_timeout`. Returns its id."""
        if self._saga._timeout_steps.get(type_name(payload)) is None:
            raise SagaError(
                f"saga {self._saga.label}: no timeout step for {type_name(payload)}; declare one with "
                f"@{self._saga.name}.timeout"
            )
        due = due_ms(delay, at)
        if due is None:
            due = due_ms(0)
        assert due is not None
        n = len(self._timeouts)
        timeout_id = derive_id(self.context.message_id, f"{self._saga.queue.name}/timeout/{n}")
        self._timeouts.append((timeout_id, payload, due))
        self._pending[timeout_id] = type_name(payload)
        return timeout_id

    def cancel_timeout(self, timeout_id: str) -> bool:
        """Forget a pending timeout: when it fires it is ignored. False when it is not pending."""
        return self._pending.pop(timeout_id, None) is not None

    def complete(self) -> None:
        """End the instance: its state is replaced by a tombstone when this step commits; later
        messages and timeouts for it are ignored (for ``keep_completed``)."""
        self._completed = True


class Saga(Generic[S]):
    """A process manager of a service: steps per input, state per correlation id.

    Create with :meth:`framework.Service.saga`. ``state`` is the state's type (an attrs class, a
    dataclass or ``dict``; called with no arguments for a new instance); ``partitions`` the saga
    queue's partition count (> 1: partitions owned by one worker each, see
    ``docs/partition-ownership.md``); ``keep_completed`` how long a completed instance's
    tombstone stays (late messages within it are ignored, after it they would start a new one);
    ``sql`` an AsyncEngine (or a function returning one) to keep the state in instead of Redis.
    """

    def __init__(
        self,
        service: Service,
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
        # Redis state of instances this process saved last (:class:`_Kept`). The commit's version
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
        self._prefixes: dict[tuple[str, int], str] = {}  # (namespace, partition) -> the state keys' prefix
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
                await self._run_redis(found, source, body, ctx, env.key)
            else:
                await self._run_sql(found, source, body, ctx)

        step.__name__ = f"saga_{name}"
        service._register(self.queue, self._retry, None, "earliest", True, timeout, self._read_ahead)(step)

    @property
    def label(self) -> str:
        """``service.saga`` for logs."""
        return f"{self.service.name}.{self.name}"

    def __repr__(self) -> str:
        return f"Saga({self.label!r}, inputs={sorted(self._steps)}, timeouts={sorted(self._timeout_steps)})"

    # -- declaring steps ---------------------------------------------------------------------------

    def event(
        self,
        topic: str | Topic,
        *,
        correlate: Callable[[Any], Any],
        starts: bool = True,
        start: typing.Literal["earliest", "latest"] = "earliest",
    ) -> Callable[[F], F]:
        """Declare the step for events of ``topic``; ``correlate(event)`` gives the instance's id.

        ``starts=False``: an event for no running instance is ignored instead of starting one.
        The service subscribes to ``topic`` (one handler per destination per service)."""
        dest = topic if isinstance(topic, Topic) else Topic(topic)
        return self._input(dest, correlate, starts, start)

    def command(self, queue: str | Queue, *, correlate: Callable[[Any], Any], starts: bool = True) -> Callable[[F], F]:
        """Declare the step for commands sent to ``queue`` (owned by this service); like :meth:`event`."""
        dest = queue if isinstance(queue, Queue) else Queue(queue)
        return self._input(dest, correlate, starts, "earliest")

    def timeout(self, fn: F) -> F:
        """Declare the step run when a timeout of its payload type (``ctx.request_timeout``) fires."""
        step = _Step(fn, f"saga {self.label} timeout step {getattr(fn, '__name__', fn)!r}", starts=False, timeout=True)
        name = _type_label(step.payload_type)
        if name in self._timeout_steps:
            raise HandlerError(f"saga {self.label}: two timeout steps for {name}")
        self._timeout_steps[name] = step
        return fn

    def _input(
        self, dest: Queue | Topic, correlate: Callable[[Any], Any], starts: bool, start: Any
    ) -> Callable[[F], F]:
        if not callable(correlate):
            raise HandlerError(f"saga {self.label}: correlate= must be a function of the message")
        saga_queue = self.queue

        def decorator(fn: F) -> F:
            where = f"saga {self.label} step {getattr(fn, '__name__', fn)!r} for {dest.name!r}"
            if dest.name in self._steps:
                raise HandlerError(f"{where}: the saga already has a step for {dest.name!r}")
            step = _Step(fn, where, starts)

            def forward(message: Any, ctx: Context) -> None:
                correlation = correlate(message)
                if correlation is None or correlation == "":
                    raise SagaError(f"{where}: correlate() gave {correlation!r} for message {ctx.message_id}")
                ctx.send(
                    saga_queue,
                    ctx.envelope.body,
                    key=str(correlation),
                    type=ctx.type,
                    headers={SAGA_INPUT: dest.name},
                )

            async def forward_async(message: Any, ctx: Context) -> None:
                forward(message, ctx)

            forward_async.__name__ = f"saga_{self.name}_{step.name}"
            forward_async.__annotations__ = {"message": step.payload_type, "ctx": Context, "return": None}
            policy = RetryPolicy(fatal=(SagaError,))
            if isinstance(dest, Topic):
                self.service.event(dest, retry=policy, start=start)(forward_async)
            else:
                self.service.command(dest, retry=policy)(forward_async)
            self._steps[dest.name] = step
            return fn

        return decorator

    # -- running a step ----------------------------------------------------------------------------

    def state_key(self, ctx: Context, correlation: str | None = None) -> str:
        """The instance's state hash (under the saga queue partition's hash tag); ``correlation``:
        the message's key, when the caller has it at hand."""
        return self._prefix(ctx._broker.keyspace, ctx._delivery.source.partition) + (correlation or ctx.key or "")

    def _prefix(self, keyspace: KeySpace, partition: int) -> str:
        """What the state keys of a saga queue partition start with (built once)."""
        prefix = self._prefixes.get((keyspace.namespace, partition))
        if prefix is None:
            stream = keyspace.partition(self.queue.name, partition).stream
            prefix = self._prefixes[(keyspace.namespace, partition)] = f"{stream}:saga:"
        return prefix

    async def _read_ahead(self, broker: Broker, deliveries: list[Delivery], fence: int | None, channel: Any) -> None:
        """Read, in one call, the states of a fetched batch's instances whose steps would read
        them (none kept, or kept too long) and keep them for those steps (see :meth:`_run_redis`)."""
        if self._sql is not None:
            return
        keyspace = broker.keyspace
        cache = self._cached
        ahead = self._ahead
        now = time.monotonic()
        keys: dict[str, None] = {}
        partition, prefix = -1, ""
        for d in deliveries:
            correlation = d.envelope.key if d.envelope is not None else None
            if not correlation:
                continue
            if d.source.partition != partition:  # (a batch is one partition's)
                partition = d.source.partition
                prefix = self._prefix(keyspace, partition)
            key = prefix + correlation
            kept = cache.get(key)
            if kept is not None and kept.fence == fence and (kept.until > now or kept.write is not None):
                continue  # its step starts on the kept state, or reads after this process's own write
            keys[key] = None
        if not keys:
            return
        rows = await broker.read_hashes(list(keys), _STATE_FIELDS, channel=channel)
        for key, row in zip(keys, rows, strict=True):
            if row is not None:  # (else not a hash: its step reads it and fails with the reason)
                self._drop_ahead(key)
                size = len(row[1] or b"") + len(row[2] or b"")
                ahead[key] = (fence, row, size)
                self._ahead_bytes += size
        while len(ahead) > STATE_CACHE_SIZE or self._ahead_bytes > STATE_CACHE_BYTES:
            _, dropped = ahead.popitem(last=False)
            self._ahead_bytes -= dropped[2]

    def _drop_ahead(self, key: str) -> tuple[int | None, list[Any], int] | None:
        """Take ``key``'s state read ahead out (None if there is none)."""
        row = self._ahead.pop(key, None)
        if row is not None:
            self._ahead_bytes -= row[2]
        return row

    async def _run_redis(self, step: _Step, source: str, body: bytes, ctx: Context, correlation: str) -> None:
        key = self.state_key(ctx, correlation)
        fence = ctx._fence
        now = time.monotonic()
        # The state this process saved last, if recent and saved in this tenure of the partition
        # (taken out: it is put back once this step's outcome is decided).
        cached = self._cached.pop(key, None)
        ahead = self._drop_ahead(key) if self._ahead else None
        last: _Kept | None = None  # the instance's entry, kept in this tenure: its last save, maybe unsent
        loaded: tuple[Any, dict[str, str]] | None = None
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
                await ctx._flush()  # read after this process's own last write of it, not before
                ahead = None  # (which a read ahead may predate)
            last = None
            if ahead is not None and ahead[0] == fence:  # read with its batch
                version_raw, state_raw, pending_raw, done = ahead[1]
            else:  # (sent with the other lanes' reads: one write for many steps)
                version_raw, state_raw, pending_raw, done = await ctx._broker.read_shared("HMGET", key, *_STATE_FIELDS)
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
                    await ctx._flush()  # its previous state write first (this commit builds on it)
                if not last.applied:  # (the tenure is over: this run commits nothing,
                    raise EffectsConflict(  # the next tenure runs it)
                        f"saga {self.label}: the instance's previous state write was not applied"
                    )
            tx = ctx.redis_transaction()
            tx.expect(key, "v", version)  # what the step decided is decided on this version
            await self._save(ctx, sctx, key, version or 0)
            return
        if version is None or done:  # ignored: nothing to keep
            if not fast:
                ctx.redis_transaction().expect(key, "v", version)
            return
        # ignored: the state stays as it was
        if loaded is None:
            assert state_raw is not None
            pending_raw = pending_raw or b"{}"
            loaded = (self._load_state(state_raw), orjson.loads(pending_raw))
            size = len(state_raw) + len(pending_raw)
        if fast:  # (its last write, if unsent, stays what the next read waits for)
            self._keep_state(last or _Kept(key), version, *loaded, size, fence)
        else:
            tx = ctx.redis_transaction()
            tx.expect(key, "v", version)
            self._cache_after_commit(tx, key, version, *loaded, size, fence)

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
            names, values = _SAVED_WITH_TIMEOUTS, (new, raw, timeouts)
            size = len(raw) + len(timeouts)
        else:  # (absent or {} stored: left as it is)
            names, values = _SAVED, (new, raw)
            size = len(raw) + 2
        fence = ctx._fence
        if entry is None or not entry.applied or (entry.fence != fence and entry.write is not None):
            entry = _Kept(key)  # (a write of an earlier tenure may still be noted on the old one)
        entry.write = ctx._ack_write = _StateWrite(entry, str(version) if version else "", names, values, self._note)
        self._keep_state(entry, new, sctx.state, pending, size, fence, now + self._cache_ttl)

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
        version: int,
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

    def _cache_after_commit(
        self, tx: Any, key: str, version: int, state: Any, pending: dict[str, str], size: int, fence: int | None
    ) -> None:
        """Keep ``key``'s state once the step's commit applied (with the guard passed, it is the
        stored one); ``size``: the bytes of its JSON, counted against the budget."""

        def keep() -> None:
            self._careful.pop(key, None)
            self._keep_state(_Kept(key), version, state, pending, size, fence)

        tx.after_commit(keep)

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
        if self._state_decode is not None:
            return self._state_decode(raw or b"{}")  # type: ignore[no-any-return]
        return converter.structure(orjson.loads(raw or b"{}"), Any)  # type: ignore[no-any-return]

    async def _save(self, ctx: Context, sctx: SagaContext[S], key: str, version: int) -> None:
        tx = ctx.redis_transaction()
        new = version + 1
        if sctx.completed:
            tx.call("DEL", key)
            tx.call("HSET", key, "v", new, "done", 1)
            tx.call("PEXPIRE", key, self.keep_completed_ms)
            tx.after_commit(lambda: self._drop_ahead(key))  # (a state read ahead before it: stale)
            return
        state = _state_json(sctx.state)
        pending = orjson.dumps(sctx._pending)
        tx.call("HSET", key, "v", new, "s", state, "t", pending)
        self._cache_after_commit(tx, key, new, sctx.state, sctx._pending, len(state) + len(pending), ctx._fence)
        if sctx._timeouts:
            await self._stage_timeouts(ctx, sctx)

    async def _stage_timeouts(self, ctx: Context, sctx: SagaContext[S]) -> None:
        """Write the requested timeouts into the step's commit: scheduled messages of this very
        partition (the same hash tag as the state), stored only if the state is saved."""
        keyspace = ctx._broker.keyspace
        pkeys = keyspace.partition(self.queue.name, ctx.partition)
        tx = ctx.redis_transaction()
        earliest = min(due for _, _, due in sctx._timeouts)
        # The namespace index first (another slot, outside the commit): a commit that then fails
        # leaves a stale hint, never a stored timeout no mover looks at (as publish does).
        await ctx.redis.zadd(keyspace.scheduled_index, {f"{self.queue.name}|{ctx.partition}": earliest}, lt=True)
        for timeout_id, payload, due in sctx._timeouts:
            env, _ = self._timeout_envelope(ctx, sctx, timeout_id, payload, due)
            fields = _msgpack_strings([_as_bytes(f) for f in encode_fields(env)])
            tx.call("ZADD", pkeys.scheduled, due, timeout_id)
            tx.call("HSET", pkeys.scheduled_envelopes, timeout_id, fields)

    def _timeout_envelope(
        self, ctx: Context, sctx: SagaContext[S], timeout_id: str, payload: Any, due: int, *, spec: bool = False
    ) -> Outgoing:
        """The scheduled message a timeout is: to this saga's queue, keyed by the instance, due at ``due``."""
        headers = {
            SAGA_INPUT: f"timeout:{type_name(payload)}",
            CORRELATION_ID: ctx.correlation_id,
            CAUSATION_ID: ctx.message_id,
            DELIVER_AT: str(due),
        }
        destination = self.queue if spec else self.queue.name  # (the outbox relay declares the queue from it)
        return build_envelope(
            destination, COMMAND, payload, key=sctx.correlation, headers=headers, message_id=timeout_id
        )


_STATE_FIELDS = ("v", "s", "t", "done")
"""The fields of a saga instance's state hash a step reads: version, state, timeouts, completed."""

_SAVED = ("v", "s")  # the fields a step's save sent with the ack writes: version, state
_SAVED_WITH_TIMEOUTS = ("v", "s", "t")  # (and the timeouts, once the instance has had some)


def _state_json(state: Any) -> bytes:
    """A state's JSON: a ``dict`` of types orjson writes itself as orjson writes it (what the payload
    converter would give for them), anything else through the converter."""
    if type(state) is dict:
        try:
            return orjson.dumps(state)
        except TypeError:  # (sets, bytes, attrs instances, non-str keys...: the converter knows them)
            pass
    return orjson.dumps(converter.unstructure(state))


def _type_label(tp: Any) -> str:
    """The type name a producer records for payloads of ``tp`` (as :func:`type_name` gives it)."""
    name = getattr(tp, "__message_type__", None)
    if isinstance(name, str):
        return name
    if tp is dict:
        return "json"
    return getattr(tp, "__name__", str(tp))
