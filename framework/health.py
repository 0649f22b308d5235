"""``/livez`` and ``/readyz`` of a worker (``framework run --health-port PORT``), served by its event loop.

``/livez`` answers 200 whenever the worker's event loop answers at all: the server runs in that
loop, beside the runtime's tasks, so a blocked loop (a sync call in an async handler) gets no answer
and the probe times out. The consumers' tasks run in the runtime's task group: one that fails
takes the runtime, and this server with it, down (a crashed actor is restarted inside it). It
never calls the broker: a broker outage must not make Kubernetes restart every worker at once
(the runtime reconnects by itself).

``/readyz`` answers 200 once the worker consumes: started (groups joined), not draining, the broker
reachable (no outage reported by the runtime's actors, and one cheap round trip answered within
a second), and, for destinations whose partitions are owned, the share of partitions assigned to
this instance held. Otherwise 503 with ``{"ready": false, "reason": "..."}``. Any other path is 404.
"""

from __future__ import annotations

import asyncio
import errno
import socket
from typing import Any

import anyio
import orjson

from framework.runtime import connectivity
from framework.runtime.ownership import assign

__all__ = ["HealthServer", "bind_error", "listen", "readiness"]

PING_TIMEOUT = 1.0
"""Seconds ``/readyz`` waits for its one broker round trip."""

_REQUEST_TIMEOUT = 5.0  # seconds a client gets to send its request line and headers
_REQUEST_LIMIT = 16_384  # bytes of request line and headers read at most


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``; OSError if it cannot be bound (see :func:`bind_error`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT of a previous run is fine
        sock.bind((host, port))
        sock.listen(64)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def bind_error(exc: OSError, host: str, port: int, option: str = "--health-port") -> str:
    """The one-line message for a health port that could not be bound."""
    if exc.errno == errno.EADDRINUSE:
        return f"health port {port} on {host} is in use ({option}): pick another port or stop what listens there"
    return f"cannot serve health checks on {host}:{port}: {exc.strerror or exc}"


async def readiness(runtime: Any) -> tuple[bool, dict[str, Any]]:
    """(ready, the JSON body of ``/readyz``) for ``runtime`` (a :class:`framework.runtime.Runtime`)."""
    if runtime.stopping:
        return False, {"ready": False, "reason": "draining: a shutdown was asked for"}
    if not runtime.started:
        return False, {"ready": False, "reason": "starting: connecting and joining the groups"}
    if connectivity.is_down():
        return False, {"ready": False, "reason": "broker unreachable (the runtime is reconnecting)"}
    try:
        with anyio.fail_after(PING_TIMEOUT):
            await runtime.broker.list_subscriptions()  # one small read: the server answers
    except TimeoutError:
        return False, {"ready": False, "reason": f"broker did not answer within {PING_TIMEOUT:g} s"}
    except Exception as exc:
        return False, {"ready": False, "reason": f"broker unreachable: {type(exc).__name__}: {exc}"}
    owned: dict[str, list[int]] = {}
    for consumer in runtime.consumers:
        ownership = consumer.ownership
        if ownership is None:
            continue
        where = f"{ownership.destination} (group {ownership.group})"
        if not ownership.members:
            return False, {"ready": False, "reason": f"not yet a member of {where}"}
        share = {p for p, who in assign(len(ownership.views), ownership.members).items() if who == ownership.instance}
        missing = sorted(share - set(ownership.owned()))
        if missing:
            return False, {"ready": False, "reason": f"waiting for partitions {missing} of {where}"}
        owned[where] = ownership.owned()
    body: dict[str, Any] = {"ready": True, "consumer": runtime.consumer_name, "handlers": len(runtime.consumers)}
    if owned:
        body["owned"] = owned
    return True, body


def liveness(runtime: Any) -> tuple[bool, dict[str, Any]]:
    """(live, the JSON body of ``/livez``): the loop answered, so live; no broker call."""
    return True, {"live": True, "started": bool(runtime.started), "in_flight": runtime.in_flight}


class HealthServer:
    """Serves ``/livez`` and ``/readyz`` for one runtime on an already bound socket (see :func:`listen`)."""

    def __init__(self, runtime: Any, sock: socket.socket) -> None:
        self.runtime = runtime
        self.sock = sock

    async def serve(self) -> None:
        """Answer requests until cancelled (the socket is closed then)."""
        server = await asyncio.start_server(self._handle, sock=self.sock)
        try:
            async with server:
                await server.serve_forever()
        finally:
            self.sock.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                async with asyncio.timeout(_REQUEST_TIMEOUT):
                    head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
                return
            if len(head) > _REQUEST_LIMIT:
                return
            method, path = _request_line(head)
            status, body = await self.answer(method, path)
            payload = b"" if method == "HEAD" else body
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                "Cache-Control: no-store\r\nConnection: close\r\n\r\n".encode()
                + payload
            )
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def answer(self, method: str, path: str) -> tuple[str, bytes]:
        """(status line, body) for one request."""
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", orjson.dumps({"error": f"method {method} not allowed: use GET"})
        if path == "/livez":
            ok, body = liveness(self.runtime)
        elif path == "/readyz":
            ok, body = await readiness(self.runtime)
        else:
            return "404 Not Found", orjson.dumps({"error": f"no such path {path!r}: use /livez or /readyz"})
        return ("200 OK" if ok else "503 Service Unavailable"), orjson.dumps(body)


def _request_line(head: bytes) -> tuple[str, str]:
    """(method, path without the query) of an HTTP request's first line."""
    first = head.split(b"\r\n", 1)[0].decode("latin-1").split()
    method = first[0].upper() if first else ""
    target = first[1] if len(first) > 1 else "/"
    return method, target.split("?", 1)[0]
