"""Transports: envelopes, their codec, the Broker contract, and one package per transport.

``broker.redis`` (Redis Streams, the embedded Valkey) and ``broker.memory`` (in-process, for users'
unit tests) implement the contract of :mod:`broker.protocol`; :func:`connect` picks one by URL
scheme. This package knows nothing of services or handlers; ``framework`` builds on it and
``spark_bridge`` reads the same streams through it.
"""

from broker.connect import connect, default_namespace, redact, resolve_url
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
from broker.protocol import Broker, Delivery, GroupPartition, GuardedWrite, Start
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
    "Envelope",
    "GroupPartition",
    "GuardedWrite",
    "Kind",
    "MessageTooLarge",
    "PermissionDenied",
    "Start",
    "connect",
    "default_namespace",
    "derive_id",
    "id_time_ms",
    "new_id",
    "now_ms",
    "redact",
    "resolve_url",
    "validate_name",
]
