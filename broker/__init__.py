"""Transport: envelopes, their codec, the Broker contract and its Redis Streams implementation.

This package knows nothing of services or handlers; ``framework`` builds on it and ``spark_bridge``
reads the same streams through it.
"""

from broker.connect import connect, default_namespace, redact, resolve_url
from broker.embedded import EmbeddedServer, ServerStatus, default_data_dir, framework_home
from broker.envelope import COMMAND, EVENT, Envelope, Kind, now_ms
from broker.errors import (
    BrokerError,
    BrokerUnavailable,
    ConfigurationError,
    DecodeError,
    EffectsFailed,
    LeaseLost,
    MessageTooLarge,
    PermissionDenied,
)
from broker.ids import derive_id, id_time_ms, new_id
from broker.keys import GroupKeys, KeySpace, PartitionKeys
from broker.protocol import Broker, Delivery, GroupPartition, GuardedWrite, Start
from broker.redis_broker import RedisBroker
from broker.topology import DEFAULT_RETENTION_MS, DestinationSpec, validate_name

__all__ = [
    "COMMAND",
    "DEFAULT_RETENTION_MS",
    "EVENT",
    "Broker",
    "BrokerError",
    "BrokerUnavailable",
    "ConfigurationError",
    "DecodeError",
    "Delivery",
    "DestinationSpec",
    "EffectsFailed",
    "LeaseLost",
    "EmbeddedServer",
    "Envelope",
    "GroupKeys",
    "GroupPartition",
    "GuardedWrite",
    "KeySpace",
    "Kind",
    "MessageTooLarge",
    "PartitionKeys",
    "PermissionDenied",
    "RedisBroker",
    "ServerStatus",
    "Start",
    "connect",
    "default_data_dir",
    "default_namespace",
    "derive_id",
    "framework_home",
    "id_time_ms",
    "new_id",
    "now_ms",
    "redact",
    "resolve_url",
    "validate_name",
]
