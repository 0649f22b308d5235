"""The RabbitMQ layout of one namespace: every exchange, queue and routing key the transport uses.

Written once here (as ``broker/redis/keys.py`` is for Redis)::

    {ns}/events                      topic exchange: events, routing key "{destination}.{partition}"
    {ns}/q/{dest}/{p}                quorum queue: a queue destination's partition (its one group reads it)
    {ns}/e/{dest}/{p}/{group}        quorum queue: one subscribing group's copy of a topic partition
    {queue}/dlq                      classic queue: the dead letters of the group reading {queue}
    {ns}/registry                    stream: destination and subscription records (read from the start)
    {ns}/runs                        stream: redelivered runs of messages started (crash-loop counts), kept a day
    {ns}/delay/{k}                   topic exchange of delay level k (0..27): bit k of the delay set -> queue
    {ns}/delay/{k}/q                 quorum queue, message TTL 2**k units, dead-letters to level k-1
    {ns}/delivery                    topic exchange the delay chain ends in: routes by target to queues

A delayed message's routing key is its delay in units as 28 words ("0"/"1", bit 27 first) followed by
its target: a queue's own name (a retry for its group, a scheduled command), or ``{ns}/t/{dest}/{p}``
(a scheduled event: every group queue of that topic partition is bound to it). Names longer than
a delay routing key's room (199 bytes) are shortened with a CRC-32 suffix.
"""

from __future__ import annotations

import zlib

__all__ = [
    "DELAY_LEVELS",
    "DELAY_UNIT_MS",
    "Layout",
    "delay_bits",
    "short",
]

DELAY_LEVELS = 28
"""Levels of the delay chain: delays up to 2**28 units (about 310 days at 100 ms)."""
DELAY_UNIT_MS = 100
"""The delay chain's resolution: a delay is rounded up to a multiple of it."""

_MAX = 255  # AMQP short string: queue, exchange names and routing keys
_TARGET = _MAX - 2 * DELAY_LEVELS  # a queue name must fit in a delay routing key after the delay's words


def short(name: str, limit: int = _MAX) -> str:
    """``name``, or its head with a CRC-32 suffix when it is longer than ``limit`` bytes."""
    raw = name.encode()
    if len(raw) <= limit:
        return name
    tag = f"~{zlib.crc32(raw):08x}"
    return raw[: limit - len(tag)].decode(errors="ignore") + tag


def delay_bits(delay_ms: int) -> str:
    """The 28 routing-key words of a delay (rounded up to whole units, capped at the chain's maximum)."""
    units = min(max(-(-delay_ms // DELAY_UNIT_MS), 0), 2**DELAY_LEVELS - 1)
    return ".".join("1" if units >> k & 1 else "0" for k in range(DELAY_LEVELS - 1, -1, -1))


class Layout:
    """The names of one namespace's exchanges and queues (no server call)."""

    def __init__(self, namespace: str) -> None:
        self.ns = namespace
        self.events = f"{namespace}/events"
        self.registry = f"{namespace}/registry"
        self.runs = f"{namespace}/runs"
        self.delivery = f"{namespace}/delivery"

    def queue(self, destination: str, partition: int) -> str:
        """A queue destination's partition queue."""
        return short(f"{self.ns}/q/{destination}/{partition}", _TARGET)

    def group_queue(self, destination: str, partition: int, group: str) -> str:
        """A topic partition's queue of one subscribing group."""
        return short(f"{self.ns}/e/{destination}/{partition}/{group}", _TARGET)

    def dlq(self, queue: str) -> str:
        """The dead-letter queue of the group reading ``queue``."""
        return f"{queue}/dlq"

    @staticmethod
    def event_key(destination: str, partition: int) -> str:
        """The routing key of a topic partition's events on the events exchange."""
        return f"{destination}.{partition}"

    def topic_target(self, destination: str, partition: int) -> str:
        """The delay chain's target standing for every group of a topic partition."""
        return short(f"{self.ns}/t/{destination}/{partition}", _TARGET)

    def delay_exchange(self, level: int) -> str:
        """Level ``level``'s exchange (the chain's entry is the top level)."""
        return f"{self.ns}/delay/{level}"

    def delay_queue(self, level: int) -> str:
        """Level ``level``'s queue (message TTL 2**level units)."""
        return f"{self.ns}/delay/{level}/q"

    @staticmethod
    def delivery_binding(target: str) -> str:
        """The binding key on the delivery exchange that picks messages for ``target``."""
        return "*." * DELAY_LEVELS + target

    @staticmethod
    def delay_key(delay_ms: int, target: str) -> str:
        """The routing key sending a message into the delay chain for ``delay_ms`` towards ``target``."""
        return f"{delay_bits(delay_ms)}.{target}"
