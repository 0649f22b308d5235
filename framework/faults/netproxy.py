"""A TCP proxy for network-fault tests: silent stalls and abrupt resets between a client and a server.

The proxy listens on 127.0.0.1 (a free port) and forwards every connection to the target. It runs
its own asyncio loop in a thread, so tests drive it from plain synchronous code:

- :meth:`NetProxy.stall` makes the path silent, like a dead NAT entry or a blackholed route:
  connections stay open, bytes are accepted and dropped in both directions, nothing is closed.
  Connections open during a stall (and new ones made while it lasts) never carry bytes again.
- :meth:`NetProxy.resume` heals the path for new connections.
- :meth:`NetProxy.reset_all` closes every connection abruptly (an RST to the client, via
  ``SO_LINGER`` 0), like a restarted load balancer.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from typing import Any
from urllib.parse import urlsplit, urlunsplit

__all__ = ["NetProxy"]


class _Link:
    """One proxied connection: the client's side and the server's side."""

    __slots__ = ("client", "dead", "server")

    def __init__(self, client: asyncio.StreamWriter, server: asyncio.StreamWriter | None) -> None:
        self.client = client
        self.server = server
        self.dead = False  # silent for good: bytes are read and dropped


class NetProxy:
    """Forward 127.0.0.1:<port> to ``host:port``; see the module docstring."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.port = 0
        self._links: set[_Link] = set()
        self._stalled = False
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="netproxy", daemon=True)

    @classmethod
    def for_url(cls, url: str) -> NetProxy:
        """A proxy in front of the server of a redis:// URL (started)."""
        parts = urlsplit(url)
        return cls(parts.hostname or "127.0.0.1", parts.port or 6379).start()

    def url(self, url: str) -> str:
        """``url`` with its host and port replaced by the proxy's."""
        parts = urlsplit(url)
        auth = parts.netloc.rpartition("@")[0]
        netloc = f"{auth}@127.0.0.1:{self.port}" if auth else f"127.0.0.1:{self.port}"
        return urlunsplit(parts._replace(netloc=netloc))

    def start(self) -> NetProxy:
        """Start listening (in the proxy's own thread); returns the proxy."""
        self._thread.start()
        self._call(self._listen())
        return self

    def close(self) -> None:
        """Stop listening and close every connection."""
        self._call(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def stall(self) -> None:
        """Stop forwarding in both directions without closing anything (see the module docstring)."""
        self._call(self._stall())

    def resume(self) -> None:
        """Forward new connections again (connections silenced by the stall stay silent)."""
        self._call(self._resume())

    def reset_all(self) -> int:
        """Close every connection with an RST; return how many there were."""
        return self._call(self._reset_all())  # type: ignore[no-any-return]

    @property
    def connections(self) -> int:
        """Connections currently open through the proxy."""
        return len(self._links)

    # -- inside the proxy's loop -------------------------------------------------------------------

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _stall(self) -> None:
        self._stalled = True
        for link in self._links:
            link.dead = True

    async def _resume(self) -> None:
        self._stalled = False

    async def _reset_all(self) -> int:
        links, self._links = list(self._links), set()
        for link in links:
            for writer in (link.client, link.server):
                if writer is None:
                    continue
                sock = writer.get_extra_info("socket")
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
        return len(links)

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._reset_all()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = _Link(writer, None)
        link.dead = self._stalled
        self._links.add(link)
        if link.dead:  # the path is down: hold the client's connection open and say nothing
            await self._pump(reader, None, link, from_client=True)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            self._links.discard(link)
            writer.transport.abort()
            return
        link.server = up_writer
        await asyncio.gather(
            self._pump(reader, up_writer, link, from_client=True),
            self._pump(up_reader, writer, link, from_client=False),
        )

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None, link: _Link, *, from_client: bool
    ) -> None:
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                if link.dead or writer is None:
                    continue  # silently dropped
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:  # one side closed: close the other (a silent link tells the client nothing)
            if from_client or not link.dead:
                self._links.discard(link)
                for w in (link.client, link.server):
                    if w is not None:
                        w.transport.abort()
