"""The RabbitMQ broker's publishing role: confirmed, mandatory publishes, partitions by key, delayed messages.

Every publish waits for the server's confirm (``publisher_confirms``) and is ``mandatory`` with
returns raised (``on_return_raises``): a command no queue takes fails instead of vanishing. An
event no group subscribes to is returned by the server too: it reaches nobody, as no queue keeps
it (no retention on RabbitMQ), and that is not an error. Messages of one publish call go out on one
channel in order, confirmed together. A message whose ``deliver-at`` header lies ahead enters the
delay chain (:mod:`broker.rabbitmq.names`) and reaches its queue (a topic's: every group's) when
due, rounded up to the chain's 100 ms; with a schedule beside the server (the Redis one,
:mod:`broker.rabbitmq.scheduling`) it is stored there instead, where it can be listed and cancelled,
and published by a mover when due. Idempotency keys are not checked: a repeated key is stored
again (consumers' inboxes drop the copy).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence

import aio_pika
import aio_pika.abc

from broker.codec import check_body_size
from broker.envelope import Envelope, now_ms
from broker.errors import BrokerError, MessageTooLarge
from broker.headers import IDEMPOTENCY_KEY
from broker.rabbitmq.core import to_message
from broker.rabbitmq.inbox import Inboxes
from broker.rabbitmq.names import DELAY_LEVELS
from broker.rabbitmq.side import SideSchedule
from broker.scheduling import due_of
from broker.topology import DestinationSpec

__all__ = ["Publishing"]

_SERVER_LIMIT = re.compile(r"message size (\d+) is larger than configured max size (\d+)")
"""The server's refusal of a message over its ``max_message_size`` (the channel is closed with it)."""


class Publishing(Inboxes):
    """Publishes envelopes to their partition queues or topic exchange (or the delay chain)."""

    side_schedule: SideSchedule | None = None

    async def publish(self, envelopes: Sequence[Envelope], *, dedup_window_ms: int | None = None) -> list[str | None]:
        """Publish envelopes in order, each confirmed; return their ids (the entry ids reads give).

        ``MessageTooLarge`` (a body over :attr:`max_body_bytes`) or a bad ``deliver-at`` is raised
        before anything is sent. ``dedup_window_ms`` and idempotency keys are not honoured here, except
        by messages due later kept by the schedule beside the server (None for a repeated key's).
        """
        return await self._publish(envelopes, dedup_window_ms, hold=True)

    async def _publish(
        self, envelopes: Sequence[Envelope], dedup_window_ms: int | None, *, hold: bool
    ) -> list[str | None]:
        """:meth:`publish`; ``hold=False`` sends every message now, whatever its ``deliver-at`` (the
        schedule's mover forwarding due ones)."""
        if not envelopes:
            return []
        for env in envelopes:
            check_body_size(env, self.max_body_bytes)
        now = now_ms()
        plan: list[tuple[str, str, aio_pika.Message, bool]] = []  # exchange, routing key, message, topic
        chain = False
        later: dict[DestinationSpec, list[Envelope]] = {}  # due later, kept by the schedule beside the server
        for env in envelopes:
            spec = self._specs.get(env.destination)
            if spec is None or spec.kind != env.kind:
                spec = await self.route(env.destination, env.kind)
            idem = env.headers.get(IDEMPOTENCY_KEY) if env.headers else None
            partition = spec.partition_for(env.key, idem or env.id)
            due = due_of(env) if env.headers and hold else None
            if due is not None and due > now and self.side_schedule is not None:
                later.setdefault(spec, []).append(env)
                continue
            if spec.is_topic:
                target = self.layout.topic_target(spec.name, partition)
                exchange, key = self.layout.events, self.layout.event_key(spec.name, partition)
            else:
                target = exchange = ""
                key = target = self.layout.queue(spec.name, partition)
            if due is not None and due > now:
                chain = True
                exchange, key = self.layout.delay_exchange(DELAY_LEVELS - 1), self.layout.delay_key(due - now, target)
            plan.append((exchange, key, to_message(env), spec.is_topic))
        if chain:
            await self._ensure_delay_chain()
        if plan:
            channel = await self._channel("publish", confirms=True)
            await self._send(channel, plan)
        if later and self.side_schedule is not None:  # only then is anything in later
            stored: dict[str, str | None] = {}
            for spec, waiting in later.items():
                kept = await self.side_schedule.store(spec, waiting, dedup_window_ms)
                stored.update(zip((e.id for e in waiting), kept, strict=True))
            return [stored.get(env.id, env.id) for env in envelopes]
        return [env.id for env in envelopes]

    async def _send(
        self, channel: aio_pika.abc.AbstractChannel, plan: Sequence[tuple[str, str, aio_pika.Message, bool]]
    ) -> None:
        """Publish every planned message on ``channel`` (pipelined, in order) and wait for all confirms;
        a returned event (no group subscribed) is not an error, anything else returned or refused is."""
        exchanges: dict[str, aio_pika.abc.AbstractExchange] = {}
        for name in {p[0] for p in plan}:
            exchanges[name] = channel.default_exchange if name == "" else await channel.get_exchange(name, ensure=False)
        sends = [exchanges[ex].publish(msg, key, mandatory=True, timeout=self.timeout) for ex, key, msg, _ in plan]
        results = await asyncio.gather(*sends, return_exceptions=True)
        for (_, key, _, topic), result in zip(plan, results, strict=True):
            if isinstance(result, aio_pika.exceptions.PublishError):  # returned: no queue is bound to its key
                if topic:
                    continue  # an event nobody subscribes to: delivered to nobody
                raise BrokerError(
                    f"RabbitMQ returned a message for {key!r}: no queue takes it (deleted?); "
                    "declare the destination again (restart its service) and resend"
                ) from result
            if isinstance(result, aio_pika.exceptions.DeliveryError):
                raise BrokerError(
                    f"RabbitMQ refused a message for {key!r} (nack): a queue is full or the server "
                    "is under a memory or disk alarm; the message was not stored, send it again later"
                ) from result
            if isinstance(result, TimeoutError):
                raise TimeoutError(
                    f"RabbitMQ did not confirm a message for {key!r} within {self.timeout:g} s: a memory or disk "
                    "alarm may be blocking publishers (rabbitmqctl status), or the server is overloaded; it may or "
                    "may not be stored: send it again (consumers' inboxes drop a copy)"
                ) from result
            if isinstance(result, BaseException):
                too_large = _SERVER_LIMIT.search(str(result))
                if too_large is not None:
                    size, limit = int(too_large[1]), int(too_large[2])
                    raise MessageTooLarge(key, size, limit, server="RabbitMQ") from result
                raise result
