"""A real OTLP/HTTP receiver for tests: what an OpenTelemetry Collector would receive, decoded.

:class:`OTLPReceiver` listens on 127.0.0.1 (a free port) in a thread of the test process and
accepts ``POST /v1/traces``, ``/v1/metrics`` and ``/v1/logs`` as the OTLP/HTTP specification
says: protobuf bodies (``application/x-protobuf``) or JSON (``application/json``), optionally
gzip-compressed (``Content-Encoding: gzip``), answered with an empty ``Export*ServiceResponse``.
The bodies are decoded with ``opentelemetry-proto`` and kept, flattened into :class:`Span` and
:class:`Point` records that tests can query without knowing the protobuf layout.
"""

from __future__ import annotations

import gzip
import sys
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest, ExportLogsServiceResponse
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanProto
from opentelemetry.proto.trace.v1.trace_pb2 import Status

__all__ = ["CONSUMER", "ERROR", "PRODUCER", "OTLPReceiver", "Point", "Span"]

CONSUMER = SpanProto.SpanKind.SPAN_KIND_CONSUMER
PRODUCER = SpanProto.SpanKind.SPAN_KIND_PRODUCER
ERROR = Status.StatusCode.STATUS_CODE_ERROR

_SIGNALS: dict[str, tuple[type[Message], type[Message]]] = {
    "/v1/traces": (ExportTraceServiceRequest, ExportTraceServiceResponse),
    "/v1/metrics": (ExportMetricsServiceRequest, ExportMetricsServiceResponse),
    "/v1/logs": (ExportLogsServiceRequest, ExportLogsServiceResponse),
}


def value(v: AnyValue) -> Any:
    """The Python value of an OTLP ``AnyValue``."""
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return attributes(v.kvlist_value.values)
    if kind is None:
        return None
    return getattr(v, kind)


def attributes(kvs: Any) -> dict[str, Any]:
    """A dict of OTLP ``KeyValue`` attributes."""
    return {kv.key: value(kv.value) for kv in kvs if isinstance(kv, KeyValue)}


@dataclass(frozen=True)
class Span:
    """One received span, with its resource's attributes."""

    resource: dict[str, Any]
    scope: str
    name: str
    kind: int
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # 16 hex digits, "" for a root span
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    status: int
    status_message: str
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace id, span id)


@dataclass(frozen=True)
class Point:
    """One received metric data point (a sum, gauge or histogram point)."""

    resource: dict[str, Any]
    name: str
    unit: str
    kind: str  # sum, gauge, histogram, exponential_histogram, summary
    attributes: dict[str, Any]
    value: float  # the value of a sum or gauge point; the count of a histogram point
    raw: Any


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A sender killed mid-connection (a worker the test stopped) is not an error of the receiver."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class OTLPReceiver:
    """An OTLP/HTTP endpoint on ``self.endpoint`` (``http://127.0.0.1:PORT``) for the ``with`` block."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, Message]] = []  # (path, decoded request)
        self.encodings: list[str] = []  # Content-Encoding of each request ("" when none)
        self.rejected: list[tuple[str, int]] = []  # (path, status) of requests answered with an error
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------------------

    def __enter__(self) -> OTLPReceiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the exporter's session expects

            def do_POST(self) -> None:  # the http.server hook
                receiver._handle(self)

            def log_message(self, format: str, *args: Any) -> None:  # quiet in tests
                pass

        self._server = _Server(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None and self._thread is not None
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    @property
    def endpoint(self) -> str:
        """The base URL, as ``OTEL_EXPORTER_OTLP_ENDPOINT`` takes it."""
        assert self._server is not None, "start the receiver with `with OTLPReceiver() as r:`"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # -- receiving ------------------------------------------------------------------------------------

    def _handle(self, http: BaseHTTPRequestHandler) -> None:
        path = http.path.split("?", 1)[0]
        body = http.rfile.read(int(http.headers.get("Content-Length") or 0))
        if path not in _SIGNALS:
            self._answer(http, path, 404, b"", "text/plain")
            return
        request_type, response_type = _SIGNALS[path]
        encoding = (http.headers.get("Content-Encoding") or "").strip().lower()
        content_type = (http.headers.get("Content-Type") or "application/x-protobuf").split(";")[0].strip()
        try:
            if encoding == "gzip":
                body = gzip.decompress(body)
            elif encoding == "deflate":
                body = zlib.decompress(body)
            elif encoding not in ("", "identity"):
                self._answer(http, path, 415, b"", "text/plain")
                return
            request = request_type()
            if content_type == "application/json":
                json_format.Parse(body.decode(), request)
            else:
                request.ParseFromString(body)
        except (OSError, EOFError, zlib.error, DecodeError, json_format.ParseError, UnicodeDecodeError):
            self._answer(http, path, 400, b"", "text/plain")
            return
        with self._lock:
            self.requests.append((path, request))
            self.encodings.append(encoding)
        if content_type == "application/json":
            self._answer(http, path, 200, b"{}", "application/json")
        else:
            self._answer(http, path, 200, response_type().SerializeToString(), "application/x-protobuf")

    def _answer(self, http: BaseHTTPRequestHandler, path: str, status: int, body: bytes, content_type: str) -> None:
        if status >= 400:
            with self._lock:
                self.rejected.append((path, status))
        http.send_response(status)
        http.send_header("Content-Type", content_type)
        http.send_header("Content-Length", str(len(body)))
        http.end_headers()
        http.wfile.write(body)

    # -- what arrived ---------------------------------------------------------------------------------

    def _of(self, path: str) -> list[Any]:
        with self._lock:
            return [request for p, request in self.requests if p == path]

    def spans(self) -> list[Span]:
        """Every span received so far."""
        found = []
        for request in self._of("/v1/traces"):
            for rs in request.resource_spans:
                resource = attributes(rs.resource.attributes)
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        found.append(
                            Span(
                                resource=resource,
                                scope=ss.scope.name,
                                name=s.name,
                                kind=s.kind,
                                trace_id=s.trace_id.hex(),
                                span_id=s.span_id.hex(),
                                parent_span_id=s.parent_span_id.hex(),
                                attributes=attributes(s.attributes),
                                events=[(e.name, attributes(e.attributes)) for e in s.events],
                                status=s.status.code,
                                status_message=s.status.message,
                                links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                            )
                        )
        return found

    def points(self) -> list[Point]:
        """Every metric data point received so far (one export's points after another's)."""
        found = []
        for request in self._of("/v1/metrics"):
            for rm in request.resource_metrics:
                resource = attributes(rm.resource.attributes)
                for sm in rm.scope_metrics:
                    for metric in sm.metrics:
                        kind = metric.WhichOneof("data")
                        if kind is None:
                            continue
                        for p in getattr(metric, kind).data_points:
                            if kind in ("sum", "gauge"):
                                number = p.as_double if p.WhichOneof("value") == "as_double" else p.as_int
                            else:
                                number = p.count
                            found.append(
                                Point(resource, metric.name, metric.unit, kind, attributes(p.attributes), number, p)
                            )
        return found

    def logs(self) -> list[Any]:
        """Every log record received so far (protobuf ``LogRecord`` messages)."""
        return [
            record
            for request in self._of("/v1/logs")
            for rl in request.resource_logs
            for sl in rl.scope_logs
            for record in sl.log_records
        ]

    def wait_for(self, predicate: Callable[[OTLPReceiver], object], timeout: float, what: str) -> None:
        """Poll ``predicate(self)`` until true; AssertionError naming ``what`` after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self):
                return
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")
