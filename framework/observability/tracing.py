"""Tracing with OpenTelemetry: the tracer, its provider, and PRODUCER spans with W3C propagation.

Imported only once tracing is turned on (:func:`framework.observability.enable_tracing` or
:func:`framework.observability.configure_from_env`); the hot path checks
``framework.observability.hooks.TRACING`` (one boolean) before calling anything here.

* Publishing: :func:`producer_span` starts a PRODUCER span ``send <destination>`` and writes its
  context (``traceparent``, ``tracestate``, ``baggage``; the names of :mod:`broker.headers`) into a
  message's headers with the globally configured propagator (W3C trace context and baggage by
  default). A batch gets one span per message, each a child of the caller's context, never of
  each other.
* Consuming: see :mod:`framework.observability.consumer` (the CONSUMER span per attempt).
* Sampling decided before the SDK (:func:`consumer_parent`, and :func:`producer_span` for roots):
  a message whose ``traceparent`` says "not sampled" is not given to the SDK at all when the
  sampler respects sampled-out parents (the SDK's parent-based samplers do, by default): its
  context is made current as it came, so the handler's own spans and the messages it sends stay
  unsampled and on the same trace. For a root (no trace context) under a provider built here, the
  root sampler's ratio is applied first with one random draw; a sampled-out root gets fresh ids
  (flags 00) without an SDK span, a sampled-in one is recorded by the SDK (:class:`PreSampled`
  honours the draw). Per unsampled message that costs a few microseconds instead of the SDK's
  ``start_span``; what is sampled is exactly what the configured sampler would have chosen.

An application that installed its own SDK ``TracerProvider`` keeps it; otherwise an SDK
provider is built with a ``BatchSpanProcessor`` and the OTLP/HTTP exporter, the sampler coming
from ``OTEL_TRACES_SAMPLER``/``OTEL_TRACES_SAMPLER_ARG`` (parent-based by default).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import (
    INVALID_SPAN_CONTEXT,
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    Tracer,
)

from broker import Envelope
from broker.headers import BAGGAGE, CORRELATION_ID, TRACEPARENT, TRACESTATE

__all__ = [
    "PreSampled",
    "Unsampled",
    "build_provider",
    "consumer_parent",
    "current_ids",
    "end_spans",
    "extract",
    "global_sdk_provider",
    "inject_current",
    "install",
    "producer_span",
    "producer_spans",
    "resource",
    "tracer",
    "uninstall",
]

SYSTEM = "redis"
_SCOPE = "framework"

_tracer: Tracer | None = None
_provider: Any = None  # the TracerProvider in use
_owned: Any = None  # the provider this module built (flushed and shut down by shutdown())
_names: dict[str, str] = {}  # destination -> "send <destination>" (no f-string per message)

# Sampling decided before the SDK (see the module docstring), set by install() from the provider's sampler.
_PRESAMPLED = otel_context.create_key("framework.presampled")
_SAMPLED_ROOT = otel_context.set_value(_PRESAMPLED, True, otel_context.Context())
_parent_fast = False  # sampled-out parents are skipped without the SDK
_root_ratio: float | None = None  # roots sampled here with this probability (None: the SDK decides)
_UNSAMPLED = TraceFlags(0)
_draw = random.random
_bits = random.getrandbits


def tracer() -> Tracer:
    """The framework's tracer (tracing must be on)."""
    assert _tracer is not None, "tracing is off"
    return _tracer


def build_provider(service_name: str | None, endpoint: str | None = None, exporter: str | None = None) -> Any:
    """An SDK ``TracerProvider`` exporting with OTLP/HTTP (or the console, ``exporter="console"``).

    ``service.name`` is ``OTEL_SERVICE_NAME`` when set, else ``service_name``; the sampler is the
    SDK's choice from ``OTEL_TRACES_SAMPLER``/``_ARG`` (default: parent-based, always on).
    ``endpoint`` is the collector's base URL (``/v1/traces`` is appended) or the full traces URL;
    without it the exporter reads ``OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT``.
    """
    from opentelemetry.sdk.trace import TracerProvider, sampling
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    sampler = PreSampled(sampling._get_from_env_or_default())  # the SDK's own reading of OTEL_TRACES_SAMPLER
    # shut down by framework.observability.shutdown(), bounded; not again at exit (unbounded)
    provider = TracerProvider(resource=resource(service_name), sampler=sampler, shutdown_on_exit=False)
    if exporter == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        return provider
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    url = None
    if endpoint:
        url = endpoint if endpoint.rstrip("/").endswith("/v1/traces") else endpoint.rstrip("/") + "/v1/traces"
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    return provider


def resource(service_name: str | None) -> Any:
    """The SDK resource: ``OTEL_SERVICE_NAME``/``OTEL_RESOURCE_ATTRIBUTES`` win over ``service_name``."""
    from opentelemetry.sdk.resources import Resource

    attributes: dict[str, str] = {}
    if service_name and not os.environ.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = service_name
    return Resource.create(attributes)


def install(provider: Any, *, owned: bool = False) -> None:
    """Use ``provider`` for the framework's spans (and make it the global one if none is set yet,
    so handlers' own spans go to the same place)."""
    global _tracer, _provider, _owned
    if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        trace.set_tracer_provider(provider)
    _provider = provider
    _owned = provider if owned else None
    _tracer = provider.get_tracer(_SCOPE)
    _presample_for(getattr(provider, "sampler", None))


def uninstall() -> Any:
    """Stop using the provider; return the one this module built, if any (the caller shuts it down)."""
    global _tracer, _provider, _owned
    owned, _tracer, _provider, _owned = _owned, None, None, None
    _presample_for(None)
    return owned


def global_sdk_provider() -> Any:
    """The application's global SDK ``TracerProvider``, or None when it installed none."""
    provider = trace.get_tracer_provider()
    try:
        from opentelemetry.sdk.trace import TracerProvider
    except ImportError:  # pragma: no cover - the SDK is a dependency
        return None
    return provider if isinstance(provider, TracerProvider) else None


# -- sampling before the SDK ----------------------------------------------------------------------------


def _make_sampler_class() -> Any:
    from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult

    class PreSampled(Sampler):
        """The configured sampler, except for roots the framework already drew as sampled
        (their parent context carries the framework's mark): those are recorded, so the ratio
        is applied once, before the SDK, not twice."""

        def __init__(self, delegate: Sampler) -> None:
            self.delegate = delegate

        def should_sample(
            self,
            parent_context: otel_context.Context | None,
            trace_id: int,
            name: str,
            kind: SpanKind | None = None,
            attributes: Any = None,
            links: Any = None,
            trace_state: Any = None,
        ) -> SamplingResult:
            if parent_context is not None and parent_context.get(_PRESAMPLED):
                return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes, trace_state)
            return self.delegate.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

        def get_description(self) -> str:
            return self.delegate.get_description()

    return PreSampled


PreSampled: Any = _make_sampler_class()
"""A sampler wrapping the configured one for providers the framework builds (see the module docstring)."""


def _presample_for(sampler: Any) -> None:
    """Decide what can be sampled before the SDK under ``sampler`` (None: nothing)."""
    global _parent_fast, _root_ratio
    from opentelemetry.sdk.trace.sampling import Decision, ParentBased, StaticSampler, TraceIdRatioBased

    def drops(s: Any) -> bool:
        return isinstance(s, StaticSampler) and s._decision is Decision.DROP

    _parent_fast, _root_ratio = False, None
    ours = isinstance(sampler, PreSampled)
    inner = sampler.delegate if ours else sampler
    if not isinstance(inner, ParentBased):
        return  # another sampler may sample under a sampled-out parent: the SDK decides every span
    _parent_fast = drops(getattr(inner, "_remote_parent_not_sampled", None)) and drops(
        getattr(inner, "_local_parent_not_sampled", None)
    )
    if ours and _parent_fast:
        root = getattr(inner, "_root", None)
        if isinstance(root, TraceIdRatioBased) and root.rate < 1.0:
            _root_ratio = root.rate
        elif drops(root):
            _root_ratio = 0.0


def _fresh_unsampled() -> SpanContext:
    """Ids of a root the draw left unsampled (flags 00)."""
    return SpanContext(_bits(128) or 1, _bits(64) or 1, False, _UNSAMPLED)


def _unsampled_root() -> otel_context.Context:
    """A context whose current span is a fresh root the draw left unsampled (no SDK span)."""
    return trace.set_span_in_context(NonRecordingSpan(_fresh_unsampled()), otel_context.Context())


def _parse_unsampled(tp: str) -> SpanContext | None:
    """The span context of a plain version-00 ``traceparent`` whose sampled flag is off, or None."""
    if len(tp) != 55 or tp[53:55] != "00" or not tp.startswith("00-") or tp[35] != "-" or tp[52] != "-":
        return None
    try:
        trace_id, span_id = int(tp[3:35], 16), int(tp[36:52], 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    return SpanContext(trace_id, span_id, True, _UNSAMPLED)


class Unsampled(NonRecordingSpan):
    """The current span while a lane runs a message that is not sampled: one per lane, reused
    from message to message, its context attached per message without building anything. Its
    ids are worked out only when something asks (a log line, a send, a child span): the
    incoming ``traceparent``'s, or fresh ones for a root. Code that keeps the context past the
    end of its message (a task left running) sees a later unsampled message's ids: still not
    sampled, so nothing is recorded either way."""

    def __init__(self) -> None:
        super().__init__(INVALID_SPAN_CONTEXT)
        self._traceparent: str | None = None
        self.context = trace.set_span_in_context(self, otel_context.Context())

    def use(self, traceparent: str | None) -> otel_context.Context:
        """Stand for the message whose sampled-out ``traceparent`` is given (None: a root); the context to attach."""
        self._traceparent = traceparent
        self._context = None  # type: ignore[assignment]
        return self.context

    def get_span_context(self) -> SpanContext:
        found = self._context
        if found is None:
            tp = self._traceparent
            found = (_parse_unsampled(tp) if tp is not None else None) or _fresh_unsampled()
            self._context = found
        return found


def _sampled_out(headers: Mapping[str, str], tp: str) -> bool:
    """Whether ``tp`` (a message's ``traceparent``) is a plain version-00 one with the sampled flag off."""
    return len(tp) == 55 and tp[53:55] == "00" and tp[:3] == "00-" and TRACESTATE not in headers


def consumer_parent(headers: Mapping[str, str], lane: Unsampled | None = None) -> tuple[otel_context.Context, bool]:
    """The parent context of a CONSUMER span for a message with ``headers``, and whether to start
    the span in the SDK (True) or only make the context current (False: not sampled). ``lane``:
    the running lane's reusable span for unsampled messages (else one is made per message)."""
    if _parent_fast and BAGGAGE not in headers:
        tp = headers.get(TRACEPARENT)
        if tp is not None:
            if _sampled_out(headers, tp):  # ids parsed only if asked for
                return (lane or Unsampled()).use(tp), False
        elif _root_ratio is not None:
            if _draw() < _root_ratio:
                return _SAMPLED_ROOT, True
            return (lane or Unsampled()).use(None), False
    return propagate.extract(headers), True


# -- producing ----------------------------------------------------------------------------------------


def _span_name(destination: str) -> str:
    name = _names.get(destination)
    if name is None:
        if len(_names) > 10_000:  # destinations are few; a flood of names must not grow forever
            _names.clear()
        name = _names[destination] = f"send {destination}"
    return name


_PRODUCER_BASE = {"messaging.system": SYSTEM, "messaging.operation.type": "send", "messaging.operation.name": "send"}


def producer_span(
    headers: MutableMapping[str, str], destination: str, message_id: str, parent: Any = None, *, end: bool = False
) -> Span:
    """Start a PRODUCER span ``send <destination>`` (child of ``parent``, else of the current
    context) and write its context into ``headers``; ``end`` ends it at once (staging).

    Under a parent that is not sampled, or for a root the ratio leaves out (see the module
    docstring), no SDK span is started: the headers get that unsampled context."""
    assert _tracer is not None
    if _parent_fast:
        current = trace.get_current_span(parent)
        sc = current.get_span_context()
        if sc.is_valid:
            if not sc.trace_flags.sampled:
                propagate.inject(headers, parent)
                return current
        elif _root_ratio is not None:
            if _draw() >= _root_ratio:
                propagate.inject(headers, _unsampled_root())
                return trace.INVALID_SPAN
            parent = _SAMPLED_ROOT
    span = _tracer.start_span(_span_name(destination), parent, SpanKind.PRODUCER, _PRODUCER_BASE)
    if span.is_recording():
        span.set_attributes(
            {
                "messaging.destination.name": destination,
                "messaging.message.id": message_id,
                "messaging.message.conversation_id": headers.get(CORRELATION_ID) or message_id,
            }
        )
    propagate.inject(headers, trace.set_span_in_context(span, parent))
    if end:
        span.end()
    return span


def producer_spans(envelopes: Iterable[Envelope], *, from_headers: bool = False) -> list[Span]:
    """One PRODUCER span per envelope (a batch is siblings, not nested), context written into
    each one's headers. ``from_headers``: each span's parent is the context its headers carry
    (the outbox relay: the code that wrote the row), else the caller's current context."""
    if from_headers:
        return [producer_span(env.headers, env.destination, env.id, extract(env.headers)) for env in envelopes]
    return [producer_span(env.headers, env.destination, env.id) for env in envelopes]


def end_spans(spans: Iterable[Span], error: BaseException | None = None) -> None:
    """End ``spans``; with ``error``, record it on each and mark them failed."""
    for span in spans:
        if error is not None and span.is_recording():
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        span.end()


def inject_current(headers: MutableMapping[str, str]) -> None:
    """Write the caller's current trace context into ``headers`` (nothing when there is none)."""
    propagate.inject(headers)


def extract(headers: Mapping[str, str]) -> otel_context.Context:
    """The context a message's headers carry (an empty one when they carry none)."""
    return propagate.extract(headers)


def current_ids() -> tuple[str, str] | None:
    """(trace id, span id) of the current span as 32 and 16 hex digits, or None outside any span."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")
