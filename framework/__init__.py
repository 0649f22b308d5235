"""Event-driven microservices on Redis Streams.

Write services as decorated handlers, run them with ``framework run module:service``::

    from framework import Service, Context

    billing = Service("billing")

    @billing.event("orders.placed")
    async def charge(event: OrderPlaced, ctx: Context) -> None:
        ctx.publish("payments.captured", PaymentCaptured(event.order_id))

This module is the public surface: every name in ``__all__`` is imported from here, and only
from here. The features a service needs beyond it are packages named for them:
:mod:`framework.dead_letters` (list, redrive, purge), :mod:`framework.outbox` (messages that
commit with your rows), :mod:`framework.sql` (engines for the outbox and SQL effects),
:mod:`framework.testing` (run services against a real server until idle) and
:mod:`framework.observability` (traces, metrics, log context). Every other module is
internal and may change without notice.

Layers: a module imports only from its own layer or the layers below it, and no import forms a
circle, counting imports inside functions and under ``TYPE_CHECKING`` (``tests/layers.py``).
From the bottom: leaf helpers (``_payloads``, ``retries``, ``settings``, ``sql``, ``logs``,
``subscriptions`` with topic patterns and filters, ``handlers`` with Queue/Topic/Handler,
``outcomes``, ``_messages``, ``replies``, ``scheduling``, the outbox tables in ``outbox.schema``)
-> ``observability`` (tracing, metrics, the consumer's observer, the ``hooks`` switches, log
context) and ``logconfig`` -> the database ``outbox`` and its relay -> handler effects
(``group_commit``, ``effects``) and the requester (``requests``) -> the handler ``context`` and
``middleware``
-> ``saga`` -> ``service`` -> ``client``, ``inbox``, ``dead_letters`` and the actor ``runtime``
-> the operators' ``operations`` and ``dashboard`` -> ``testing``, ``cli`` and this module. A lower
module that needs a higher one's object gets it passed in, typed by a small Protocol of its own
(``_sql_block.SqlRun`` for the context,
``saga.steps.SagaService`` for the service, ``runtime.ownership.PartitionRunner`` for the consumer).
"""

from broker import BrokerUnavailable, ConfigurationError, Envelope, MessageTooLarge
from framework._destinations import NewDestinationWarning, UnknownDestination
from framework._payloads import PayloadError, converter
from framework.batch_context import BatchContext
from framework.batching import BatchAborted, BatchFailed, BatchPolicy
from framework.client import Batch, Client, SyncClient
from framework.context import Context
from framework.lifespan import Resource, StartupError
from framework.middleware import CallNext, InboundMessage, Middleware, Outcome
from framework.observability import enable_metrics, enable_tracing
from framework.requests import ReplyDecodeError, RequestError, RequestFailed, RequestTimeout
from framework.retries import HandlerTimeout, RetryAfter, RetryPolicy
from framework.runtime import Runtime
from framework.saga import Saga, SagaContext
from framework.service import HandlerError, Queue, Service, Topic
from framework.settings import RuntimeSettings
from framework.subscriptions import Filter, MessageInfo

__all__ = [
    # writing services
    "Service",
    "Queue",
    "Topic",
    "Context",
    "HandlerError",
    # which of a topic's events a handler takes, judged before decoding (docs/patterns-and-filters.md)
    "Filter",
    "MessageInfo",
    # lifespan: resources opened once per worker process (svc.resource, ctx.resources[r]), hooks
    "Resource",
    "StartupError",
    # batch handlers: a list of messages per call, settled per message
    "BatchPolicy",
    "BatchFailed",
    "BatchAborted",
    "BatchContext",
    # process managers: state per correlation id, one message per saga at a time
    "Saga",
    "SagaContext",
    # retries
    "RetryPolicy",
    "RetryAfter",
    "HandlerTimeout",
    # sending from outside handlers
    "Client",
    "SyncClient",
    "Batch",
    "UnknownDestination",
    "NewDestinationWarning",
    # request/reply: client.request(...) / ctx.request(...)
    "RequestError",
    "RequestTimeout",
    "RequestFailed",
    "ReplyDecodeError",
    # running
    "Runtime",
    "RuntimeSettings",
    # payloads and messages
    "converter",
    "PayloadError",
    "Envelope",
    # errors the broker raises through the framework
    "BrokerUnavailable",
    "ConfigurationError",
    "MessageTooLarge",
    # middleware: code around every handler attempt
    "Middleware",
    "CallNext",
    "InboundMessage",
    "Outcome",
    # observability: OpenTelemetry traces and metrics (or the OTEL_* environment variables)
    "enable_tracing",
    "enable_metrics",
]
