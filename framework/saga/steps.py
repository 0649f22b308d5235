"""Declaring a saga's steps: one per input (a handler forwards it to the saga queue) and per timeout type."""

from __future__ import annotations

import functools
import typing
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import anyio

from broker import Start
from framework._payloads import decoder_for
from framework.context import Context
from framework.handlers import HandlerError, Queue, Topic, _inspect
from framework.retries import RetryPolicy
from framework.saga.policy import SAGA_INPUT, SagaError

if TYPE_CHECKING:
    from framework.saga.step_context import SagaContext

__all__ = ["SagaService", "StepDeclarations"]

S = TypeVar("S")
F = TypeVar("F", bound=Callable[..., Any])


class SagaService(Protocol):
    """The service a saga declares its handlers on (a :class:`framework.Service`)."""

    name: str
    retry: RetryPolicy

    def event(self, topic: str | Topic, *, retry: RetryPolicy | None = ..., start: Start = ...) -> Callable[[F], F]:
        """Declare a handler of the events published to ``topic``."""

    def command(self, queue: str | Queue, *, retry: RetryPolicy | None = ...) -> Callable[[F], F]:
        """Declare the handler of the commands sent to ``queue``."""

    def _register(
        self,
        dest: Queue | Topic,
        retry: RetryPolicy | None,
        key: Callable[[Any], str] | None,
        start: Start,
        inbox: bool | None,
        timeout: timedelta | float | None,
        prepare: Any = ...,
        needs: dict[str, str] | None = None,
    ) -> Callable[[F], F]:
        """Register a handler of ``dest`` (``prepare``: reads ahead what a fetched batch's runs need)."""


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


def _type_label(tp: Any) -> str:
    """The type name a producer records for payloads of ``tp`` (as :func:`type_name` gives it)."""
    name = getattr(tp, "__message_type__", None)
    if isinstance(name, str):
        return name
    if tp is dict:
        return "json"
    return getattr(tp, "__name__", str(tp))


class StepDeclarations(Generic[S]):
    """The part of :class:`~framework.saga.Saga` that declares its steps (its ``__init__`` sets
    the attributes below)."""

    service: SagaService
    name: str
    queue: Queue
    _steps: dict[str, _Step]
    _timeout_steps: dict[str, _Step]

    @property
    def label(self) -> str:
        """``service.saga`` for logs."""
        return f"{self.service.name}.{self.name}"

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
