"""Destinations (queues and topics), their partitions and retention, and the names allowed."""

from __future__ import annotations

import re
import zlib
from typing import Any

import attrs

from broker.envelope import COMMAND, EVENT, Kind
from broker.errors import ConfigurationError

__all__ = [
    "DEFAULT_RETENTION_MS",
    "DestinationSpec",
    "kind_mismatch",
    "validate_name",
]

DEFAULT_RETENTION_MS = 7 * 24 * 3600 * 1000  # topics keep a week of events unless told otherwise

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


def validate_name(what: str, name: str) -> str:
    """Return ``name`` if it is a valid destination/group/service name, else raise a clear error."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigurationError(
            f"invalid {what} name {name!r}: use 1-200 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return name


def kind_mismatch(destination: str, kind: Kind) -> ConfigurationError:
    """The error for a ``kind`` message to ``destination``, which is declared with the other kind."""
    verb = "send() a command to" if kind == "command" else "publish() an event to"
    declared = "topic" if kind == "command" else "queue"
    return ConfigurationError(f"cannot {verb} {destination!r}: it is declared as a {declared}")


@attrs.frozen
class DestinationSpec:
    """A queue (``command``) or topic (``event``) and how it is laid out.

    ``partitions`` streams carry it; a message's key picks one by a stable hash (CRC-32), so
    messages with one key stay in one partition, in order. Topics keep events for
    ``retention_ms`` and/or at most ``max_length`` per partition (trimmed only below what every
    group has acknowledged); queues delete an entry once it is acknowledged.
    """

    name: str
    kind: Kind
    partitions: int = 1
    retention_ms: int | None = DEFAULT_RETENTION_MS
    max_length: int | None = None

    def __attrs_post_init__(self) -> None:
        validate_name("destination", self.name)
        if self.kind not in (COMMAND, EVENT):
            raise ConfigurationError(f"destination {self.name!r}: kind must be 'command' or 'event'")
        if not 1 <= self.partitions <= 1024:
            raise ConfigurationError(f"destination {self.name!r}: partitions must be 1..1024")

    @property
    def is_topic(self) -> bool:
        """True for topics (events retained, one group per subscribing service)."""
        return self.kind == EVENT

    def partition_for(self, key: str | None, message_id: str) -> int:
        """Partition of a message: by its key when it has one, else spread by its id."""
        if self.partitions == 1:
            return 0
        return zlib.crc32((key if key is not None else message_id).encode()) % self.partitions

    def to_json(self) -> dict[str, object]:
        """Plain dict for the registry."""
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, object]) -> DestinationSpec:
        """Inverse of :meth:`to_json`; unknown fields (from newer versions) are ignored."""
        fields = {f.name for f in attrs.fields(cls)}
        known: dict[str, Any] = {k: v for k, v in data.items() if k in fields}  # as to_json wrote them
        return cls(**known)
