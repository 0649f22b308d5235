"""The Prometheus endpoint's HTTP server: ``/metrics`` (and ``/``) answer, any other path is 404.

prometheus_client's own server answers every path with the exposition, so a probe or a typo
(``/healthz``) got a 200 that meant nothing; health checks are ``framework run --health-port``
(:mod:`framework.health`).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

__all__ = ["METRICS_PATHS", "serve_metrics"]

METRICS_PATHS = ("/metrics", "/metrics/", "/")
"""The paths that answer with the exposition."""


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper does not hold the process at exit


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged (one line per scrape would drown the worker's logs)."""


def _only_metrics(app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
    def serve(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "") in METRICS_PATHS:
            return app(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"not found: the metrics are at /metrics\n"]

    return serve


def serve_metrics(port: int, host: str) -> WSGIServer:
    """Serve the default Prometheus registry at ``http://host:port/metrics`` on a daemon thread
    (OSError if the port cannot be bound)."""
    from prometheus_client import REGISTRY, make_wsgi_app

    server_class = _Server6 if ":" in host else _Server
    httpd = make_server(host, port, _only_metrics(make_wsgi_app(REGISTRY)), server_class, handler_class=_Quiet)
    threading.Thread(target=httpd.serve_forever, name="framework-metrics", daemon=True).start()
    return httpd
