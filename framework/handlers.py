"""Declared handlers: their destinations (Queue, Topic), the record the runtime runs (Handler), the checks.

:class:`~framework.service.Service` declares handlers with these; the runtime, the handler
context and the saga read them. Users import them from :mod:`framework` (and
:mod:`framework.service`), which re-export them.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import attrs

from broker import COMMAND, DEFAULT_RETENTION_MS, EVENT, DestinationSpec, Start
from framework.batching import BatchPolicy
from framework.retries import RetryPolicy
from framework.subscriptions import Filter, Pattern

if TYPE_CHECKING:
    from broker import Broker, Delivery

__all__ = ["DEFAULT_TIMEOUT", "Handler", "HandlerError", "Queue", "Topic"]

DEFAULT_TIMEOUT = 300.0
"""Seconds a handler may run before it is cancelled and retried (``Service(timeout=...)``)."""


class HandlerError(TypeError):
    """A handler or service is declared wrongly; the message names it and says what to change."""

    __module__ = "framework.service"  # its public home (and the type name a dead letter would record)


def _ms(value: timedelta | float | None) -> int | None:
    if value is None:
        return None
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    return int(seconds * 1000)


@functools.lru_cache(maxsize=4096)
def _spec(name: str, kind: str, partitions: int, retention_ms: int | None, max_length: int | None) -> DestinationSpec:
    return DestinationSpec(name, kind, partitions, retention_ms, max_length)  # type: ignore[arg-type]


@attrs.frozen
class Queue:
    """A queue of commands: one stream per partition, one consumer group (its owning service)."""

    name: str
    partitions: int = 1

    def spec(self) -> DestinationSpec:
        """The broker-level description."""
        return _spec(self.name, COMMAND, self.partitions, None, None)


@attrs.frozen
class Topic:
    """A topic of events: retained for ``retention`` (seconds or timedelta) and/or ``max_length``."""

    name: str
    partitions: int = 1
    retention: timedelta | float | None = timedelta(milliseconds=DEFAULT_RETENTION_MS)
    max_length: int | None = None

    def spec(self) -> DestinationSpec:
        """The broker-level description."""
        return _spec(self.name, EVENT, self.partitions, _ms(self.retention), self.max_length)


@attrs.define(eq=False)
class Handler:
    """A registered handler and everything the runtime needs to call it."""

    service: str
    name: str
    destination: Queue | Topic
    fn: Callable[..., Any]
    is_async: bool
    takes_context: bool
    payload_type: Any
    decode: Callable[[bytes], Any]
    key: Callable[[Any], str] | None
    retry: RetryPolicy
    start: Start
    inbox: bool  # the Redis inbox (leases and records ids per group)
    timeout: float | None = DEFAULT_TIMEOUT  # seconds; None: no limit
    sql_inbox: bool = False  # inbox="sql": every run's effects and inbox row are in ctx.sql_transaction
    # Called by the admit stage with each fetched batch's runnable deliveries before they go to the
    # lanes, with the broker, the partition tenure's fencing token and the fetcher's connection: a
    # handler reads ahead there what its runs will need, one round trip per batch (a saga's states).
    # It must not fail the batch (its errors are logged and the runs go on without it).
    prepare: Callable[[Broker, list[Delivery], int | None, Any], Awaitable[None]] | None = None
    # Optional transport capabilities the handler needs (name -> why, for the error at start when
    # its transport lacks one: see framework.runtime.requirements).
    needs: dict[str, str] = attrs.field(factory=dict)
    batch: BatchPolicy | None = None  # a batch handler: it takes a list of payloads (framework.runtime.batch)
    # filter=: which of the destination's messages this handler takes (None: the default handler)
    filter: Filter | None = None
    # a topic pattern ("orders.*"): the runtime wires a copy of this handler per matching topic
    pattern: Pattern | None = None

    @property
    def spec(self) -> DestinationSpec:
        """The destination's broker spec."""
        return self.destination.spec()

    @functools.cached_property
    def label(self) -> str:
        """``service.handler`` for logs and dead letters."""
        return f"{self.service}.{self.name}"


def _inspect(fn: Callable[..., Any], where: str) -> tuple[bool, bool, Any]:
    if not callable(fn):
        raise HandlerError(f"{where}: {fn!r} is not callable")
    target = fn
    while isinstance(target, functools.partial):
        target = target.func
    is_async = inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(
        getattr(target, "__call__", None)  # noqa: B004 - async callable objects
    )
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise HandlerError(f"{where}: cannot read its signature ({exc})") from None
    params = [
        p
        for p in sig.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    extra = [p for p in sig.parameters.values() if p.kind == p.KEYWORD_ONLY and p.default is p.empty]
    if not 1 <= len(params) <= 2 or extra:
        raise HandlerError(f"{where}: a handler takes (payload) or (payload, ctx), but its signature is {sig}")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:
        raise HandlerError(f"{where}: cannot resolve its type hints ({exc})") from None
    payload_type = hints.get(params[0].name, Any)
    return is_async, len(params) == 2, payload_type
