"""The consumer side: a CONSUMER span per attempt, processing histograms, and the messages dropped
before any handler runs (Redis-inbox duplicates, dead letters at admission).

:class:`Observer` watches every attempt of one handler, only when tracing or metrics are on. A
handler without middleware keeps the runtime's direct path, which calls :meth:`Observer.begin`
and :meth:`Observer.end` around each attempt; with middleware, the observer is the outermost
middleware of the chain (the same two calls around ``call_next``), so user middleware runs in
its span. Per attempt, with tracing on, it takes the parent context from the message's headers,
starts ``process <destination>`` (kind CONSUMER) with the messaging attributes, makes it the
current span while the handler runs (a sync handler's worker thread inherits it), and ends it
with the outcome: ``framework.outcome``, a ``retry`` event with the delay, a ``dead_letter``
event with the reason, the exception recorded and the status ERROR for a failed attempt. A
message that is not sampled gets no SDK span at all: its unsampled context is made current
(:func:`framework.observability.tracing.consumer_parent`). With metrics on it records
``messaging.process.duration`` (by outcome) and, on a first attempt, ``framework.message.latency``
(publish to handler start), into the framework's own buckets.
"""

from __future__ import annotations

import contextvars
import time
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from broker import Delivery
from broker.headers import CORRELATION_ID
from framework.outcomes import CallNext, InboundMessage, Outcome

__all__ = ["Observer", "Watch"]

_STATUSES = ("success", "duplicate", "retry", "dead_letter")
_clock = time.perf_counter


def _context_ops() -> tuple[Any, Any]:
    """attach/detach of OpenTelemetry's current context: its context variable's ``set``/``reset``
    when it keeps the context in one (the default runtime context), else the API's functions."""
    runtime = getattr(otel_context, "_RUNTIME_CONTEXT", None)
    var = getattr(runtime, "_current_context", None)
    if isinstance(var, contextvars.ContextVar):
        return var.set, var.reset
    return otel_context.attach, otel_context.detach


_attach, _detach = _context_ops()


class Watch:
    """One attempt being watched: its span (None when not recorded), the context token to detach
    (None when tracing is off, or once detached) and when it started (metrics).

    A lane reuses one for its attempts, one at a time (:meth:`Observer.begin`). ``unsampled`` is
    the lane's span for messages that are not sampled; its context stays attached from the lane's
    first unsampled message to the end of the batch (``lane_token``, released by
    :meth:`Observer.release`), so an unsampled message attaches nothing of its own."""

    __slots__ = ("lane_token", "span", "started", "token", "unsampled")

    def __init__(self) -> None:
        self.span: Any = None
        self.token: Any = None
        self.started = 0.0
        self.unsampled: Any = None
        self.lane_token: Any = None


class Observer:
    """Traces and times every attempt of one handler (see the module docstring); ``tracing_on``
    and ``metrics_on``: the switches of :mod:`~framework.observability.hooks` (which creates it)."""

    def __init__(self, handler: Any, *, tracing_on: bool, metrics_on: bool) -> None:
        self.handler = handler
        destination = handler.destination.name
        self.span_name = f"process {destination}"
        self.base = {
            "messaging.system": "redis",
            "messaging.destination.name": destination,
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.consumer.group.name": handler.service,
            "framework.service": handler.service,
            "framework.handler": handler.name,
        }
        self.tracer: Any = None
        self.latency: Any = None  # recorders, when metrics are on
        self.by_outcome: dict[str, Any] = {}
        if tracing_on:
            from framework.observability import tracing

            self.tracer = tracing.tracer()
            self._tracing = tracing
        if metrics_on:
            from framework.observability import metrics

            instruments = metrics.instruments()
            attributes = metrics.consumer_attributes(destination, handler.service, handler.service, handler.name)
            self.latency = instruments.latency.recorder(attributes)
            self.by_outcome = {
                status: instruments.duration.recorder({**attributes, "framework.outcome": status})
                for status in _STATUSES
            }

    def __repr__(self) -> str:
        return f"<framework observer of {self.handler.label}>"

    # -- around an attempt ------------------------------------------------------------------------------

    def begin(self, d: Delivery, attempt: int, slot: Any = None) -> Watch:
        """An attempt of ``d`` starts: its span (current until :meth:`end`), its clock, and on a
        first attempt the latency from publish. ``slot``: the lane running it, whose watch is
        reused (none is built per message) and whose reusable span stands for messages that are
        not sampled."""
        env = d.envelope
        assert env is not None  # only decoded messages are attempted
        if slot is None:
            watch = Watch()
        else:
            watch = slot.observed
            if watch is None:
                watch = slot.observed = Watch()
        if self.latency is not None:
            watch.started = _clock()
            if attempt == 1:
                latency = time.time() - env.published_at / 1000
                self.latency.record(latency if latency > 0.0 else 0.0)
        if self.tracer is None:
            return watch
        lane = watch.unsampled
        if lane is None:
            lane = watch.unsampled = self._tracing.Unsampled()
        parent, record = self._tracing.consumer_parent(env.headers, lane)
        if not record:  # not sampled: no span, the (lane's) unsampled context is current
            if slot is None:
                watch.token = _attach(parent)
            elif watch.lane_token is None:
                watch.lane_token = _attach(parent)
            return watch
        span = self.tracer.start_span(self.span_name, parent, trace.SpanKind.CONSUMER, self.base)
        if span.is_recording():
            self._describe(span, d, attempt)
        watch.span = span
        watch.token = _attach(trace.set_span_in_context(span, parent))
        return watch

    def end(self, watch: Watch, status: str, outcome: Outcome | None = None) -> None:
        """The attempt ended with ``status`` (``outcome`` says more for a failure): record it."""
        if watch.token is not None:
            _detach(watch.token)
            watch.token = None
        span = watch.span
        if span is not None:
            watch.span = None
            self._finish(span, status, outcome)
        if self.latency is not None:
            self.by_outcome[status].record(_clock() - watch.started)

    def interrupted(self, watch: Watch) -> None:
        """The attempt was cancelled (its timeout, or shutdown): leave its context now; the span
        is ended by :meth:`end` when the timeout is settled, or by :meth:`abandon`."""
        if watch.token is not None:
            _detach(watch.token)
            watch.token = None

    def release(self, watch: Watch) -> None:
        """The lane's batch is over: leave its unsampled context (in the task that entered it)."""
        if watch.lane_token is not None:
            _detach(watch.lane_token)
            watch.lane_token = None

    def abandon(self, watch: Watch, exc: BaseException | None = None) -> None:
        """End the span of an attempt that was cancelled and will not be settled here."""
        self.interrupted(watch)
        span, watch.span = watch.span, None
        if span is not None:
            if exc is not None and span.is_recording():
                span.record_exception(exc)
            span.end()

    # -- as the outermost middleware (handlers with middleware) ------------------------------------------

    async def __call__(self, message: InboundMessage, ctx: Any, call_next: CallNext) -> Outcome:
        """Run the rest of the chain inside the attempt's span and clock (see the module docstring)."""
        watch = self.begin(ctx._delivery, message.attempt)
        try:
            outcome = await call_next()
        except BaseException as exc:  # cancelled (shutdown): call_next returns failures as outcomes
            self.abandon(watch, exc)
            raise
        self.end(watch, outcome.status, outcome)
        return outcome

    # -- spans ----------------------------------------------------------------------------------------

    @staticmethod
    def _describe(span: Any, d: Delivery, attempt: int) -> None:
        """Set the per-message attributes on a recording span."""
        env = d.envelope
        attributes: dict[str, Any] = {
            "messaging.destination.partition.id": str(d.source.partition),
            "framework.attempt": attempt,
            "framework.delivery_count": d.delivery_count,
        }
        if env is not None:
            attributes["messaging.message.id"] = env.id
            attributes["messaging.message.body.size"] = len(env.body)
            conversation = env.headers.get(CORRELATION_ID)
            if conversation:
                attributes["messaging.message.conversation_id"] = conversation
        else:
            attributes["messaging.message.body.size"] = sum(len(v) for v in d.raw[1::2])
        span.set_attributes(attributes)

    @staticmethod
    def _finish(span: Any, status: str, outcome: Outcome | None, reason: str | None = None) -> None:
        """Write the outcome onto ``span`` and end it."""
        if span.is_recording():
            span.set_attribute("framework.outcome", status)
            exc = outcome.exception if outcome is not None else None
            if status == "retry":
                delay = float(outcome.delay) if outcome is not None else 0.0
                span.add_event("retry", {"framework.retry.delay_s": delay})
                if exc is not None:
                    span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, _describe_error(exc) or "retried"))
            elif status == "dead_letter":
                if reason is None:
                    reason = (outcome.reason if outcome is not None else None) or "dead-lettered by middleware"
                    if exc is not None:
                        reason = f"{reason}: {_describe_error(exc)}"
                span.add_event("dead_letter", {"framework.dead_letter.reason": reason})
                if exc is not None:
                    span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, reason))
        span.end()

    def dropped(self, d: Delivery, status: str, reason: str | None = None) -> None:
        """A short ``process`` span for a message settled before any handler ran: a Redis-inbox
        duplicate (``status="duplicate"``) or a dead letter at admission (undecodable, invalid,
        a crash loop; ``reason`` says which)."""
        if self.tracer is None:
            return
        env = d.envelope
        parent = self._tracing.extract(env.headers) if env is not None else None
        span = self.tracer.start_span(self.span_name, parent, trace.SpanKind.CONSUMER, self.base)
        if span.is_recording():
            self._describe(span, d, d.attempt)
        self._finish(span, "dead_letter" if status == "dead_letter" else "duplicate", None, reason)


def _describe_error(exc: BaseException | None) -> str:
    return "" if exc is None else f"{type(exc).__name__}: {exc}"
