"""The supervisor's ``/livez`` and ``/readyz`` (``framework run --workers N --health-port PORT``).

Each worker serves its own health on 127.0.0.1, port ``PORT + 1 + i``; the supervisor serves
``PORT`` (the one a Kubernetes probe names) and asks every worker on each request, in parallel,
with a short timeout:

* ``/livez``: 200 unless a running worker's own ``/livez`` did not answer in time (its event loop
  is stuck) or answered 503. A worker that is starting (its port refuses connections) or waiting
  to be restarted counts as live: the supervisor is handling it, and restarting the pod would not help.
* ``/readyz``: 200 when every worker is running and its ``/readyz`` answers 200; else 503 naming
  the first worker that is not ready and why. Both bodies list every worker (pid, starts, last exit).
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

import orjson

from framework.health import listen

__all__ = ["AggregateHealth", "Workers"]

WORKER_TIMEOUT = 2.0
"""Seconds a worker gets to answer the supervisor's health request."""


def ask(port: int, path: str, timeout: float = WORKER_TIMEOUT) -> tuple[int | None, dict[str, Any]]:
    """(HTTP status, JSON body) of ``GET path`` on the worker at ``127.0.0.1:port``; status None
    when the port refuses connections (the worker is not serving yet), 0 when it did not answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        raw = response.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = {}
        return response.status, body if isinstance(body, dict) else {}
    except ConnectionRefusedError:
        return None, {}
    except (TimeoutError, OSError, http.client.HTTPException) as exc:
        return 0, {"reason": f"did not answer: {type(exc).__name__}"}
    finally:
        conn.close()


class Workers(Protocol):
    """What the aggregate needs of the supervisor (:class:`framework.cli.workers.Supervisor`)."""

    @property
    def count(self) -> int:
        """How many workers."""

    @property
    def stopping(self) -> bool:
        """Whether they are being stopped."""

    @property
    def slots(self) -> Sequence[Any]:
        """The workers (:class:`framework.cli.workers.WorkerSlot`: ``.index``, ``.describe()``)."""

    def worker_health_port(self, index: int) -> int:
        """The port worker ``index`` serves its own health on."""


class AggregateHealth:
    """Serves the supervisor's health port on a daemon thread until :meth:`close`."""

    def __init__(self, supervisor: Workers, host: str, port: int) -> None:
        self.supervisor = supervisor
        sock = listen(host, port)  # OSError: the caller says it in one line (framework.health.bind_error)
        sock.setblocking(True)
        self.pool = ThreadPoolExecutor(max_workers=min(32, supervisor.count), thread_name_prefix="framework-health")
        self.server = ThreadingHTTPServer((host, port), _handler(self), bind_and_activate=False)
        self.server.socket.close()
        self.server.socket = sock
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, name="framework-health", daemon=True).start()

    def close(self) -> None:
        """Stop serving."""
        self.server.shutdown()
        self.server.server_close()
        self.pool.shutdown(wait=False)

    def answer(self, path: str) -> tuple[int, dict[str, Any]]:
        """(status, body) of ``/livez`` or ``/readyz`` for all the workers."""
        sup = self.supervisor
        slots = list(sup.slots)
        ports = [sup.worker_health_port(s.index) for s in slots]
        answers = list(self.pool.map(lambda port: ask(port, path), ports))
        workers = []
        failing: str | None = None
        for slot, (status, body) in zip(slots, answers, strict=True):
            state = slot.describe()
            running = state["running"]
            if path == "/livez":
                ok = not running or status is None or status == 200
                why = "its event loop did not answer" if status == 0 else body.get("reason", f"status {status}")
            else:
                ok = running and status == 200 and not sup.stopping
                why = (
                    "draining: a shutdown was asked for"
                    if sup.stopping
                    else "not running (waiting to be restarted)"
                    if not running
                    else "starting"
                    if status is None
                    else body.get("reason", f"status {status}")
                )
            state["ok"] = ok
            if not ok:
                state["reason"] = why
                failing = failing or f"worker {slot.index}: {why}"
            workers.append(state)
        key = "live" if path == "/livez" else "ready"
        out: dict[str, Any] = {key: failing is None, "workers": workers}
        if failing is not None:
            out["reason"] = failing
        return (200 if failing is None else 503), out


def _handler(health: AggregateHealth) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path in ("/livez", "/readyz"):
                status, body = health.answer(path)
            else:
                status, body = 404, {"error": f"no such path {path!r}: use /livez or /readyz"}
            raw = orjson.dumps(body)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, format: str, *args: Any) -> None:
            """Probes are not logged."""

    return Handler
