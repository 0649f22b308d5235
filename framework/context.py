"""The context a handler receives: the message's metadata and staged sends."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator, Mapping
from contextlib import AbstractAsyncContextManager
from datetime import datetime, timedelta
from typing import Any, cast

from broker import COMMAND, EVENT, Delivery, Envelope, GuardedWrite, Kind, derive_id
from broker.capabilities import REDIS, RedisTransaction
from broker.codec import check_body_size
from broker.headers import CAUSATION_ID, CORRELATION_ID
from broker.state import Effects
from framework._messages import Outgoing, build_envelope
from framework.effects import sql_transaction
from framework.handlers import Handler, HandlerError, Queue, Topic
from framework.lifespan import RESOURCES, Resources
from framework.logs import get_logger
from framework.observability import hooks
from framework.replies import reply_for
from framework.requests import requester_for
from framework.scheduling import with_due

__all__ = ["Context"]

log = get_logger("framework.context")


class _Staged:
    """Returned by send/publish: staging already happened, so awaiting it is optional."""

    __slots__ = ("message_id",)

    def __init__(self, message_id: str) -> None:
        self.message_id = message_id

    def __await__(self) -> Generator[Any, None, str]:
        return self.message_id
        yield  # pragma: no cover - makes this a generator


class Context:
    """Metadata of the message being handled, and ``send``/``publish`` for outgoing messages.

    Outgoing messages are staged, and leave only after the handler returns successfully (before
    the incoming message is acknowledged). Their ids derive from the incoming id and their
    position, so a retried handler re-sends the same ids and downstream inboxes drop the copies.
    ``send``/``publish`` work from sync and async handlers; ``await`` on them is optional.
    """

    __slots__ = (
        "_ack_write",
        "_broker",
        "_delivery",
        "_duplicate",
        "_effects",
        "_extra_headers",
        "_fence",
        "_flush",
        "_handler",
        "_outgoing",
        "_reply",
        "_sql_done",
        "_sql_error",
        "_staged",
        "attempt",
    )

    def __init__(
        self,
        delivery: Delivery,
        handler: Handler,
        attempt: int,
        broker: Any = None,
        fence: int | None = None,
        flush: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._delivery = delivery
        self._handler = handler
        self._outgoing: list[Outgoing] = []
        self._effects: Effects | None = None  # recorded writes: ctx.redis_transaction(), a saga step's state
        self._broker = broker
        self._staged = 0  # messages staged so far, including those moved to a SQL outbox: their positions
        self._duplicate = False  # a SQL transaction found this message already processed
        self._sql_done = False  # a SQL transaction of this run committed
        self._sql_error: BaseException | None = None  # a SQL block of this run did not commit
        self._extra_headers: dict[str, str] | None = None  # set by middleware for every outgoing message
        self._fence = fence  # the partition tenure's fencing token (None: the partition is not owned)
        self._flush = flush  # settles the lane's finished runs and sends the queued acks now (in a worker)
        self._ack_write: GuardedWrite | None = None  # written with the ack (a saga step's state)
        self._reply: Envelope | None = None  # the reply to a request, sent after the run succeeds
        self.attempt = attempt
        """This attempt's number (1 for the first), counting retries and crash redeliveries."""

    @property
    def envelope(self) -> Envelope:
        """The incoming envelope."""
        assert self._delivery.envelope is not None
        return self._delivery.envelope

    @property
    def message_id(self) -> str:
        """The incoming message's id."""
        return self.envelope.id

    @property
    def destination(self) -> str:
        """The queue or topic the message came from."""
        return self.envelope.destination

    @property
    def partition(self) -> int:
        """The partition it came from."""
        return self._delivery.source.partition

    @property
    def key(self) -> str | None:
        """The message's key, if it has one."""
        return self.envelope.key

    @property
    def type(self) -> str:
        """The payload type name recorded by the producer."""
        return self.envelope.type

    @property
    def headers(self) -> Mapping[str, str]:
        """The message's headers (read-only view)."""
        return self.envelope.headers

    @property
    def published_at(self) -> datetime:
        """When the producer published it (UTC)."""
        return self.envelope.published_datetime

    @property
    def delivery_count(self) -> int:
        """How often the broker delivered this stream entry (raised by crashes and claims)."""
        return self._delivery.delivery_count

    @property
    def service(self) -> str:
        """The handling service's name."""
        return self._handler.service

    @property
    def handler(self) -> str:
        """The handler's name."""
        return self._handler.name

    @property
    def correlation_id(self) -> str:
        """The conversation's id: the first message's id, carried along by every hop."""
        return self.envelope.headers.get(CORRELATION_ID) or self.envelope.id

    @property
    def resources(self) -> Resources:
        """The services' resources open in this process: ``ctx.resources[db]`` (see :mod:`framework.lifespan`)."""
        return RESOURCES

    @property
    def outgoing(self) -> list[Outgoing]:
        """Messages staged so far (sent after the handler succeeds)."""
        return self._outgoing

    @property
    def redis_effects(self) -> Effects | None:
        """The writes this run recorded (``redis_transaction()``, a saga step's state), if any: committed
        with the ack."""
        return self._effects

    @property
    def duplicate(self) -> bool:
        """Whether this run found the message already processed (``sql_transaction``)."""
        return self._duplicate

    def mark_duplicate(self) -> None:
        """Record that the message was found processed: it is acknowledged and counted as a duplicate."""
        self._duplicate = True

    def set_outgoing_header(self, name: str, value: str) -> None:
        """Set a header on every message this run stages, already staged or staged later.

        For middleware (a trace context, a tenant id): set before ``call_next()`` to also reach
        messages a ``sql_transaction`` writes to the outbox. It overrides a header of the same
        name given to ``send``/``publish``.
        """
        if self._extra_headers is None:
            self._extra_headers = {}
        self._extra_headers[name] = value
        for env, _ in self._outgoing:
            env.headers[name] = value

    def _unstage_from(self, position: int) -> list[Outgoing]:
        """Take back messages staged since ``position`` (a SQL transaction writes them to its outbox)."""
        staged = self._outgoing[position:]
        del self._outgoing[position:]  # their positions stay taken (self._staged): later ids differ
        return staged

    def _sql_committed(self) -> None:
        self._sql_done = True

    def _run_mark(self) -> tuple[int, int]:
        """Where a run starts (see :meth:`_reset_run`)."""
        return len(self._outgoing), self._staged

    def _reset_run(self, mark: tuple[int, int]) -> None:
        """Forget what the run from ``mark`` staged and recorded, to run the handler again with this context."""
        del self._outgoing[mark[0] :]
        self._staged = mark[1]
        self._effects = None
        self._ack_write = None
        self._reply = None
        self._duplicate = self._sql_done = False
        self._sql_error = None

    def _sql_failed(self, error: BaseException) -> None:
        """A SQL block of this run did not commit: the run fails with ``error`` even if the handler catches it."""
        self._sql_error = error

    @property
    def hash_tag(self) -> str:
        """The message's Cluster hash tag: keys written in a Redis transaction must carry it on a Cluster."""
        return "{" + f"{self.destination}:{self.partition}" + "}"

    @property
    def redis(self) -> Any:
        """The broker's async Redis client, for reads (and writes outside exactly-once guarantees);
        None on a transport without the Redis data store (``memory://``)."""
        return getattr(self._broker, "redis", None)

    def redis_transaction(self) -> RedisTransaction:
        """Writes applied atomically with the inbox mark, outgoing messages and the ack (exactly once).

        Call it once per handler run; see :data:`framework.effects.RedisEffects`.
        """
        broker = self._broker
        if broker is None or REDIS not in broker.capabilities:
            transport = "no" if broker is None else f"the {broker.transport}"
            raise HandlerError(
                f"ctx.redis_transaction() needs the Redis transport: {transport} transport "
                "has no Redis data store (use ctx.sql_transaction, or test this handler on the embedded Valkey)"
            )
        if self._effects is None:  # (else made by the Redis transport too, for a saga step's state)
            self._effects = broker.effects()
        return cast(RedisTransaction, self._effects)

    def _state_effects(self) -> Effects:
        """The run's recorder of writes for the transport's state store (a saga step's state and timeouts):
        the one ``redis_transaction()`` gave, if it was called (the runtime checked the capability)."""
        effects = self._effects
        if effects is None:
            effects = self._effects = self._broker.effects()
        return effects

    def sql_transaction(self, engine: Any) -> AbstractAsyncContextManager[Any]:
        """A SQL transaction that records this message in the inbox table with its effects (exactly once).

        ``async with ctx.sql_transaction(engine) as conn: ...``. A message already recorded raises
        :class:`~framework.effects.AlreadyProcessed` (the runtime acks it as a duplicate). Messages
        staged inside the block are written to the outbox table in the same transaction.
        """
        return sql_transaction(self, engine)

    def _stage(
        self,
        kind: Kind,
        destination: str | Queue | Topic,
        payload: Any,
        key: str | None,
        headers: Mapping[str, str] | None,
        type: str | None,
        delay: timedelta | float | None = None,
        at: datetime | None = None,
    ) -> _Staged:
        env = self.envelope
        hdrs = {CORRELATION_ID: self.correlation_id, CAUSATION_ID: env.id}
        if headers:
            hdrs.update(headers)
        if delay is not None or at is not None:  # checked now: the handler sees a bad delay, not the settle
            hdrs = with_due(hdrs, delay, at) or hdrs
        message_id = derive_id(env.id, f"{self._handler.service}/{self._staged}")
        if hooks.TRACING:  # a PRODUCER span, child of this attempt's CONSUMER span; context into hdrs
            hooks.staged(hdrs, destination, message_id)
        if self._extra_headers:  # middleware's headers win, a trace context too
            hdrs.update(self._extra_headers)
        if self._sql_done:
            log.warning(
                "message staged after ctx.sql_transaction committed: stage it inside the block. If this "
                "handler fails after the commit, its retry finds the message processed and skips the "
                "rest, so this message would never be sent",
                message_id=env.id,
                handler=self._handler.label,
            )
        self._staged += 1
        out = build_envelope(
            destination,
            kind,
            payload,
            key=key,
            headers=hdrs,
            type=type,
            message_id=message_id,
        )
        limit = getattr(self._broker, "max_body_bytes", None)
        if limit is not None:  # refused when staged, not when the run settles: the handler sees why
            check_body_size(out[0], limit)
        self._outgoing.append(out)
        return _Staged(message_id)

    def send(
        self,
        queue: str | Queue,
        command: Any,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
        type: str | None = None,
        delay: timedelta | float | None = None,
        at: datetime | None = None,
    ) -> _Staged:
        """Stage a command for ``queue``; it is sent only if this handler succeeds.

        ``delay`` (seconds or timedelta) or ``at`` (an aware datetime) schedules it: it is stored
        when this handler succeeds and delivered when due (see :mod:`framework.scheduling`)."""
        return self._stage(COMMAND, queue, command, key, headers, type, delay, at)

    def publish(
        self,
        topic: str | Topic,
        event: Any,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
        type: str | None = None,
        delay: timedelta | float | None = None,
        at: datetime | None = None,
    ) -> _Staged:
        """Stage an event for ``topic``; it is published only if this handler succeeds
        (``delay``/``at``: then scheduled, as for :meth:`send`)."""
        return self._stage(EVENT, topic, event, key, headers, type, delay, at)

    def _set_result(self, result: Any) -> None:
        """The handler returned ``result``: the reply to send, if the message is a request (``reply-to``)."""
        self._reply = reply_for(self.envelope, result)

    async def request(
        self,
        queue: str | Queue,
        command: Any,
        *,
        timeout: float,
        response: Any = Any,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
        type: str | None = None,
    ) -> Any:
        """Send a request now and wait for its reply (as :meth:`framework.Client.request`).

        Not staged: the request leaves at once, with a fresh id, so a retried handler asks again
        (make the handler that answers idempotent by its payload when that matters). Carries this
        message's correlation id. Async handlers only; the timeout counts against this handler's.
        """
        if self._broker is None:
            raise HandlerError("ctx.request() needs the runtime's broker (this context has none)")
        hdrs = {CORRELATION_ID: self.correlation_id, CAUSATION_ID: self.envelope.id}
        if headers:
            hdrs.update(headers)
        if self._extra_headers:
            hdrs.update(self._extra_headers)
        return await requester_for(self._broker).request(
            queue, command, timeout=timeout, response=response, key=key, headers=hdrs, type=type
        )
