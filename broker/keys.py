"""The Redis key layout, written down once.

Every key of one partition shares the hash tag ``{<destination>:<partition>}``, so Lua scripts and
MULTI that touch a stream and its group keys stay on one Cluster node::

    <ns>:destinations                          hash    name -> JSON DestinationSpec
    <ns>:subscriptions                         hash    "<destination>|<group>" -> JSON {start}
    <ns>:{<dest>:<p>}                          stream  the partition's messages
    <ns>:{<dest>:<p>}:published                zset    producer idempotency keys, score = expiry ms (time of
                                                       the publish that stored it + its dedup window); a repeat
                                                       is dropped while score > now. Expired members are removed
                                                       by later keyed publishes and by RedisBroker.trim; the zset
                                                       expires a minute after its last member (publish_once.lua)
    <ns>:{<dest>:<p>}:g:<group>:redeliver      stream  retries and redrives for that group only
    <ns>:{<dest>:<p>}:g:<group>:delayed        zset    delayed retries: member = JSON entry, score = due ms
    <ns>:{<dest>:<p>}:g:<group>:dlq            stream  the group's dead letters
    <ns>:{<dest>:<p>}:g:<group>:inbox          zset    message ids: score >= 0 processed at (ms, final);
                                                       score < 0 leased to a running handler until -score ms
    <ns>:{<dest>:<p>}:g:<group>:attempts       hash    id -> attempts started on redeliveries (crash loops)

``<ns>`` (default ``fw``) separates deployments and test runs sharing one server.
"""

from __future__ import annotations

import re

import attrs

from broker.errors import ConfigurationError

__all__ = ["GroupKeys", "KeySpace", "PartitionKeys"]

_NS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


@attrs.frozen
class PartitionKeys:
    """Keys of one partition of a destination."""

    destination: str
    partition: int
    stream: str
    published: str

    def group(self, group: str) -> GroupKeys:
        """Keys one consumer group keeps for this partition."""
        base = f"{self.stream}:g:{group}"
        return GroupKeys(
            partition=self,
            group=group,
            redeliver=f"{base}:redeliver",
            delayed=f"{base}:delayed",
            dlq=f"{base}:dlq",
            inbox=f"{base}:inbox",
            attempts=f"{base}:attempts",
        )


@attrs.frozen
class GroupKeys:
    """Keys of one consumer group on one partition (all share the partition's hash tag)."""

    partition: PartitionKeys
    group: str
    redeliver: str
    delayed: str
    dlq: str
    inbox: str
    attempts: str


@attrs.frozen
class KeySpace:
    """Builds key names under one namespace."""

    namespace: str = "fw"

    def __attrs_post_init__(self) -> None:
        if not _NS.match(self.namespace):
            raise ConfigurationError(f"invalid namespace {self.namespace!r}: use letters, digits, '.', '_' or '-'")

    @property
    def destinations(self) -> str:
        """Registry hash of declared destinations."""
        return f"{self.namespace}:destinations"

    @property
    def subscriptions(self) -> str:
        """Registry hash of (destination, group) pairs."""
        return f"{self.namespace}:subscriptions"

    def partition(self, destination: str, partition: int) -> PartitionKeys:
        """Keys of ``destination``'s partition number ``partition``."""
        stream = f"{self.namespace}:{{{destination}:{partition}}}"
        return PartitionKeys(
            destination=destination, partition=partition, stream=stream, published=f"{stream}:published"
        )
