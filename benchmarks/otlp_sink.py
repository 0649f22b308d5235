"""A local OTLP/HTTP receiver for the observability benchmark, and what the worker's exports carried.

:class:`Sink` answers 200 to ``POST /v1/traces`` and ``/v1/metrics`` on 127.0.0.1 (a free port)
and keeps the bodies; :meth:`Sink.report` decodes them (outside the timed span) to count the spans
and metric points really exported. :func:`scrape` reads the worker's Prometheus endpoint once.
"""

from __future__ import annotations

import gzip
import socket
import threading
import urllib.request
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["Sink", "free_port", "scrape"]


class Sink:
    """A local OTLP/HTTP receiver: 200 to every POST, bodies kept per path until :meth:`report`."""

    def __init__(self) -> None:
        self.bodies: dict[str, list[bytes]] = {}
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as with a real collector

            def do_POST(self) -> None:
                data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    data = gzip.decompress(data)
                with sink._lock:
                    sink.bodies.setdefault(self.path, []).append(data)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="otlp-sink", daemon=True)

    def __enter__(self) -> Sink:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join()

    def report(self) -> dict[str, Any]:
        """Requests, bytes and what they carried (spans; metric names and points) per signal."""
        with self._lock:
            bodies = {path: list(items) for path, items in self.bodies.items()}
        out: dict[str, Any] = {}
        if traces := bodies.pop("/v1/traces", None):
            out["traces"] = {"requests": len(traces), "bytes": sum(map(len, traces)), "spans": _count_spans(traces)}
        if metrics := bodies.pop("/v1/metrics", None):
            names, points = _metric_points(metrics)
            out["metrics"] = {
                "requests": len(metrics),
                "bytes": sum(map(len, metrics)),
                "points": points,
                "names": sorted(names),
            }
        for path, items in bodies.items():
            out[path] = {"requests": len(items), "bytes": sum(map(len, items))}
        return out


def _count_spans(bodies: Sequence[bytes]) -> int:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    spans = 0
    for data in bodies:
        request = ExportTraceServiceRequest.FromString(data)
        spans += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
    return spans


def _metric_points(bodies: Sequence[bytes]) -> tuple[set[str], int]:
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    names: set[str] = set()
    points = 0
    for data in bodies:
        request = ExportMetricsServiceRequest.FromString(data)
        for rm in request.resource_metrics:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    names.add(metric.name)
                    kind = metric.WhichOneof("data")
                    points += len(getattr(metric, kind).data_points) if kind else 0
    return names, points


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[str, Any]:
    """One scrape of the worker's Prometheus endpoint: size, samples, messages it counted processed."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    processed = sum(
        float(line.rsplit(" ", 1)[1]) for line in samples if line.startswith("framework_messages_processed_total")
    )
    return {"bytes": len(text), "samples": len(samples), "processed": processed}
