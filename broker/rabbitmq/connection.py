"""Opening AMQP connections: the URL's own options, bounded time, and one line saying what to do on failure."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import aio_pika
import aio_pika.abc
import aiormq.exceptions
import anyio

from broker.errors import BrokerUnavailable, ConfigurationError
from broker.urls import redact

__all__ = ["DEFAULT_HEARTBEAT_S", "open_connection", "split_url"]

DEFAULT_HEARTBEAT_S = 10
"""AMQP heartbeat unless the URL sets one: a connection that stops answering is dropped within about
two intervals (and the broker reconnects on its next call)."""

_OPTIONS = {"prefetch": int, "delivery_limit": int, "timeout": float}
_ELSEWHERE = ("inbox",)
"""Query parameters read by :func:`broker.connect` (the inbox's store), not by this transport or its client."""


def split_url(url: str) -> tuple[str, dict[str, float | int]]:
    """The URL for the client (this transport's own query parameters taken out, a heartbeat added)
    and those parameters' values."""
    parts = urlsplit(url)
    ours: dict[str, float | int] = {}
    rest = []
    for name, value in parse_qsl(parts.query):
        if name in _OPTIONS:
            try:
                ours[name] = _OPTIONS[name](value)
            except ValueError:
                raise ConfigurationError(f"broker URL option {name}={value!r} is not a number") from None
        elif name not in _ELSEWHERE:
            rest.append((name, value))
    if not any(name == "heartbeat" for name, _ in rest):
        rest.append(("heartbeat", str(DEFAULT_HEARTBEAT_S)))
    return urlunsplit(parts._replace(query=urlencode(rest))), ours


async def open_connection(url: str, client_url: str, timeout: float) -> aio_pika.abc.AbstractConnection:
    """Connect to ``client_url`` (from :func:`split_url` of ``url``) within ``timeout`` seconds; raise
    :class:`BrokerUnavailable` in one line (without the password) saying what to do."""
    where = redact(url)
    try:
        with anyio.fail_after(timeout):
            return await aio_pika.connect(client_url, timeout=timeout)
    except aiormq.exceptions.ProbableAuthenticationError:
        raise BrokerUnavailable(f"RabbitMQ at {where} refused the login: check the user and password") from None
    except (aiormq.exceptions.InvalidFrameError, aiormq.exceptions.ConnectionNotAllowed):
        vhost = urlsplit(url).path[1:] or "/"
        raise BrokerUnavailable(
            f"RabbitMQ at {where} refused virtual host {vhost!r}: it does not exist or the user may not use it "
            f"(rabbitmqctl add_vhost {vhost}; rabbitmqctl set_permissions -p {vhost} USER '.*' '.*' '.*')"
        ) from None
    except (OSError, TimeoutError, aiormq.exceptions.AMQPConnectionError) as exc:
        raise BrokerUnavailable(
            f"cannot reach RabbitMQ at {where} ({type(exc).__name__}): start it (rabbitmq-server -detached) "
            "or fix BROKER_URL"
        ) from None
