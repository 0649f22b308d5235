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

An application that installed its own SDK ``TracerProvider`` keeps it; otherwise an SDK
provider is built with a ``BatchSpanProcessor`` and the OTLP/HTTP exporter, the sampler coming
from ``OTEL_TRACES_SAMPLER``/``OTEL_TRACES_SAMPLER_ARG`` (parent-based by default).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from broker import Envelope
from broker.headers import CORRELATION_ID

__all__ = [
    "build_provider",
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
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    # shut down by framework.observability.shutdown(), bounded; not again at exit (unbounded)
    provider = TracerProvider(resource=resource(service_name), shutdown_on_exit=False)
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


def uninstall() -> Any:
    """Stop using the provider; return the one this module built, if any (the caller shuts it down)."""
    global _tracer, _provider, _owned
    owned, _tracer, _provider, _owned = _owned, None, None, None
    return owned


def global_sdk_provider() -> Any:
    """The application's global SDK ``TracerProvider``, or None when it installed none."""
    provider = trace.get_tracer_provider()
    try:
        from opentelemetry.sdk.trace import TracerProvider
    except ImportError:  # pragma: no cover - the SDK is a dependency
        return None
    return provider if isinstance(provider, TracerProvider) else None


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
    context) and write its context into ``headers``; ``end`` ends it at once (staging)."""
    assert _tracer is not None
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
