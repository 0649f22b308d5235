"""The requesting side of request/reply: :class:`Requester` and the errors a request raises.

``await client.request("pricing.quote", Quote(...), timeout=2.0, response=Price)`` sends a
command carrying ``reply-to`` (this requester's reply destination) and ``deadline`` headers and
waits for the handler's reply. Each requester has one durable reply destination, named from
its instance id, that expires ``reply_ttl`` seconds after it was last kept alive: it is kept
alive while requests wait (and at each new request), so a short reconnect loses no reply and a
requester that dies leaves nothing behind once the time to live passes. One reader task per
requester reads the destination while requests wait (and ``linger`` seconds after, to count
late replies); the first reply per request wins, later copies and replies after the timeout
are counted (:attr:`Requester.late_replies`, :attr:`Requester.duplicate_replies`) and dropped.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import math
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio
import orjson

from broker import COMMAND, Broker, ConfigurationError, Envelope, new_id, now_ms
from broker import headers as h
from broker.capabilities import REPLIES, ReplyStore, as_replies
from broker.codec import check_body_size
from framework._messages import Outgoing, build_envelope
from framework._payloads import PayloadError, decoder_for
from framework.handlers import Queue
from framework.logs import get_logger
from framework.observability import hooks
from framework.replies import ERROR

__all__ = [
    "DEFAULT_REPLY_TTL",
    "ReplyDecodeError",
    "RequestError",
    "RequestFailed",
    "RequestTimeout",
    "Requester",
    "publish_direct",
    "requester_for",
]

log = get_logger("framework.requests")

DEFAULT_REPLY_TTL = 60.0
"""Seconds a requester's reply destination outlives its last keep-alive."""
_RECENT = 10_000  # answered or timed-out request ids remembered to tell duplicates from late replies

Publish = Callable[[list[Outgoing]], Awaitable[Any]]


class RequestError(Exception):
    """A request did not get a usable reply; ``destination`` names where it was sent."""

    def __init__(self, message: str, destination: str) -> None:
        super().__init__(message)
        self.destination = destination


class RequestTimeout(RequestError, TimeoutError):
    """No reply came within the request's timeout (the message says whether any group consumes the destination)."""


class RequestFailed(RequestError):
    """The handler failed the request: it was dead-lettered (its last attempt failed, or a fatal
    error, or an invalid payload); ``error_type`` and ``error_message`` are the remote exception's."""

    def __init__(self, destination: str, fault: Mapping[str, Any]) -> None:
        self.error_type = str(fault.get("error_type") or "")
        self.error_message = str(fault.get("error_message") or "")
        self.reason = str(fault.get("reason") or "")
        self.handler = str(fault.get("handler") or "")
        self.attempts = int(fault.get("attempts") or 0)
        what = f"{self.error_type}: {self.error_message}" if self.error_type else self.reason
        super().__init__(
            f"request to {destination!r} failed in {self.handler or 'its handler'} "
            f"after {self.attempts} attempt(s): {what}",
            destination,
        )


class ReplyDecodeError(RequestError, PayloadError):
    """The reply does not decode into the ``response`` type (the message names the field)."""


def _check_timeout(timeout: Any) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"request timeout must be a positive number of seconds (e.g. timeout=2.0), not {timeout!r}")
    return float(timeout)


class Requester:
    """One reply destination and the requests waiting on it (see the module docstring).

    ``publish`` stores the request messages (the client's publish path, with its size check and
    tracing). Belongs to one event loop.
    """

    def __init__(
        self, broker: Broker, publish: Publish, *, reply_ttl: float = DEFAULT_REPLY_TTL, linger: float = 1.0
    ) -> None:
        if REPLIES not in broker.capabilities:
            raise ConfigurationError(
                f"request/reply needs the 'replies' capability, which the {broker.transport} transport "
                "does not have: use Redis (redis://) or memory://, or send a command and publish the answer as an event"
            )
        if not (isinstance(reply_ttl, int | float) and reply_ttl > 0):
            raise ValueError(f"reply_ttl must be a positive number of seconds, not {reply_ttl!r}")
        self.broker = broker
        self.store: ReplyStore = as_replies(broker)
        self.publish = publish
        self.name = f"rq-{new_id()}"
        """This requester's reply destination."""
        self.reply_ttl = float(reply_ttl)
        self.linger = linger
        self.replies = 0
        """Replies handed to a waiting request."""
        self.late_replies = 0
        """Replies that came after their request's timeout (or for a request unknown here): dropped."""
        self.duplicate_replies = 0
        """Second and later replies to one request (a redelivered request answered again): dropped."""
        self._pending: dict[str, asyncio.Future[Envelope]] = {}
        self._recent: collections.OrderedDict[str, bool] = collections.OrderedDict()  # id -> answered
        self._decoders: dict[Any, Callable[[bytes], Any]] = {}
        self._cursor = "0"
        self._kept_at = -math.inf  # monotonic time of the last keep-alive
        self._reader: asyncio.Task[None] | None = None
        self._closed = False

    def stats(self) -> dict[str, int]:
        """Replies received, late replies and duplicate replies dropped, requests waiting now."""
        return {
            "replies": self.replies,
            "late_replies": self.late_replies,
            "duplicate_replies": self.duplicate_replies,
            "waiting": len(self._pending),
        }

    async def request(
        self,
        destination: str | Queue,
        payload: Any,
        *,
        timeout: float,
        response: Any = Any,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
        type: str | None = None,
    ) -> Any:
        """Send ``payload`` as a request to ``destination`` and return the reply decoded into ``response``.

        Raises :class:`RequestTimeout` (no reply within ``timeout`` seconds), :class:`RequestFailed`
        (the handler's error) or :class:`ReplyDecodeError` (a reply that is not a ``response``).
        """
        seconds = _check_timeout(timeout)
        decode = self._decoder(response)
        name = destination.name if isinstance(destination, Queue) else destination
        if self._closed:
            raise RuntimeError("this requester is closed")
        await self._keep_alive()
        hdrs = dict(headers) if headers else {}
        hdrs[h.REPLY_TO] = self.name
        hdrs[h.DEADLINE] = str(now_ms() + int(seconds * 1000))
        item = build_envelope(destination, COMMAND, payload, key=key, headers=hdrs, type=type)
        request_id = item[0].id
        future: asyncio.Future[Envelope] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        self._start_reader()
        try:
            with anyio.fail_after(seconds):
                await self.publish([item])
                reply = await future
        except TimeoutError:
            raise RequestTimeout(f"no reply from {name!r} within {seconds:g} s{await self._hint(name)}", name) from None
        finally:
            if self._pending.pop(request_id, None) is not None:
                self._remember(request_id, answered=False)
        return self._decode(reply, decode, name, response)

    async def close(self) -> None:
        """Stop reading and delete the reply destination (replies still coming are dropped)."""
        self._closed = True
        reader, self._reader = self._reader, None
        if reader is not None and not reader.done():
            reader.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(reader, return_exceptions=True)
        if self._kept_at > -math.inf:
            with anyio.move_on_after(5, shield=True):
                try:
                    await self.store.close_replies(self.name)
                except Exception as exc:  # the destination then expires by itself
                    log.warning("could not delete the reply destination; it expires by itself", error=str(exc))

    # -- inside --------------------------------------------------------------------------------------

    def _decoder(self, response: Any) -> Callable[[bytes], Any]:
        decode = self._decoders.get(response)
        if decode is None:
            try:
                decode = decoder_for(response)
            except Exception as exc:  # before anything is sent
                raise TypeError(
                    f"response={response!r} is not a payload type: give an attrs class, a dataclass, dict, "
                    f"list, str, int, float, bool or bytes ({exc})"
                ) from None
            self._decoders[response] = decode
        return decode

    def _decode(self, reply: Envelope, decode: Callable[[bytes], Any], name: str, response: Any) -> Any:
        if reply.headers.get(h.REPLY_STATUS) == ERROR:
            try:
                fault = orjson.loads(reply.body)
            except orjson.JSONDecodeError:
                fault = {"reason": "the handler failed (its error reply is not readable)"}
            raise RequestFailed(name, fault if isinstance(fault, dict) else {})
        try:
            return decode(reply.body)
        except PayloadError as exc:
            wanted = getattr(response, "__name__", str(response))
            raise ReplyDecodeError(f"the reply from {name!r} is not a {wanted}: {exc}", name) from None

    async def _keep_alive(self) -> None:
        """Create the reply destination, or push its expiry back, when a third of its time to live passed."""
        now = time.monotonic()
        if now - self._kept_at >= self.reply_ttl / 3:
            await self.store.open_replies(self.name, int(self.reply_ttl * 1000))
            self._kept_at = now

    def _start_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read_loop(), name=f"replies {self.name}")

    async def _read_loop(self) -> None:
        """Read replies while requests wait, and ``linger`` seconds after the last one."""
        idle_since: float | None = None
        failures = 0
        block_ms = max(50, min(1000, int(self.linger * 1000)))
        while True:
            try:
                await self._keep_alive()
                self._cursor, replies = await self.store.read_replies(self.name, self._cursor, block_ms=block_ms)
                failures = 0
            except Exception as exc:
                if not self._pending:
                    return  # nobody waits (the broker may be closing): the next request starts a reader
                failures += 1
                if failures == 1:
                    log.warning("could not read replies; trying again", reply_to=self.name, error=str(exc))
                await anyio.sleep(min(1.0, 0.05 * 2**failures))
                continue
            for reply in replies:
                self._dispatch(reply)
            if self._pending:
                idle_since = None
            elif idle_since is None:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since >= self.linger:
                return

    def _dispatch(self, reply: Envelope) -> None:
        request_id = reply.headers.get(h.IN_REPLY_TO, "")
        future = self._pending.pop(request_id, None)
        if future is not None and not future.done():
            future.set_result(reply)
            self.replies += 1
            self._remember(request_id, answered=True)
        elif self._recent.get(request_id):
            self.duplicate_replies += 1
            log.debug("duplicate reply dropped", reply_to=self.name, request_id=request_id)
        else:
            self.late_replies += 1
            log.info("late reply dropped (its request timed out)", reply_to=self.name, request_id=request_id)

    def _remember(self, request_id: str, *, answered: bool) -> None:
        self._recent[request_id] = answered
        if len(self._recent) > _RECENT:
            self._recent.popitem(last=False)

    async def _hint(self, name: str) -> str:
        """Why a request to ``name`` may have got no reply: no group subscribed to it."""
        try:
            with anyio.move_on_after(2):
                subscribed = {d for d, _ in await self.broker.list_subscriptions()}
                return "" if name in subscribed else f" (no group is subscribed to {name!r}: is its service running?)"
        except Exception:
            return ""
        return ""


async def publish_direct(broker: Broker, items: Sequence[Outgoing]) -> None:
    """Publish prepared requests now (a handler's ``ctx.request``: not staged, the reply is needed now)."""
    for env, spec in items:
        check_body_size(env, broker.max_body_bytes)
        if spec is not None:
            await broker.ensure_declared(spec)
    envelopes = [env for env, _ in items]
    if hooks.ANY:
        await hooks.publish(broker, envelopes)
    else:
        await broker.publish(envelopes)


_BY_BROKER: weakref.WeakKeyDictionary[Any, Requester] = weakref.WeakKeyDictionary()


def requester_for(broker: Broker) -> Requester:
    """The requester handlers of this process share on ``broker`` (made on first use; its reader
    stops by itself when no request waits, its reply destination expires when the process is gone)."""
    requester = _BY_BROKER.get(broker)
    if requester is None:
        requester = _BY_BROKER[broker] = Requester(broker, functools.partial(publish_direct, broker))
    return requester
