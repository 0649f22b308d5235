"""The cost of observability (issue #11): one worker's drain and latency with tracing off and on.

Every mode runs the same trial as the ``commands`` benchmark (``n`` commands sent with
``Client.send_many``, drained by ONE ``python -m framework run`` worker, inbox on) and the same
trial as the ``latency`` benchmark; only the worker's environment and command line differ:

=============== ===============================================================================
mode            the worker
=============== ===============================================================================
``off``         no ``OTEL_*`` variable at all: what every deployment runs by default
``trace-all``   OTLP/HTTP traces, ``OTEL_TRACES_SAMPLER=parentbased_traceidratio``, arg 1.0
``trace-1pct``  the same sampler with arg 0.01; the messages carry no trace context, so every
                CONSUMER span is a root and the 1% ratio decides
``metrics``     OTLP/HTTP metrics every ``OTEL_METRIC_EXPORT_INTERVAL=1000`` ms plus a Prometheus
                endpoint (``--metrics-port``), traces off
``baseline``    only when ``BENCH_BASELINE_PYTHONPATH`` names a checkout of the code before the
                observability change: its ``framework`` (and ``broker``) run the worker, no
                ``OTEL_*`` set; ``off`` against it is what "tracing off costs nothing" means
=============== ===============================================================================

Exports go to a real sink: an HTTP server in the benchmark process (127.0.0.1, a free port per
trial) that answers 200 to ``POST /v1/traces`` and ``/v1/metrics`` and keeps the bodies; after
the trial they are decoded (outside the timed span) to count the spans and metric points that
were really exported. The metrics mode also scrapes the Prometheus endpoint once, after every
message is acknowledged and before the worker stops. The sink shares the machine with the worker
(a collector usually does not): receiving the exports is in the measured cost. Each drain
also reports the worker's CPU time per message (:class:`CpuWatch`), all its threads.

Modes run interleaved in every round, their order rotated by round so drift favours none;
ratios are paired by round (``python -m benchmarks`` computes them with :func:`summary`).
"""

from __future__ import annotations

import contextlib
import os
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks import framework_bench
from benchmarks.cpu_watch import CpuWatch
from benchmarks.otlp_sink import Sink, free_port, scrape
from benchmarks.streams import Progress

__all__ = [
    "BASELINE_ENV",
    "METRICS_TARGET",
    "MODES",
    "OFF_TARGET",
    "TRACE_1PCT_TARGET",
    "CpuWatch",
    "Sink",
    "drain_trial",
    "latency_trial",
    "modes",
    "round_order",
    "rows",
    "summary",
]

MODES = ("off", "trace-all", "trace-1pct", "metrics")
BASELINE_ENV = "BENCH_BASELINE_PYTHONPATH"
TRACE_1PCT_TARGET = 0.90  # msg/s with 1% sampling over msg/s with tracing off, paired by round
METRICS_TARGET = 0.95  # metrics on over off
OFF_TARGET = 0.97  # off over the pre-observability baseline: "within noise"
METRIC_INTERVAL_MS = 1000

_LABELS = {
    "off": "off (no OTEL_* set)",
    "baseline": "code before observability",
    "trace-all": "tracing on, 100% sampled",
    "trace-1pct": "tracing on, 1% sampled (parent-based ratio)",
    "metrics": f"metrics on: OTLP every {METRIC_INTERVAL_MS / 1000:g} s + Prometheus endpoint",
}

# The baseline worker: the checkout goes first on sys.path (``python -m`` would put the cwd, this
# repository, before any PYTHONPATH entry), and the worker refuses to run another framework.
_BASELINE_LAUNCHER = (
    "-c",
    "import os, runpy, sys\n"
    f"base = os.path.realpath(os.environ[{BASELINE_ENV!r}])\n"
    "sys.path.insert(0, base)\n"
    "import broker, framework\n"
    "for m in (broker, framework):\n"
    "    if not os.path.realpath(m.__file__).startswith(base + os.sep):\n"
    "        sys.exit(f'baseline worker: {m.__name__} comes from {m.__file__}, not {base}')\n"
    "print(f'baseline worker: framework from {framework.__file__}', flush=True)\n"
    "runpy.run_module('framework', run_name='__main__', alter_sys=True)\n",
)


def modes() -> tuple[str, ...]:
    """The modes of this run: :data:`MODES`, plus ``baseline`` when ``BENCH_BASELINE_PYTHONPATH`` is set."""
    return (*MODES, "baseline") if os.environ.get(BASELINE_ENV) else MODES


def round_order(round_: int) -> tuple[str, ...]:
    """The modes rotated by ``round_``, so each mode runs first, second, ... equally often."""
    ms = modes()
    k = round_ % len(ms)
    return ms[k:] + ms[:k]


# -- one trial per mode ---------------------------------------------------------------------------------------


def _check_environment() -> None:
    inherited = sorted(k for k in os.environ if k.startswith(("OTEL_", "FRAMEWORK_METRICS_")))
    if inherited:
        raise RuntimeError(
            f"unset {', '.join(inherited)}: every mode sets the worker's observability itself, and `off` means none"
        )


def _baseline_path() -> str:
    base = os.environ.get(BASELINE_ENV, "")
    if not (Path(base) / "framework" / "__init__.py").is_file() or not (Path(base) / "broker").is_dir():
        raise RuntimeError(f"{BASELINE_ENV}={base!r} is not a checkout of this repository (no framework/, broker/)")
    return os.path.realpath(base)


@contextlib.contextmanager
def _mode(mode: str) -> Iterator[tuple[dict[str, Any], Sink, int | None]]:
    """The worker options of ``mode`` (``env``, ``extra_args``, ``launcher``), the sink, the metrics port."""
    _check_environment()
    with Sink() as sink:
        options: dict[str, Any] = {"env": {}, "extra_args": (), "launcher": framework_bench.FRAMEWORK}
        port = None
        if mode in ("trace-all", "trace-1pct"):
            options["env"] = {
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{sink.url}/v1/traces",
                "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                "OTEL_TRACES_SAMPLER_ARG": "1.0" if mode == "trace-all" else "0.01",
            }
        elif mode == "metrics":
            port = free_port()
            options["env"] = {
                "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": f"{sink.url}/v1/metrics",
                "OTEL_METRIC_EXPORT_INTERVAL": str(METRIC_INTERVAL_MS),
            }
            options["extra_args"] = ("--metrics-port", str(port))
        elif mode == "baseline":
            options["env"] = {"PYTHONPATH": _baseline_path()}
            options["launcher"] = _BASELINE_LAUNCHER
        elif mode != "off":
            raise ValueError(f"unknown observability mode {mode!r}")
        yield options, sink, port


def drain_trial(url: str, n: int, mode: str, *, progress: Progress) -> dict[str, Any]:
    """``framework_bench.commands`` (inbox on) with the worker in ``mode``; adds what was exported."""
    with _mode(mode) as (options, sink, port):
        settled: Callable[[], dict[str, Any]] | None = None
        if port is not None:
            settled = lambda: {"prometheus": scrape(port)}  # noqa: E731
        with CpuWatch() as cpu:
            result = framework_bench.commands(
                url, n, label=f"observability {mode}", progress=progress, on_settled=settled, **options
            )
    cpu_s = cpu.between(result["first_ns"], result["settled_ns"])
    return {
        **result,
        "mode": mode,
        "cpu_s": cpu_s,  # the worker's CPU seconds over the timed span (all its threads)
        "cpu_us_per_msg": cpu_s * 1e6 / n,
        "export": sink.report(),
    }


def latency_trial(url: str, mode: str, *, rate: float, seconds: float, progress: Progress) -> dict[str, Any]:
    """``framework_bench.latency`` with the worker in ``mode``; adds what was exported."""
    with _mode(mode) as (options, sink, _port):
        progress(f"observability latency, {mode}")
        result = framework_bench.latency(url, rate=rate, seconds=seconds, progress=progress, **options)
    return {**result, "mode": mode, "export": sink.report()}


# -- summary and table rows -------------------------------------------------------------------------------------


def _stats(values: Sequence[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": list(values)}


def _paired(trials: Mapping[str, list[dict[str, Any]]], key: str, base: str, field: str) -> dict[str, Any] | None:
    bases = {t["round"]: t[field] for t in trials.get(base, []) if t.get("round") is not None}
    ratios = [t[field] / bases[t["round"]] for t in trials.get(key, []) if t.get("round") in bases]
    return _stats(ratios) if ratios else None


def summary(trials: Mapping[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per mode: medians of msg/s, worker CPU per message, latency and exports; ratios to ``off``
    (and ``off`` to ``baseline``) paired by round: msg/s over msg/s (``ratio_to_*``), and CPU per
    message inverted (``cpu_ratio_to_*``: off's CPU over the mode's, the throughput ratio if
    CPU alone set the pace)."""
    out: dict[str, dict[str, Any]] = {}
    for mode in (*MODES, "baseline"):
        drains = trials.get(f"observability:{mode}", [])
        if drains:
            figures: dict[str, Any] = {
                "n": drains[0]["n"],
                "msgs_per_s": _stats([t["msgs_per_s"] for t in drains]),
                "peak_rss_mib": _stats([t["peak_rss_mib"] for t in drains]),
                "cpu_us_per_msg": _stats([t["cpu_us_per_msg"] for t in drains]),
            }
            spans = [t["export"]["traces"]["spans"] for t in drains if "traces" in t["export"]]
            if spans:
                figures["spans_exported"] = _stats(spans)
                figures["trace_bytes"] = _stats([t["export"]["traces"]["bytes"] for t in drains])
            if any("metrics" in t["export"] for t in drains):
                figures["metric_requests"] = _stats([t["export"].get("metrics", {}).get("requests", 0) for t in drains])
                figures["metric_names"] = sorted(
                    {n for t in drains for n in t["export"].get("metrics", {}).get("names", [])}
                )
            if scrapes := [t["prometheus"]["processed"] for t in drains if "prometheus" in t]:
                figures["prometheus_processed"] = _stats(scrapes)
            key = f"observability:{mode}"
            if mode != "off" and (pr := _paired(trials, key, "observability:off", "msgs_per_s")):
                figures["ratio_to_off"] = pr
                figures["cpu_ratio_to_off"] = _paired(trials, "observability:off", key, "cpu_us_per_msg")
            if mode == "off" and (pr := _paired(trials, key, "observability:baseline", "msgs_per_s")):
                figures["ratio_to_baseline"] = pr
                figures["cpu_ratio_to_baseline"] = _paired(trials, "observability:baseline", key, "cpu_us_per_msg")
            out[f"observability:{mode}"] = figures
        lat = trials.get(f"observability-latency:{mode}", [])
        if lat:
            out[f"observability-latency:{mode}"] = {
                **{f: _stats([t[f] for t in lat]) for f in ("p50_ms", "p90_ms", "p99_ms", "max_ms", "achieved_rate")},
                "spans_exported": _stats([t["export"].get("traces", {}).get("spans", 0) for t in lat]),
                "samples": lat[0]["samples"],
            }
    return out


def _spread(s: Mapping[str, Any], fmt: str) -> str:
    return f" ({format(s['min'], fmt)}-{format(s['max'], fmt)})" if len(s["runs"]) > 1 else ""


def _cpu(fig: Mapping[str, Any], ratio: Mapping[str, Any] | None) -> tuple[str, str]:
    """The CPU lines of a row: µs per message (result column), CPU-based ratio (ratio column)."""
    per = fig["cpu_us_per_msg"]
    result = f"\n[dim]{per['median']:.1f} µs CPU/msg{_spread(per, '.1f')}[/dim]"
    return result, (f"\n[dim]CPU {ratio['median']:.3f}x{_spread(ratio, '.3f')}[/dim]" if ratio else "")


def rows(sm: Mapping[str, dict[str, Any]], errors: Mapping[str, str], latency_rate: float) -> list[dict[str, Any]]:
    """The table rows (fields of ``benchmarks.rows.Row``): msg/s per mode with its paired ratio
    to ``off`` and the verdict, then latency per mode."""
    out: list[dict[str, Any]] = []
    if "observability" in errors:
        out.append({"benchmark": "observability cost (drain)", "result": f"[yellow]{errors['observability']}[/yellow]"})
    off = sm.get("observability:off")
    if off:
        rate = off["msgs_per_s"]
        noise = (rate["max"] - rate["min"]) / rate["median"]
        base = off.get("ratio_to_baseline")
        cpu_result, cpu_ratio = _cpu(off, off.get("cpu_ratio_to_baseline"))
        if base:
            ratio, ok = f"{base['median']:.3f}x{_spread(base, '.3f')}{cpu_ratio}", base["median"] >= OFF_TARGET
            target = f"≥ {OFF_TARGET:.2f}x baseline (within noise)"
        else:
            ratio, ok, target = "baseline not run", None, f"{BASELINE_ENV} unset"
        out.append(
            {
                "benchmark": f"observability {_LABELS['off']}: {off['n']:,} commands → one worker, inbox on",
                "result": f"{rate['median']:,.0f} msg/s{_spread(rate, ',.0f')}"
                + (f"\n[dim]rounds spread {noise:.1%} of the median[/dim]" if len(rate["runs"]) > 1 else "")
                + cpu_result,
                "ceiling": (
                    f"{bl['msgs_per_s']['median']:,.0f} msg/s\n[dim]baseline, {bl['cpu_us_per_msg']['median']:.1f} "
                    "µs CPU/msg[/dim]"
                    if (bl := sm.get("observability:baseline"))
                    else "—"
                ),
                "ratio": ratio,
                "target": target,
                "ok": ok,
            }
        )
    targets = {"trace-all": None, "trace-1pct": TRACE_1PCT_TARGET, "metrics": METRICS_TARGET}
    for mode, goal in targets.items():
        fig = sm.get(f"observability:{mode}")
        if not fig:
            continue
        pr = fig.get("ratio_to_off")
        cpu_result, cpu_ratio = _cpu(fig, fig.get("cpu_ratio_to_off"))
        detail = cpu_result
        if "spans_exported" in fig:
            detail += f"\n[dim]{fig['spans_exported']['median']:,.0f} spans exported[/dim]"
        elif "prometheus_processed" in fig:
            detail += (
                f"\n[dim]{fig['metric_requests']['median']:.0f} OTLP exports, Prometheus counted "
                f"{fig['prometheus_processed']['median']:,.0f}[/dim]"
            )
        out.append(
            {
                "benchmark": f"observability: {_LABELS[mode]}",
                "result": f"{fig['msgs_per_s']['median']:,.0f} msg/s{_spread(fig['msgs_per_s'], ',.0f')}{detail}",
                "ceiling": f"{off['msgs_per_s']['median']:,.0f} msg/s\n[dim]tracing off[/dim]" if off else "—",
                "ratio": f"{pr['median']:.3f}x{_spread(pr, '.3f')}{cpu_ratio}" if pr else "—",
                "target": "reported" if goal is None else f"≥ {goal:.2f}x off",
                "ok": None if goal is None or pr is None else pr["median"] >= goal,
            }
        )
    if "observability-latency" in errors:
        out.append(
            {
                "benchmark": "observability cost (latency)",
                "result": f"[yellow]{errors['observability-latency']}[/yellow]",
            }
        )
    lat_off = sm.get("observability-latency:off")
    for mode in ("off", "baseline", "trace-all", "trace-1pct", "metrics"):
        lat = sm.get(f"observability-latency:{mode}")
        if not lat:
            continue
        added = "—"
        if lat_off and mode != "off":
            added = f"p99 {lat['p99_ms']['median'] - lat_off['p99_ms']['median']:+.2f} ms"
        out.append(
            {
                "benchmark": f"observability latency @ {latency_rate:,.0f}/s, {mode}",
                "result": f"p50 {lat['p50_ms']['median']:.2f}{_spread(lat['p50_ms'], '.2f')}\n"
                f"p99 {lat['p99_ms']['median']:.2f}{_spread(lat['p99_ms'], '.2f')} ms",
                "ceiling": (
                    f"p50 {lat_off['p50_ms']['median']:.2f}\np99 {lat_off['p99_ms']['median']:.2f}\n[dim]off[/dim]"
                    if lat_off and mode != "off"
                    else "—"
                ),
                "ratio": added,
                "target": "reported",
            }
        )
    return out
