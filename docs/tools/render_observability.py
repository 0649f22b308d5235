"""Draw docs/img/trace.svg and docs/img/dashboard.svg from a real run of a small shop.

No Jaeger or Grafana runs where the docs are built, so the pictures in docs/observability.md are
drawn by this script from real data instead of screenshots: it starts an embedded Valkey, an outbox
in a temporary SQLite file, and two services in this process (``billing`` and ``notification``),
turns the framework's tracing on with the OpenTelemetry SDK's in-memory span exporter and its
metrics on with an in-memory metric reader, and then

1. places orders through the outbox at a varying rate for about twelve seconds (a few per cent
   time out once, fewer are declined), reads the metrics every half second, and draws
   ``dashboard.svg``: processed per second per handler, failures, retries and dead letters per
   second, and the p50/p95/p99 of the handler duration and of the end-to-end latency, computed
   from the histogram buckets as Prometheus' ``histogram_quantile`` does;
2. then places two more orders, each inside a ``POST /orders`` span: one whose first payment
   attempt times out (retried, then captured, then notified) and one whose card is declined
   (dead-lettered); the spans of both traces become the waterfall in ``trace.svg``.

Everything runs in one process, so every span has the same resource; the service column of the
waterfall is the span's ``framework.service`` attribute (handler spans inherit their parent's),
``shop-api`` for the request and ``outbox-relay`` for the relay's publish. In a deployment each
process has its own ``service.name``.

Run: ``.venv/bin/python docs/tools/render_observability.py`` (about 20 seconds).
Needs only the standard library, the framework (with its ``sql`` extra) and the OpenTelemetry SDK.
"""

from __future__ import annotations

import argparse
import html
import math
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from framework import Context, RetryPolicy, Service, Topic, enable_metrics, enable_tracing, outbox  # noqa: E402
from framework.logconfig import configure_logging  # noqa: E402
from framework.runtime import Runtime  # noqa: E402
from framework.settings import RuntimeSettings  # noqa: E402
from framework.testing import embedded_server, unique_namespace  # noqa: E402

# -- the shop ---------------------------------------------------------------------------------------------

ORDERS_PLACED = Topic("orders.placed", partitions=2)
PAYMENTS_CAPTURED = Topic("payments.captured")
shop = trace.get_tracer("shop")


class PaymentDeclined(Exception):
    """The card was refused: retrying cannot help."""


billing = Service("billing", retry=RetryPolicy(max_attempts=3, immediate=0, backoff=0.05, fatal=(PaymentDeclined,)))
notification = Service("notification")


@billing.event(ORDERS_PLACED)
async def charge(order: dict, ctx: Context) -> None:
    """Charge the card (a child span); the payment gateway times out now and then."""
    with shop.start_as_current_span("charge card", attributes={"order.id": order["order_id"]}):
        await anyio.sleep(order["gateway_ms"] / 1000)
        if order["times_out"] and ctx.attempt == 1:
            raise TimeoutError("payment gateway did not answer within 2 s")
        if order["card"].endswith("0002"):
            raise PaymentDeclined(f"card ending {order['card'][-4:]} declined")
    ctx.publish(PAYMENTS_CAPTURED, {"order_id": order["order_id"], "amount_cents": order["total_cents"]})


@notification.event(PAYMENTS_CAPTURED)
async def send_receipt(payment: dict, ctx: Context) -> None:
    """Mail the receipt (a child span)."""
    with shop.start_as_current_span("send receipt email", attributes={"order.id": payment["order_id"]}):
        await anyio.sleep(0.002)


async def place_order(engine: Any, order: dict) -> None:
    """What the shop's web endpoint does: the order and its event commit together (outbox)."""
    attributes = {"http.request.method": "POST", "http.route": "/orders", "order.id": order["order_id"]}
    with shop.start_as_current_span("POST /orders", kind=SpanKind.SERVER, attributes=attributes):
        async with engine.begin() as conn:
            await outbox.add_event(conn, ORDERS_PLACED, order, key=order["order_id"])


def _order(order_id: str, *, times_out: bool = False, declined: bool = False, gateway_ms: float = 4.0) -> dict:
    card = "4000000000000002" if declined else "4242424242424242"
    return {
        "order_id": order_id,
        "total_cents": 1299,
        "card": card,
        "times_out": times_out,
        "gateway_ms": gateway_ms,
    }


# -- the run ----------------------------------------------------------------------------------------------


class Run:
    """What the run recorded: finished spans and metric snapshots."""

    def __init__(self) -> None:
        self.spans = InMemorySpanExporter()
        self.metrics = InMemoryMetricReader()
        self.samples: list[tuple[float, dict[tuple[str, tuple], Any]]] = []


def _snapshot(reader: InMemoryMetricReader) -> dict[tuple[str, tuple], Any]:
    """(instrument, attributes) -> a counter's value or a histogram point, cumulative."""
    found: dict[tuple[str, tuple], Any] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for point in metric.data.data_points:
                    key = (metric.name, tuple(sorted(point.attributes.items())))
                    found[key] = point if hasattr(point, "bucket_counts") else point.value
    return found


def _spans_of(run: Run, order_id: str) -> list[ReadableSpan]:
    spans = run.spans.get_finished_spans()
    roots = [s for s in spans if s.name == "POST /orders" and s.attributes.get("order.id") == order_id]
    if not roots:
        return []
    trace_id = roots[0].context.trace_id
    return [s for s in spans if s.context.trace_id == trace_id]


async def _wait(predicate: Any, timeout: float, what: str) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.05)


async def record(url: str, database: str, seconds: float) -> Run:
    """Run the shop, place the two traced orders, then the load; return what was recorded."""
    run = Run()
    provider = TracerProvider(resource=Resource.create({"service.name": "shop"}))
    provider.add_span_processor(SimpleSpanProcessor(run.spans))
    trace.set_tracer_provider(provider)
    enable_tracing(provider)
    enable_metrics(MeterProvider(metric_readers=[run.metrics], resource=Resource.create({"service.name": "shop"})))

    engine = outbox.create_engine(database)
    await outbox.create_tables(engine)
    runtime = Runtime(
        [billing, notification],
        url=url,
        namespace=unique_namespace("docs"),
        settings=RuntimeSettings(concurrency=64),
        outbox_database_url=database,
    )
    async with anyio.create_task_group() as tg:
        await tg.start(runtime.run)
        # 1. the load: a rate that rises and falls, a few time-outs, fewer declines
        rng = random.Random(11)
        started = time.monotonic()
        n = 0
        next_sample = started
        while (now := time.monotonic()) - started < seconds + 3:
            if now >= next_sample:
                run.samples.append((now - started, _snapshot(run.metrics)))
                next_sample += 0.5
            elapsed = now - started
            if elapsed < seconds:
                rate = 40 + 160 * math.sin(math.pi * elapsed / seconds) ** 2  # orders per second
                for _ in range(max(1, round(rate / 20))):
                    n += 1
                    order = _order(
                        f"o-{2000 + n}",
                        times_out=rng.random() < 0.06,
                        declined=rng.random() < 0.02,
                        gateway_ms=rng.lognormvariate(math.log(4), 0.5),
                    )
                    await place_order(engine, order)
            await anyio.sleep(0.05)
        # 2. two orders on a quiet, warmed-up shop: one trace each
        await place_order(engine, _order("o-1001", times_out=True))
        await place_order(engine, _order("o-1002", declined=True))

        def traced() -> bool:
            names = [s.name for s in _spans_of(run, "o-1001")]
            dead = [s for s in _spans_of(run, "o-1002") if s.attributes.get("framework.outcome") == "dead_letter"]
            return "send receipt email" in names and bool(dead)

        await _wait(traced, 30, "the two traced orders")
        runtime.stop()
    await engine.dispose()
    provider.shutdown()
    return run


# -- drawing: common ---------------------------------------------------------------------------------------

FONT = "font-family='DejaVu Sans, Helvetica, Arial, sans-serif'"
PALETTE = ["#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf", "#e377c2", "#7f7f7f"]


def _text(x: float, y: float, s: str, size: int = 12, **attrs: Any) -> str:
    extra = " ".join(f"{k.replace('_', '-')}='{v}'" for k, v in attrs.items())
    return f"<text x='{x:.1f}' y='{y:.1f}' font-size='{size}' {extra}>{html.escape(s)}</text>"


def _svg(width: int, height: int, body: Sequence[str]) -> str:
    return (
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
        f"viewBox='0 0 {width} {height}' {FONT}>\n"
        f"<rect width='{width}' height='{height}' fill='#ffffff'/>\n" + "\n".join(body) + "\n</svg>\n"
    )


# -- drawing: the trace waterfall --------------------------------------------------------------------------

KINDS = {
    SpanKind.SERVER: "server",
    SpanKind.PRODUCER: "producer",
    SpanKind.CONSUMER: "consumer",
    SpanKind.INTERNAL: "internal",
    SpanKind.CLIENT: "client",
}


def _tree(spans: Sequence[ReadableSpan]) -> list[tuple[ReadableSpan, int, str]]:
    """(span, depth, service) in depth-first order, children by start time."""
    by_id = {s.context.span_id: s for s in spans}
    children: dict[int | None, list[ReadableSpan]] = {}
    for s in spans:
        parent = s.parent.span_id if s.parent is not None and s.parent.span_id in by_id else None
        children.setdefault(parent, []).append(s)
    out: list[tuple[ReadableSpan, int, str]] = []

    def walk(parent: int | None, depth: int, parent_service: str) -> None:
        for s in sorted(children.get(parent, []), key=lambda s: s.start_time or 0):
            service = str(s.attributes.get("framework.service") or "")
            if not service:
                if s.kind == SpanKind.SERVER:
                    service = "shop-api"
                elif s.kind == SpanKind.PRODUCER and parent_service == "shop-api":
                    service = "outbox-relay"  # the relay publishes what the request wrote to the outbox
                else:
                    service = parent_service
            out.append((s, depth, service))
            walk(s.context.span_id, depth + 1, service)

    walk(None, 0, "")
    return out


def _waterfall(spans: Sequence[ReadableSpan], title: str, y0: float, colors: dict[str, str]) -> tuple[list[str], float]:
    rows = _tree(spans)
    start = min(s.start_time or 0 for s in spans)
    end = max(s.end_time or 0 for s in spans)
    total_ms = max((end - start) / 1e6, 0.001)
    left, name_w, bar_x, bar_w, row_h = 16, 400, 560, 560, 24
    n_rows = len(rows) + sum(1 for s, _, _ in rows for e in s.events if e.name in ("retry", "dead_letter"))
    out = [_text(left, y0 + 16, title, 15, font_weight="bold")]
    y = y0 + 30
    out.append(_text(left, y + 12, "span  [framework.outcome]", 11, fill="#666"))
    out.append(_text(left + name_w, y + 12, "service · kind", 11, fill="#666"))
    for i in range(6):  # the time axis
        x = bar_x + bar_w * i / 5
        out.append(f"<line x1='{x:.1f}' y1='{y + 16}' x2='{x:.1f}' y2='{y + 20 + row_h * n_rows}' stroke='#e6e6e6'/>")
        out.append(_text(x, y + 12, f"{total_ms * i / 5:.0f} ms", 10, fill="#666", text_anchor="middle"))
    y += 20
    for s, depth, service in rows:
        color = colors.setdefault(service, PALETTE[len(colors) % len(PALETTE)])
        failed = s.status.status_code == StatusCode.ERROR
        x0 = bar_x + bar_w * ((s.start_time or 0) - start) / 1e6 / total_ms
        width = max(bar_w * ((s.end_time or 0) - (s.start_time or 0)) / 1e6 / total_ms, 1.5)
        outcome = s.attributes.get("framework.outcome")
        attempt = s.attributes.get("framework.attempt")
        label = s.name + (f"  [{outcome}]" if outcome else "") + (f"  attempt {attempt}" if attempt else "")
        out.append(f"<rect x='{left - 4}' y='{y}' width='{bar_x + bar_w + 60}' height='{row_h - 2}' fill='#f7f7f7'/>")
        out.append(_text(left + 14 * depth, y + 15, label, 12, fill="#b00020" if failed else "#111"))
        out.append(_text(left + name_w, y + 15, f"{service} · {KINDS.get(s.kind, '')}", 11, fill="#444"))
        stroke = " stroke='#b00020' stroke-width='2'" if failed else ""
        out.append(
            f"<rect x='{x0:.1f}' y='{y + 5}' width='{width:.1f}' height='{row_h - 12}' rx='2' "
            f"fill='{color}' fill-opacity='0.85'{stroke}/>"
        )
        duration = ((s.end_time or 0) - (s.start_time or 0)) / 1e6
        text_x, anchor = x0 + width + 4, "start"
        if text_x > bar_x + bar_w - 40:
            text_x, anchor = x0 - 4, "end"
        out.append(_text(text_x, y + 15, f"{duration:.1f} ms", 10, fill="#333", text_anchor=anchor))
        y += row_h
        for event in s.events:  # retry and dead letter: a row of their own, as Jaeger lists span events
            if event.name not in ("retry", "dead_letter"):
                continue
            ex = bar_x + bar_w * (event.timestamp - start) / 1e6 / total_ms
            mark = "#e06000" if event.name == "retry" else "#b00020"
            cy = y + row_h / 2 - 2
            out.append(f"<path d='M{ex:.1f},{cy - 6} l6,6 l-6,6 l-6,-6 z' fill='{mark}'/>")
            if event.name == "retry":
                detail = (
                    f"event retry: framework.retry.delay_s={event.attributes.get('framework.retry.delay_s', 0):.3f}"
                )
            else:
                detail = f"event dead_letter: {event.attributes.get('framework.dead_letter.reason', '')}"
            out.append(_text(left + 14 * (depth + 1), y + 14, detail, 11, fill=mark, font_style="italic"))
            y += row_h
    return out, y


def trace_svg(traces: Sequence[tuple[str, Sequence[ReadableSpan]]]) -> str:
    """The waterfalls of ``traces`` ((title, spans) each), one under the other."""
    colors: dict[str, str] = {}
    body: list[str] = []
    y = 8.0
    for title, spans in traces:
        part, y = _waterfall(spans, title, y, colors)
        body += part
        y += 18
    legend_x = 16.0
    for service, color in colors.items():
        body.append(f"<rect x='{legend_x}' y='{y}' width='12' height='12' fill='{color}'/>")
        body.append(_text(legend_x + 16, y + 10, service, 11))
        legend_x += 26 + 7 * len(service)
    body.append(_text(legend_x + 10, y + 10, "◆ a retry or dead_letter event, at its time", 11))
    body.append(_text(legend_x + 290, y + 10, "red: span status ERROR", 11, fill="#b00020"))
    return _svg(1200, int(y + 30), body)


# -- drawing: the dashboard --------------------------------------------------------------------------------


def _series(run: Run, name: str, handler: str | None = None, **match: str) -> list[float]:
    """Cumulative totals of one instrument per sample (summed over matching attribute sets)."""
    values = []
    for _, snap in run.samples:
        total = 0.0
        for (metric, attrs), value in snap.items():
            a = dict(attrs)
            if metric != name or (handler is not None and a.get("framework.handler") != handler):
                continue
            if any(a.get(k) != v for k, v in match.items()):
                continue
            total += value.count if hasattr(value, "count") else value
        values.append(total)
    return values


def _rate(cumulative: Sequence[float], times: Sequence[float], window: int = 2) -> list[float]:
    """Per-second increase over ``window`` samples, as PromQL's rate()."""
    out = []
    for i in range(len(cumulative)):
        j = max(0, i - window)
        dt = times[i] - times[j]
        out.append((cumulative[i] - cumulative[j]) / dt if dt > 0 else 0.0)
    return out


def _quantiles(run: Run, name: str, qs: Sequence[float], handler: str | None = None, window: int = 2) -> list[list]:
    """histogram_quantile(q, rate(bucket[window])) per sample, in milliseconds (None: no data)."""
    merged: list[tuple[Sequence[float], list[int]] | None] = []
    for _, snap in run.samples:
        bounds: Sequence[float] = ()
        counts: list[int] = []
        for (metric, attrs), point in snap.items():
            if metric != name or (handler is not None and dict(attrs).get("framework.handler") != handler):
                continue
            bounds = point.explicit_bounds
            counts = (
                [a + b for a, b in zip(counts, point.bucket_counts, strict=True)]
                if counts
                else list(point.bucket_counts)
            )
        merged.append((bounds, counts) if counts else None)
    result: list[list] = [[] for _ in qs]
    for i, now in enumerate(merged):
        before = merged[max(0, i - window)]
        for k, q in enumerate(qs):
            if now is None:
                result[k].append(None)
                continue
            bounds, counts = now
            delta = [c - (before[1][n] if before else 0) for n, c in enumerate(counts)]
            result[k].append(_histogram_quantile(q, bounds, delta))
    return result


def _histogram_quantile(q: float, bounds: Sequence[float], counts: Sequence[int]) -> float | None:
    total = sum(counts)
    if total <= 0:
        return None
    rank = q * total
    seen = 0.0
    for i, c in enumerate(counts):
        if seen + c >= rank and c > 0:
            if i >= len(bounds):  # the +Inf bucket: the highest finite bound, as Prometheus does
                return bounds[-1] * 1000
            lower = bounds[i - 1] if i > 0 else 0.0
            return (lower + (bounds[i] - lower) * (rank - seen) / c) * 1000
        seen += c
    return bounds[-1] * 1000


def _panel(
    x: float,
    y: float,
    w: float,
    h: float,
    title: str,
    times: Sequence[float],
    lines: Sequence[tuple[str, Sequence[float | None]]],
    unit: str,
) -> list[str]:
    out = [
        f"<rect x='{x}' y='{y}' width='{w}' height='{h}' fill='#181b1f' rx='4'/>",
        _text(x + 12, y + 22, title, 13, fill="#e0e0e0", font_weight="bold"),
    ]
    px, py, pw, ph = x + 60, y + 36, w - 76, h - 84
    values = [v for _, series in lines for v in series if v is not None]
    top = max(values) if values else 1.0
    top = _nice(top * 1.1 or 1.0)
    t_end = max(times) if times else 1.0
    for i in range(6):
        gy = py + ph - ph * i / 5
        out.append(f"<line x1='{px}' y1='{gy:.1f}' x2='{px + pw}' y2='{gy:.1f}' stroke='#2c3036'/>")
        out.append(_text(px - 6, gy + 4, _fmt(top * i / 5, unit), 10, fill="#9aa0a6", text_anchor="end"))
    for i in range(0, int(t_end) + 1, 3):
        gx = px + pw * i / t_end
        out.append(_text(gx, py + ph + 16, f"{i}s", 10, fill="#9aa0a6", text_anchor="middle"))
    for n, (label, series) in enumerate(lines):
        color = PALETTE[n % len(PALETTE)]
        path, pen = [], "M"
        for t, v in zip(times, series, strict=True):
            if v is None:
                pen = "M"
                continue
            path.append(f"{pen}{px + pw * t / t_end:.1f},{py + ph - ph * v / top:.1f}")
            pen = "L"
        if path:
            out.append(f"<path d='{' '.join(path)}' fill='none' stroke='{color}' stroke-width='1.6'/>")
        lx = x + 14 + (n % 3) * (w - 28) / 3
        ly = y + h - 12 + (n // 3) * 14
        shown = [v for v in series if v is not None]
        last = f" (max {_fmt(max(shown), unit)})" if shown else ""
        out.append(f"<rect x='{lx}' y='{ly - 8}' width='10' height='3' fill='{color}'/>")
        out.append(_text(lx + 14, ly - 4, label + last, 10, fill="#c8c8c8"))
    return out


def _nice(v: float) -> float:
    exponent = math.floor(math.log10(v))
    for step in (1, 2, 5, 10):
        if step * 10**exponent >= v:
            return step * 10**exponent
    return 10 ** (exponent + 1)


def _fmt(v: float, unit: str) -> str:
    if unit == "ms":
        return f"{v:.0f} ms" if v >= 10 else f"{v:.1f} ms"
    return f"{v:.0f}" if v >= 10 or v == 0 else f"{v:.1f}"


def dashboard_svg(run: Run) -> str:
    """Four panels of the provisioned dashboard, drawn from the run's metric snapshots."""
    times = [t for t, _ in run.samples]
    charge, receipt = "charge", "send_receipt"
    processed = [
        (f"{svc}.{h}", _rate(_series(run, "framework.messages.processed", h), times))
        for svc, h in (("billing", charge), ("notification", receipt))
    ]
    failures = [
        ("failed attempts", _rate(_series(run, "framework.messages.failed", charge), times)),
        ("retries", _rate(_series(run, "framework.messages.retried", charge), times)),
        ("dead letters", _rate(_series(run, "framework.messages.dead_lettered", charge), times)),
    ]
    qs = (0.5, 0.95, 0.99)
    duration = _quantiles(run, "messaging.process.duration", qs, charge)
    latency = _quantiles(run, "framework.message.latency", qs)
    labels = ("p50", "p95", "p99")
    w, h, gap = 560, 270, 14
    body = [
        _text(gap, 24, "Framework: services and handlers (drawn from a real run, not a Grafana screenshot)", 15),
    ]
    body += _panel(gap, 40, w, h, "Processed /s", times, processed, "/s")
    body += _panel(
        2 * gap + w, 40, w, h, "Failed attempts, retries, dead letters /s (billing.charge)", times, failures, "/s"
    )
    body += _panel(gap, 40 + h + gap, w, h, "Handler duration p50 / p95 / p99 (billing.charge)", times,
                   list(zip(labels, duration, strict=True)), "ms")  # fmt: skip
    body += _panel(2 * gap + w, 40 + h + gap, w, h, "End-to-end latency p50 / p95 / p99 (publish to handler start)",
                   times, list(zip(labels, latency, strict=True)), "ms")  # fmt: skip
    return _svg(3 * gap + 2 * w, 40 + 2 * h + 2 * gap, body)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="where the SVG files go")
    parser.add_argument("--seconds", type=float, default=12.0, help="how long the load runs")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    # Failed attempts are logged with their traceback; pretty console rendering would stall the event
    # loop for a moment and show up in the measured latencies. JSON, errors only.
    configure_logging(level="error", fmt="json")
    with tempfile.TemporaryDirectory() as tmp, embedded_server() as url:
        run = anyio.run(record, url, f"sqlite:///{tmp}/outbox.db", args.seconds)
    traces = [
        ("Order o-1001: the first payment attempt times out, the retry succeeds", _spans_of(run, "o-1001")),
        ("Order o-1002: the card is declined, the event is dead-lettered", _spans_of(run, "o-1002")),
    ]
    (args.out / "trace.svg").write_text(trace_svg(traces))
    (args.out / "dashboard.svg").write_text(dashboard_svg(run))
    print(f"wrote {args.out / 'trace.svg'} and {args.out / 'dashboard.svg'} ({len(run.samples)} metric samples)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
