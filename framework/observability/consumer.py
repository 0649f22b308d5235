"""The consumer side: a CONSUMER span per attempt, processing histograms, and the messages dropped
before any handler runs (Redis-inbox duplicates, dead letters at admission).

:class:`Observer` is a built-in middleware the runtime puts outermost in a handler's chain only
when tracing or metrics are on (with both off the handler keeps the no-middleware fast path).
Per attempt, with tracing on, it extracts the parent context from the message's headers, starts
``process <destination>`` (kind CONSUMER) with the messaging attributes, makes it the current
span while the rest of the chain and the handler run (a sync handler's worker thread inherits
it), and ends it with the outcome: ``framework.outcome``, a ``retry`` event with the delay, a
``dead_letter`` event with the reason, the exception recorded and the status ERROR for a failed
attempt. With metrics on it records ``messaging.process.duration`` (by outcome) and, on a
first attempt, ``framework.message.latency`` (publish to handler start).
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from broker import Delivery
from broker.headers import CORRELATION_ID
from framework.middleware import CallNext, InboundMessage, Outcome
from framework.observability import hooks

__all__ = ["Observer"]

_STATUSES = ("success", "duplicate", "retry", "dead_letter")


class Observer:
    """Traces and times every attempt of one handler (see the module docstring)."""

    def __init__(self, handler: Any) -> None:
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
        self.instruments: Any = None
        if hooks.TRACING:
            from framework.observability import tracing

            self.tracer = tracing.tracer()
            self._tracing = tracing
        if hooks.METRICS:
            from framework.observability import metrics

            self.instruments = metrics.instruments()
            attributes = metrics.consumer_attributes(destination, handler.service, handler.service, handler.name)
            self.metric_attributes = attributes
            self.by_outcome = {status: {**attributes, "framework.outcome": status} for status in _STATUSES}

    def __repr__(self) -> str:
        return f"<framework observer of {self.handler.label}>"

    # -- the middleware -------------------------------------------------------------------------------

    async def __call__(self, message: InboundMessage, ctx: Any, call_next: CallNext) -> Outcome:
        """Run the attempt inside its CONSUMER span and/or timed (see the module docstring)."""
        instruments = self.instruments
        if instruments is not None:
            started = time.perf_counter()
            if message.attempt == 1:
                latency = time.time() - ctx.envelope.published_at / 1000
                instruments.latency.record(max(latency, 0.0), self.metric_attributes)
        if self.tracer is None:
            outcome = await call_next()
        else:
            outcome = await self._traced(message, ctx, call_next)
        if instruments is not None:
            instruments.duration.record(time.perf_counter() - started, self.by_outcome[outcome.status])
        return outcome

    async def _traced(self, message: InboundMessage, ctx: Any, call_next: CallNext) -> Outcome:
        parent = self._tracing.extract(message.headers)
        span = self.tracer.start_span(self.span_name, parent, trace.SpanKind.CONSUMER, self.base)
        if span.is_recording():
            self._describe(span, ctx._delivery, message.attempt)
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        try:
            outcome = await call_next()
        except BaseException as exc:  # cancelled (shutdown): call_next returns failures as outcomes
            if span.is_recording():
                span.record_exception(exc)
            span.end()
            raise
        finally:
            otel_context.detach(token)
        self._finish(span, outcome)
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
    def _finish(span: Any, outcome: Outcome, reason: str | None = None) -> None:
        """Write the outcome onto ``span`` and end it."""
        if span.is_recording():
            status = outcome.status
            span.set_attribute("framework.outcome", status)
            exc = outcome.exception
            if status == "retry":
                span.add_event("retry", {"framework.retry.delay_s": float(outcome.delay)})
                if exc is not None:
                    span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, _describe_error(exc) or "retried"))
            elif status == "dead_letter":
                if reason is None:
                    reason = outcome.reason or "dead-lettered by middleware"
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
        outcome = Outcome("dead_letter" if status == "dead_letter" else "duplicate", d.attempt)  # type: ignore[arg-type]
        self._finish(span, outcome, reason)


def _describe_error(exc: BaseException | None) -> str:
    return "" if exc is None else f"{type(exc).__name__}: {exc}"
