"""The switches the hot path reads, and the calls it makes when one is on.

Every publish path and the runtime check one module-level boolean here (``hooks.TRACING``,
``hooks.METRICS`` or ``hooks.ANY``) and call into this module only when it is true, so with
both off observability costs one attribute read per message and adds no headers. This module
imports nothing of OpenTelemetry itself: :mod:`~framework.observability.tracing` and
:mod:`~framework.observability.metrics` are imported when turned on.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

from broker import Envelope

__all__ = [
    "ANY",
    "METRICS",
    "TRACING",
    "count_sent",
    "observer",
    "publish",
    "relay_publish",
    "staged",
    "stamp_outbox",
    "track_relay",
    "track_runtime",
]

TRACING = False
"""Tracing is on: publishes start PRODUCER spans, attempts run in CONSUMER spans."""
METRICS = False
"""Metrics are on: the runtime records histograms and refreshes lag, pending and dead letters."""
ANY = False
"""TRACING or METRICS."""


def set_flags(*, tracing: bool | None = None, metrics: bool | None = None) -> None:
    """Turn the switches (called by :mod:`framework.observability` once providers are in place)."""
    global TRACING, METRICS, ANY
    if tracing is not None:
        TRACING = tracing
    if metrics is not None:
        METRICS = metrics
    ANY = TRACING or METRICS


def observer(handler: Any) -> Any:
    """The built-in middleware observing ``handler``'s attempts, or None when both switches are off."""
    if not ANY:
        return None
    from framework.observability.consumer import Observer

    return Observer(handler, tracing_on=TRACING, metrics_on=METRICS)


async def publish(
    broker: Any, envelopes: list[Envelope], dedup_window_ms: int | None = None, *, from_headers: bool = False
) -> list[str | None]:
    """``broker.publish`` with a PRODUCER span per message and the sent counter (messages stored).

    The spans are children of the caller's current context, or, with ``from_headers``, of the
    context each message already carries (the outbox relay: the code that wrote the row), which
    they replace in the headers."""
    spans: list[Any] = []
    if TRACING:
        from framework.observability import tracing

        spans = tracing.producer_spans(envelopes, from_headers=from_headers)
    try:
        entries: list[str | None] = await broker.publish(envelopes, dedup_window_ms=dedup_window_ms)
    except BaseException as exc:
        if spans:
            tracing.end_spans(spans, exc)
        raise
    if spans:
        tracing.end_spans(spans)
    if METRICS:
        count_sent([env for env, entry in zip(envelopes, entries, strict=False) if entry is not None])
    return entries


async def relay_publish(broker: Any, envelopes: list[Envelope]) -> list[str | None]:
    """The outbox relay's publish: :func:`publish` with each message's span a child of its row's context."""
    return await publish(broker, envelopes, from_headers=True)


def staged(headers: MutableMapping[str, str], destination: Any, message_id: str) -> None:
    """A message staged by a handler (``ctx.send``/``ctx.publish``): a PRODUCER span, child of the
    attempt's CONSUMER span, ended at once; its context goes into ``headers``."""
    from framework.observability import tracing

    tracing.producer_span(headers, getattr(destination, "name", destination), message_id, end=True)


def stamp_outbox(envelopes: Sequence[Envelope]) -> None:
    """Messages written to the outbox: the writer's current trace context goes into the headers of
    those that carry none yet, so the relay's publish continues the writer's trace."""
    from broker.headers import TRACEPARENT
    from framework.observability import tracing

    for env in envelopes:
        if TRACEPARENT not in env.headers:
            tracing.inject_current(env.headers)


def count_sent(envelopes: Sequence[Envelope]) -> None:
    """Count published messages (metrics on)."""
    if envelopes:
        from framework.observability import metrics

        metrics.count_sent(envelopes)


def track_runtime(runtime: Any) -> Any:
    """Register a started runtime's consumers with the metrics; return the coroutine function
    that refreshes its lag, pending and dead letters (run it in the runtime's task group)."""
    from framework.observability import metrics

    metrics.track_runtime(runtime)
    return metrics.watch_runtime


def track_relay() -> Any:
    """The coroutine function that refreshes a relay's backlog (run it beside the relay)."""
    from framework.observability import metrics

    return metrics.watch_relay
