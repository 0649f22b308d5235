"""Observability: OpenTelemetry traces and metrics, a Prometheus endpoint, per-message log context.

Off by default, and then free: publishing and the runtime check one boolean
(:mod:`framework.observability.hooks`), add no headers, and a handler with no middleware keeps
the no-middleware fast path. Turned on

* by the environment, for ``framework run`` and ``framework outbox relay``
  (:func:`configure_from_env`): the standard OpenTelemetry variables (``OTEL_EXPORTER_OTLP_ENDPOINT``,
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``/``_METRICS_ENDPOINT``, ``OTEL_TRACES_EXPORTER``/
  ``OTEL_METRICS_EXPORTER``, ``OTEL_SERVICE_NAME``, ``OTEL_TRACES_SAMPLER``/``_ARG``,
  ``OTEL_METRIC_EXPORT_INTERVAL``; ``OTEL_SDK_DISABLED=true`` turns everything off), and
  ``--metrics-port`` / ``FRAMEWORK_METRICS_PORT`` for a Prometheus endpoint;
* in code, with :func:`enable_tracing` and :func:`enable_metrics` (a provider of your own, or one
  built here exporting with OTLP/HTTP).

An application that installed its own SDK ``TracerProvider``/``MeterProvider`` globally keeps it:
the framework's spans and instruments go there. What is traced and measured:
:mod:`~framework.observability.tracing`, :mod:`~framework.observability.consumer`,
:mod:`~framework.observability.metrics`; log context: :mod:`~framework.observability.logcontext`.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from framework.logs import get_logger
from framework.observability import hooks

__all__ = [
    "configure_from_env",
    "disable_metrics",
    "disable_tracing",
    "enable_metrics",
    "enable_tracing",
    "metrics_enabled",
    "shutdown",
    "tracing_enabled",
]

log = get_logger("framework.observability")

_TRUE = ("1", "true", "yes", "on")


def tracing_enabled() -> bool:
    """Whether the framework traces publishes and handler attempts now."""
    return hooks.TRACING


def metrics_enabled() -> bool:
    """Whether the framework records metrics now."""
    return hooks.METRICS


def _sdk_disabled() -> bool:
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE


def enable_tracing(provider: Any = None, *, endpoint: str | None = None, service_name: str | None = None) -> Any:
    """Trace every publish (PRODUCER spans, W3C context in the headers) and every handler attempt
    (a CONSUMER span, current while the handler runs) of runtimes started from now on.

    ``provider``: an OpenTelemetry ``TracerProvider`` of your own (an in-memory exporter in
    tests, say). Without it the application's global SDK provider is used if it installed one,
    else an SDK provider exporting with OTLP/HTTP to ``endpoint`` (the collector's base URL, like
    ``http://localhost:4318``; default from the ``OTEL_EXPORTER_OTLP_*`` variables), service name
    ``OTEL_SERVICE_NAME`` or ``service_name``, sampler from ``OTEL_TRACES_SAMPLER`` (parent-based
    by default). Returns the provider in use; None (tracing stays off) when ``OTEL_SDK_DISABLED`` is true.
    """
    if _sdk_disabled():
        log.info("tracing stays off: OTEL_SDK_DISABLED is set")
        return None
    from framework.observability import tracing

    disable_tracing()
    owned = False
    if provider is None:
        provider = tracing.global_sdk_provider()
    if provider is None:
        provider, owned = tracing.build_provider(service_name, endpoint), True
    tracing.install(provider, owned=owned)
    hooks.set_flags(tracing=True)
    return provider


def disable_tracing() -> None:
    """Stop tracing (runtimes started from now on run without the observer); a provider the
    framework built is flushed and shut down, one of yours is left alone."""
    hooks.set_flags(tracing=False)
    if "framework.observability.tracing" not in sys.modules:
        return
    from framework.observability import tracing

    owned = tracing.uninstall()
    if owned is not None:
        owned.shutdown()


def enable_metrics(
    provider: Any = None,
    *,
    endpoint: str | None = None,
    prometheus_port: int | None = None,
    prometheus_host: str = "127.0.0.1",
    service_name: str | None = None,
) -> Any:
    """Record the framework's metrics (see :mod:`framework.observability.metrics`) for runtimes
    and relays started from now on.

    ``provider``: a ``MeterProvider`` of your own (with its readers). Without it: with
    ``prometheus_port``, a provider built here serves the Prometheus exposition at
    ``http://prometheus_host:prometheus_port/metrics`` (OSError when the port is taken), exporting
    with OTLP/HTTP too when ``endpoint`` is given; without a port, the application's global SDK
    provider if it installed one, else a provider exporting with OTLP/HTTP to ``endpoint``
    (default from the ``OTEL_EXPORTER_OTLP_*`` variables). Returns the provider in use; None
    (metrics stay off) when ``OTEL_SDK_DISABLED`` is true.
    """
    if _sdk_disabled():
        log.info("metrics stay off: OTEL_SDK_DISABLED is set")
        return None
    if provider is not None and prometheus_port is not None:
        raise ValueError("a MeterProvider of your own needs its own PrometheusMetricReader: pass one or the other")
    return _enable_metrics(provider, endpoint, prometheus_port, prometheus_host, service_name, otlp=None)


def _enable_metrics(
    provider: Any,
    endpoint: str | None,
    port: int | None,
    host: str,
    service_name: str | None,
    *,
    otlp: bool | None,
    exporter: str | None = None,
) -> Any:
    from framework.observability import metrics

    owned = False
    if provider is None and port is None:
        provider = metrics.global_sdk_provider()
    if provider is None:
        wants_otlp = otlp if otlp is not None else (endpoint is not None or port is None)
        provider = metrics.build_provider(
            service_name,
            otlp=wants_otlp,
            endpoint=endpoint,
            prometheus_port=port,
            prometheus_host=host,
            exporter=exporter,
        )
        owned = True
    disable_metrics()
    metrics.install(provider, owned=owned)
    hooks.set_flags(metrics=True)
    return provider


def disable_metrics() -> None:
    """Stop recording metrics; a provider the framework built is flushed and shut down."""
    hooks.set_flags(metrics=False)
    if "framework.observability.metrics" not in sys.modules:
        return
    from framework.observability import metrics

    owned = metrics.uninstall()
    if owned is not None:
        owned.shutdown()


def shutdown(timeout: float = 5.0) -> None:
    """Flush and stop what the framework turned on (the CLI calls it at exit), waiting at most
    ``timeout`` seconds: an unreachable collector must not hold a stopping worker for the
    exporters' retries (spans and metrics not sent by then are dropped, with a warning)."""
    import threading

    done = threading.Event()

    def stop() -> None:
        disable_tracing()
        disable_metrics()
        done.set()

    threading.Thread(target=stop, name="framework-observability-shutdown", daemon=True).start()
    if not done.wait(timeout):
        log.warning(f"spans and metrics not exported within {timeout:g} s of shutdown were dropped")


def _exporter(signal: str) -> str | None:
    """What the environment asks for one signal (``TRACES`` or ``METRICS``): ``otlp``,
    ``console``, or None (off)."""
    chosen = os.environ.get(f"OTEL_{signal}_EXPORTER", "").strip().lower()
    if chosen:
        names = [n.strip() for n in chosen.split(",") if n.strip()]
        if not names or all(n == "none" for n in names):
            return None
        if "otlp" in names:
            return "otlp"
        if "console" in names:
            return "console"
        log.warning(
            f"OTEL_{signal}_EXPORTER={chosen!r}: the framework exports with otlp or console; using otlp",
        )
        return "otlp"
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT"):
        return "otlp"
    return None


def configure_from_env(
    service_name: str | None = None, *, metrics_port: int | None = None, metrics_host: str = "127.0.0.1"
) -> None:
    """Turn tracing and metrics on as the environment says (see the module docstring).

    ``service_name`` names the resource when ``OTEL_SERVICE_NAME`` is unset (the CLI passes the
    first service's name); ``metrics_port`` serves the Prometheus exposition (OSError when the
    port is taken). An application's own global SDK providers are kept. Nothing set: nothing on.
    """
    if _sdk_disabled():
        shutdown()
        if metrics_port is not None:
            log.warning("OTEL_SDK_DISABLED is set: no metrics are served on the metrics port", port=metrics_port)
        return
    # An application's own SDK providers exist only if it imported the SDK: no import cost otherwise.
    app_tracing = app_metrics = None
    if "opentelemetry.sdk.trace" in sys.modules:
        from framework.observability import tracing

        app_tracing = tracing.global_sdk_provider()
    if "opentelemetry.sdk.metrics" in sys.modules:
        from framework.observability import metrics

        app_metrics = metrics.global_sdk_provider()
    traces = _exporter("TRACES")
    if app_tracing is not None:
        enable_tracing(app_tracing)
        log.info("tracing on", provider="the application's")
    elif traces is not None:
        from framework.observability import tracing

        disable_tracing()
        tracing.install(tracing.build_provider(service_name, exporter=traces), owned=True)
        hooks.set_flags(tracing=True)
        log.info("tracing on", exporter=traces)
    wanted = _exporter("METRICS")
    if wanted is not None or metrics_port is not None:
        _enable_metrics(None, None, metrics_port, metrics_host, service_name, otlp=wanted is not None, exporter=wanted)
        log.info(
            "metrics on",
            exporter=wanted,
            prometheus=f"http://{metrics_host}:{metrics_port}/metrics" if metrics_port is not None else None,
        )
    elif app_metrics is not None:
        _enable_metrics(app_metrics, None, None, metrics_host, service_name, otlp=False)
        log.info("metrics on", provider="the application's")
