"""Event-driven microservices on Redis Streams.

Write services as decorated handlers, run them with ``framework run module:service``::

    from framework import Service, Context

    billing = Service("billing")

    @billing.event("orders.placed")
    async def charge(event: OrderPlaced, ctx: Context) -> None:
        ctx.publish("payments.captured", PaymentCaptured(event.order_id))
"""

from broker import BrokerUnavailable, ConfigurationError, Envelope
from framework.client import Batch, Client, SyncClient
from framework.context import Context
from framework.payloads import PayloadError, converter
from framework.retries import HandlerTimeout, RetryAfter, RetryPolicy
from framework.runtime import Runtime
from framework.service import Handler, HandlerError, Queue, Service, Topic
from framework.settings import RuntimeSettings

__all__ = [
    "Batch",
    "BrokerUnavailable",
    "Client",
    "ConfigurationError",
    "Context",
    "Envelope",
    "Handler",
    "HandlerError",
    "HandlerTimeout",
    "PayloadError",
    "Queue",
    "RetryAfter",
    "RetryPolicy",
    "Runtime",
    "RuntimeSettings",
    "Service",
    "SyncClient",
    "Topic",
    "converter",
]
