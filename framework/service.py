"""Services and their handlers: the decorators teams write services with.

A :class:`Service` is a consumer group: every instance of it shares the work. Its handlers are
declared with :meth:`Service.command` (a queue: each message handled by one instance of the one
owning service) and :meth:`Service.event` (a topic: every subscribing service gets each event).
Handler signatures are checked when declared, so a mistake fails at import with the handler's name.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from broker import Start, validate_name
from framework._payloads import decoder_for
from framework.batching import BatchPolicy, batch_element_type
from framework.handlers import DEFAULT_TIMEOUT, Handler, HandlerError, Queue, Topic, _inspect
from framework.lifespan import LifespanEntry, Resource, declare
from framework.retries import DEFAULT_RETRY, RetryPolicy
from framework.saga import Saga
from framework.saga.policy import DEFAULT_KEEP_COMPLETED
from framework.scheduling import Job, ScheduleError
from framework.subscriptions import Filter, Pattern, filter_of, is_pattern, names_overlap

if TYPE_CHECKING:
    from broker import Broker, Delivery
    from framework.middleware import Middleware

__all__ = ["Handler", "HandlerError", "Queue", "Service", "Topic"]

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")
H = TypeVar("H", bound=Callable[[], Awaitable[None]])


def _seconds(value: timedelta | float | None, where: str) -> float | None:
    """A timeout in seconds (None or math.inf: no limit); a non-positive one is a declaration error."""
    if value is None:
        return None
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if seconds <= 0:
        raise HandlerError(f"{where}: timeout must be positive (or None for no limit), got {value!r}")
    return None if seconds == float("inf") else seconds


_InboxMode = bool | Literal["sql"]
"""``True`` (the Redis inbox), ``False`` (none) or ``"sql"`` (only the SQL inbox of ``ctx.sql_transaction``)."""


def _inbox_mode(value: Any, where: str) -> _InboxMode:
    if value is True or value is False or value == "sql":
        return value  # type: ignore[no-any-return]
    raise HandlerError(f"{where}: inbox must be True, False or 'sql', not {value!r}")


class Service:
    """A named service: a consumer group whose instances share its handlers' messages.

    ``retry`` is the default policy of its handlers; ``inbox`` (on by default) drops duplicate
    deliveries of a message the service already processed; ``inbox="sql"`` declares that every
    handler keeps its effects in ``ctx.sql_transaction``, whose SQL inbox row is then the only
    record (no Redis inbox: a run that ends without the block is logged as unprotected);
    ``timeout`` (seconds or timedelta, default 300, None for no limit) is how long a handler may
    run before it is cancelled and the attempt counts as failed
    (:class:`~framework.retries.HandlerTimeout`), so a hung handler cannot hold its lane forever.
    ``middleware`` wraps each of its handlers (see :mod:`framework.middleware`), after the
    runtime's, in order; :meth:`middleware` adds one more.
    """

    def __init__(
        self,
        name: str,
        *,
        retry: RetryPolicy | None = None,
        inbox: _InboxMode = True,
        timeout: timedelta | float | None = DEFAULT_TIMEOUT,
        middleware: Sequence[Middleware] = (),
    ) -> None:
        try:
            self.name = validate_name("service", name)
        except Exception as exc:
            raise HandlerError(str(exc)) from None
        self.retry = retry or DEFAULT_RETRY
        self.inbox = _inbox_mode(inbox, f"service {self.name!r}")
        self.timeout = _seconds(timeout, f"service {self.name!r}")
        self.handlers: list[Handler] = []
        self.jobs: list[Job] = []  # recurring jobs (every/cron); each also has a handler on its queue
        self.middleware_chain: list[Middleware] = []
        self.lifespan: list[LifespanEntry] = []  # resources and hooks, in declaration order
        for mw in middleware:
            self.middleware(mw)

    def resource(self, fn: Callable[[], AsyncIterator[T]]) -> Resource[T]:
        """Declare a resource opened once per worker process: ``fn`` is an async generator function
        (open; ``yield value``; close), run before the first message and closed after the drain.
        Handlers read the value with ``ctx.resources[resource]`` (see :mod:`framework.lifespan`)."""
        return self._lifespan(fn, "resource")  # type: ignore[return-value]

    def on_startup(self, fn: H) -> H:
        """Declare ``async def fn() -> None`` run once per worker process before its first message."""
        self._lifespan(fn, "on_startup")
        return fn

    def on_shutdown(self, fn: H) -> H:
        """Declare ``async def fn() -> None`` run once per worker process after the drain (reverse order)."""
        self._lifespan(fn, "on_shutdown")
        return fn

    def _lifespan(self, fn: Any, what: str) -> LifespanEntry:
        try:
            entry = declare(self.name, fn, what)
        except ValueError as exc:
            raise HandlerError(str(exc)) from None
        self.lifespan.append(entry)
        return entry

    def middleware(self, fn: Middleware) -> Middleware:
        """Add ``fn`` (``async def fn(message, ctx, call_next) -> Outcome``) to this service's middleware.

        Usable as a decorator; it runs inside the middleware added before it.
        """
        if not callable(fn):
            raise HandlerError(f"{self.name}: middleware must be an async function (message, ctx, call_next)")
        self.middleware_chain.append(fn)
        return fn

    def __repr__(self) -> str:
        return f"Service({self.name!r}, handlers={[h.destination.name for h in self.handlers]})"

    def command(
        self,
        queue: str | Queue,
        *,
        retry: RetryPolicy | None = None,
        key: Callable[[Any], str] | None = None,
        inbox: _InboxMode | None = None,
        timeout: timedelta | float | None = None,
        batch: BatchPolicy | None = None,
    ) -> Callable[[F], F]:
        """Declare the handler of the commands sent to ``queue``.

        ``retry``, ``inbox`` and ``timeout`` default to the service's (``timeout=math.inf``: no limit).
        ``batch``: the handler takes a ``list`` of payloads (see :class:`~framework.batching.BatchPolicy`).
        """
        dest = queue if isinstance(queue, Queue) else Queue(queue)
        if isinstance(queue, Topic):
            raise HandlerError(f"{self.name}: {queue.name!r} is a Topic; use @service.event for topics")
        return self._register(dest, retry, key, "earliest", inbox, timeout, batch=batch)

    def event(
        self,
        topic: str | Topic,
        *,
        retry: RetryPolicy | None = None,
        key: Callable[[Any], str] | None = None,
        start: Start = "earliest",
        inbox: _InboxMode | None = None,
        timeout: timedelta | float | None = None,
        batch: BatchPolicy | None = None,
        filter: Filter | Callable[[Any], bool] | None = None,
    ) -> Callable[[F], F]:
        """Declare a handler of the events published to ``topic``.

        ``topic`` may be a pattern: ``*`` matches one dot-separated word, ``#`` zero or more
        (``"orders.*"``); matching topics, existing or created while the service runs, are
        subscribed. ``filter`` (a :class:`~framework.subscriptions.Filter` or a predicate of
        :class:`~framework.subscriptions.MessageInfo`) takes only some of the topic's events,
        judged before the body is decoded; see docs/patterns-and-filters.md.

        ``key`` computes the ordering key from the payload (default: the message's key); messages
        with one key run one at a time, in order. ``start`` applies when this service first
        subscribes: ``earliest`` processes the topic's retained history, ``latest`` only new events.
        ``retry``, ``inbox`` and ``timeout`` default to the service's (``timeout=math.inf``: no limit).
        ``batch``: the handler takes a ``list`` of payloads (see :class:`~framework.batching.BatchPolicy`).
        """
        if isinstance(topic, Queue):
            raise HandlerError(f"{self.name}: {topic.name!r} is a Queue; use @service.command for queues")
        if start not in ("earliest", "latest"):
            raise HandlerError(f"{self.name}: start must be 'earliest' or 'latest', not {start!r}")
        dest = topic if isinstance(topic, Topic) else Topic(topic)
        pattern = None
        if is_pattern(dest.name):
            if isinstance(topic, Topic):
                raise HandlerError(
                    f"{self.name}: Topic({dest.name!r}) is a pattern: pass it as a string; the topics it matches "
                    "keep their own partitions and retention"
                )
            try:
                pattern = Pattern.parse(dest.name)
            except ValueError as exc:
                raise HandlerError(f"{self.name}: {exc}") from None
        try:
            chosen = filter_of(filter)
        except ValueError as exc:
            raise HandlerError(f"{self.name}: handler for {dest.name!r}: {exc}") from None
        if chosen is not None and batch is not None:
            raise HandlerError(f"{self.name}: handler for {dest.name!r}: a batch handler takes no filter= (not yet)")
        return self._register(dest, retry, key, start, inbox, timeout, batch=batch, filter=chosen, pattern=pattern)

    def every(
        self,
        interval: timedelta | float,
        *,
        name: str | None = None,
        retry: RetryPolicy | None = None,
        timeout: timedelta | float | None = None,
    ) -> Callable[[F], F]:
        """Declare a recurring job run every ``interval`` (seconds or timedelta, at least 1 s; ticks
        fall on multiples of it since the Unix epoch). The handler takes ``(tick: Tick, ctx)``; each
        tick runs once across all instances of the service (see :mod:`framework.scheduling`).
        """
        seconds = interval.total_seconds() if isinstance(interval, timedelta) else float(interval)
        return self._job(name, retry, timeout, interval_ms=int(seconds * 1000))

    def cron(
        self,
        expression: str,
        *,
        tz: str | None = None,
        name: str | None = None,
        retry: RetryPolicy | None = None,
        timeout: timedelta | float | None = None,
    ) -> Callable[[F], F]:
        """Declare a recurring job on a cron ``expression`` (``"0 3 * * *"``: 03:00 daily) in time
        zone ``tz`` (an IANA name; UTC when None). Otherwise like :meth:`every`."""
        return self._job(name, retry, timeout, cron=expression, tz=tz)

    def saga(
        self,
        name: str,
        *,
        state: Callable[[], Any],
        partitions: int = 4,
        retry: RetryPolicy | None = None,
        timeout: timedelta | float | None = None,
        keep_completed: timedelta | float | None = None,
        sql: Any = None,
    ) -> Saga[Any]:
        """Declare a saga (process manager) of this service; its steps are declared on the returned
        :class:`~framework.saga.Saga` (``@saga.event``, ``@saga.command``, ``@saga.timeout``).

        ``sql``: keep the state in the ``framework_saga_state`` table of this SQLAlchemy AsyncEngine
        (or a function returning one) instead of Redis; steps then run in ``ctx.sql_transaction``
        and their messages and timeouts leave through the outbox (run a relay)."""
        keep = DEFAULT_KEEP_COMPLETED if keep_completed is None else keep_completed
        return Saga(
            self, name, state=state, partitions=partitions, retry=retry, timeout=timeout, keep_completed=keep, sql=sql
        )

    def _job(
        self,
        name: str | None,
        retry: RetryPolicy | None,
        timeout: timedelta | float | None,
        **schedule: Any,
    ) -> Callable[[F], F]:
        def decorator(fn: F) -> F:
            job_name = name or getattr(fn, "__name__", None) or type(fn).__name__
            queue = f"{self.name}.job.{job_name}"
            try:
                job = Job(service=self.name, name=job_name, queue=queue, **schedule)
            except ScheduleError as exc:
                raise HandlerError(f"{self.name}: {exc}") from None
            if any(j.name == job_name for j in self.jobs):
                raise HandlerError(f"{self.name}: a job named {job_name!r} is declared twice; pass name=")
            self._register(Queue(queue), retry, None, "earliest", None, timeout)(fn)
            self.jobs.append(job)
            return fn

        return decorator

    def _register(
        self,
        dest: Queue | Topic,
        retry: RetryPolicy | None,
        key: Callable[[Any], str] | None,
        start: Start,
        inbox: _InboxMode | None,
        timeout: timedelta | float | None,
        prepare: Callable[[Broker, list[Delivery], int | None, Any], Awaitable[None]] | None = None,
        needs: dict[str, str] | None = None,
        batch: BatchPolicy | None = None,
        *,
        filter: Filter | None = None,
        pattern: Pattern | None = None,
    ) -> Callable[[F], F]:
        if batch is not None and not isinstance(batch, BatchPolicy):
            raise HandlerError(f"{self.name}: batch= takes a BatchPolicy(max_size=..., max_wait=...), not {batch!r}")
        try:
            if pattern is None:
                dest.spec()
        except Exception as exc:
            raise HandlerError(f"{self.name}: {exc}") from None
        seconds = self.timeout if timeout is None else _seconds(timeout, f"{self.name}: handler for {dest.name!r}")
        if key is not None and not callable(key):
            raise HandlerError(f"{self.name}: key= must be a function of the payload, got {key!r}")

        def decorator(fn: F) -> F:
            name = getattr(fn, "__name__", None) or type(fn).__name__
            where = f"handler {self.name}.{name} for {dest.name!r}"
            mode = self.inbox if inbox is None else _inbox_mode(inbox, where)
            for existing in self.handlers:
                if isinstance(dest, Topic) and isinstance(existing.destination, Topic):
                    _check_shared(where, dest.name, filter, mode, existing, batch is not None)
                elif existing.destination.name == dest.name:
                    raise HandlerError(
                        f"{where}: service {self.name!r} already handles {dest.name!r} with {existing.name}; "
                        "one service has one handler per destination"
                    )
            is_async, takes_ctx, payload_type = _inspect(fn, where)
            try:
                decode = decoder_for(payload_type if batch is None else batch_element_type(payload_type))
            except TypeError as exc:
                raise HandlerError(f"{where}: {exc}") from None
            self.handlers.append(
                Handler(
                    service=self.name,
                    name=name,
                    destination=dest,
                    fn=fn,
                    is_async=is_async,
                    takes_context=takes_ctx,
                    payload_type=payload_type,
                    decode=decode,
                    key=key,
                    retry=retry or self.retry,
                    start=start,
                    inbox=mode is True,
                    sql_inbox=mode == "sql",
                    timeout=seconds,
                    prepare=prepare,
                    needs=dict(needs or {}),
                    filter=filter,
                    pattern=pattern,
                    batch=batch,
                )
            )
            return fn

        return decorator


def _check_shared(
    where: str, name: str, filter: Filter | None, mode: _InboxMode, existing: Handler, batch: bool
) -> None:
    """Refuse a topic handler that could take a message ``existing`` takes too (one handler per
    message), or that shares a topic with it under another inbox mode (they share one reader)."""
    other = existing.destination.name
    if not names_overlap(name, other):
        return
    theirs = existing.filter
    both = f"{where} and {existing.label} (for {other!r})"
    if batch or existing.batch is not None:
        raise HandlerError(
            f"{both} share topics, and one takes batches: a batch handler reads its topics alone "
            "(no filter=, no other handler of the service on them)"
        )
    if filter is None and theirs is None:
        raise HandlerError(
            f"{both} are both default handlers (no filter) of the same topics: one handler per message. "
            "Give one a filter=Filter(type=..., headers=...) or handle both in one function"
        )
    if filter is not None and theirs is not None and filter.overlaps(theirs):
        raise HandlerError(
            f"{both} have filters that can both match one message ({filter!r}, {theirs!r}): one handler per "
            "message. Make them differ in type= or in the value of one header (predicates cannot tell them apart)"
        )
    existing_mode = "sql" if existing.sql_inbox else existing.inbox
    if mode != existing_mode:
        raise HandlerError(
            f"{both} share topics but not the inbox mode ({mode!r} and {existing_mode!r}): they share one "
            "reader, so give them the same inbox="
        )
