"""The per-message histograms, kept by the framework: a record is one bisect and a few additions.

The SDK's ``Histogram.record`` hashes the attribute set and aggregates once per reader on every
call (10-20 us a message on a small machine, a third of what the whole message costs without
metrics). The framework's two per-message histograms (``messaging.process.duration`` by outcome,
``framework.message.latency``) are kept here instead, one :class:`LocalHistogram` per handler and
attribute set, written by the event loop without locks, and handed to every reader of the meter
provider when that reader collects (:func:`attach`), as the SDK's own explicit-bucket histogram
points. What a Prometheus scrape or an OTLP export shows is what the SDK would have produced:
same names, units, buckets and attributes, cumulative or delta as each reader asks (delta points
carry the minimum and maximum since the start, which the SDK would give per interval).

A provider whose readers cannot be reached (not the OpenTelemetry SDK's) gets the SDK's
histograms instead (:class:`SdkRecorder`), recorded per message as before.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["BOUNDS", "Family", "LocalHistogram", "SdkRecorder", "attach"]

BOUNDS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
"""Bucket boundaries in seconds: from half a millisecond to a minute."""

_SCOPE = "framework"


class LocalHistogram:
    """Counts of one attribute set in the :data:`BOUNDS` buckets (see the module docstring)."""

    __slots__ = ("attributes", "counts", "high", "low", "total")

    def __init__(self, attributes: Mapping[str, str]) -> None:
        self.attributes = dict(attributes)
        self.counts = [0] * (len(BOUNDS) + 1)
        self.total = 0.0
        self.low = float("inf")
        self.high = float("-inf")

    def record(self, value: float) -> None:
        """Count ``value`` (seconds); bucket i holds values in (BOUNDS[i-1], BOUNDS[i]]."""
        self.counts[bisect_left(BOUNDS, value)] += 1
        self.total += value
        if value < self.low:
            self.low = value
        if value > self.high:
            self.high = value


class SdkRecorder:
    """The SDK's histogram with one attribute set, for providers :func:`attach` could not reach."""

    __slots__ = ("attributes", "histogram")

    def __init__(self, histogram: Any, attributes: Mapping[str, str]) -> None:
        self.histogram = histogram
        self.attributes = dict(attributes)

    def record(self, value: float) -> None:
        """Record ``value`` through the SDK."""
        self.histogram.record(value, self.attributes)


class Family:
    """One histogram metric: its name, unit, description and a recorder per attribute set."""

    def __init__(self, name: str, description: str, unit: str = "s") -> None:
        self.name = name
        self.description = description
        self.unit = unit
        self.members: dict[frozenset[tuple[str, str]], LocalHistogram] = {}
        self.sdk: Any = None  # the SDK histogram when the provider's readers cannot be reached

    def recorder(self, attributes: Mapping[str, str]) -> LocalHistogram | SdkRecorder:
        """What records values with ``attributes`` (made once per handler and outcome, not per message)."""
        if self.sdk is not None:
            return SdkRecorder(self.sdk, attributes)
        key = frozenset(attributes.items())
        found = self.members.get(key)
        if found is None:
            found = self.members[key] = LocalHistogram(attributes)
        return found

    def points(self, start_ns: int, now_ns: int, last: dict[int, tuple[list[int], float]] | None) -> list[Any]:
        """The SDK's data points of every attribute set recorded so far (``last``: the previous
        collection's counts per member, for a delta reader, updated here)."""
        from opentelemetry.sdk.metrics.export import HistogramDataPoint

        out = []
        for member in list(self.members.values()):
            counts, total = list(member.counts), member.total  # a copy: the event loop keeps counting
            if last is not None:
                before_counts, before_total = last.get(id(member), (None, 0.0))
                last[id(member)] = (counts, total)
                if before_counts is not None:
                    counts = [a - b for a, b in zip(counts, before_counts, strict=True)]
                    total -= before_total
            count = sum(counts)
            if not count:
                continue
            out.append(
                HistogramDataPoint(
                    attributes=member.attributes,
                    start_time_unix_nano=start_ns,
                    time_unix_nano=now_ns,
                    count=count,
                    sum=total,
                    bucket_counts=counts,
                    explicit_bounds=BOUNDS,
                    min=member.low,
                    max=member.high,
                )
            )
        return out


class _Collection:
    """Adds the families' points to what one reader collects from the SDK."""

    def __init__(self, reader: Any, original: Any, families: Sequence[Family], resource: Any) -> None:
        from opentelemetry.sdk.metrics._internal.instrument import _Histogram
        from opentelemetry.sdk.metrics.export import AggregationTemporality

        self.original = original
        self.families = families
        self.resource = resource
        temporality = getattr(reader, "_instrument_class_temporality", {}).get(_Histogram)
        self.delta = temporality == AggregationTemporality.DELTA
        self.temporality = AggregationTemporality.DELTA if self.delta else AggregationTemporality.CUMULATIVE
        self.last: dict[str, dict[int, tuple[list[int], float]]] = {f.name: {} for f in families}
        self.started_ns = time.time_ns()
        self.previous_ns = self.started_ns

    def __call__(self, reader: Any, timeout_millis: float = 10_000) -> Any:
        data = self.original(reader, timeout_millis=timeout_millis)
        try:
            return self.merge(data)
        except Exception:  # pragma: no cover - never lose the SDK's own metrics over ours
            return data

    def merge(self, data: Any) -> Any:
        from opentelemetry.sdk.metrics.export import Histogram, Metric, MetricsData, ResourceMetrics, ScopeMetrics
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        now = time.time_ns()
        start = self.previous_ns if self.delta else self.started_ns
        self.previous_ns = now
        metrics = []
        for family in self.families:
            points = family.points(start, now, self.last[family.name] if self.delta else None)
            if points:
                data_ = Histogram(data_points=points, aggregation_temporality=self.temporality)
                metrics.append(Metric(family.name, family.description, family.unit, data_))
        if not metrics:
            return data
        if data is None or not data.resource_metrics:
            scope = ScopeMetrics(InstrumentationScope(_SCOPE), metrics, "")
            return MetricsData([ResourceMetrics(self.resource, [scope], "")])
        first, *rest = data.resource_metrics
        scopes = list(first.scope_metrics)
        for i, sm in enumerate(scopes):
            if sm.scope.name == _SCOPE:
                scopes[i] = ScopeMetrics(sm.scope, [*sm.metrics, *metrics], sm.schema_url)
                break
        else:
            scopes.append(ScopeMetrics(InstrumentationScope(_SCOPE), metrics, ""))
        return MetricsData([ResourceMetrics(first.resource, scopes, first.schema_url), *rest])


def attach(provider: Any, families: Sequence[Family]) -> bool:
    """Make every reader of ``provider`` (an SDK ``MeterProvider``) collect ``families`` too;
    False when its readers cannot be reached (then record through the SDK: :attr:`Family.sdk`)."""
    config = getattr(provider, "_sdk_config", None)
    readers = getattr(provider, "_metric_readers", None)  # SDK >= 1.28; before, on the configuration
    if readers is None:
        readers = getattr(config, "metric_readers", None)
    resource = getattr(config, "resource", None)
    if resource is None or readers is None or not all(getattr(r, "_collect", None) is not None for r in readers):
        return False
    for reader in readers:
        original = reader._collect
        while isinstance(original, _Collection):  # attached before (metrics turned on again): replace
            original = original.original
        reader._collect = _Collection(reader, original, families, resource)
    return True
