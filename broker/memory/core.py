"""State every role of the memory broker shares: its server, namespace, caches, and helpers over streams."""

from __future__ import annotations

import re
from collections.abc import Iterable

import anyio.lowlevel
import attrs

from broker.codec import decode_flat
from broker.codec import max_body_bytes as max_body_bytes_setting
from broker.errors import ConfigurationError, DecodeError, LeaseLost
from broker.memory.server import MemoryServer, Registry
from broker.memory.streams import EntryId, Group, Stream, format_id, parse_id
from broker.protocol import Delivery, GroupPartition
from broker.topology import DestinationSpec

__all__ = ["MemoryCore", "MemoryKeys", "as_bytes", "flatten", "lease_lost"]

_NS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


@attrs.frozen
class MemoryKeys:
    """The names one group's view of one partition uses (``GroupPartition.keys`` of the memory transport)."""

    stream: str  # the partition's log, shared by every group of a topic
    group: str
    redeliver: str  # retries and redrives for this group only
    dlq: str  # the group's dead letters


def as_bytes(value: object) -> bytes:
    """A value as Redis stores it: bytes as they are, text UTF-8, numbers in decimal."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bool):
        raise TypeError("a bool cannot be stored: convert it to bytes, a string or a number first")
    if isinstance(value, int):
        return str(value).encode()
    if isinstance(value, float):
        return repr(value).encode()
    raise TypeError(f"a {type(value).__name__} cannot be stored: convert it to bytes, a string or a number first")


def flatten(fields: Iterable[object]) -> list[bytes]:
    """A field/value argument list as stored (:func:`broker.codec.encode_fields`' output as a Delivery's ``raw``)."""
    return [as_bytes(v) for v in fields]


def lease_lost(source: GroupPartition, outcome: str) -> LeaseLost:
    """The error of a call refused by the fencing check (another instance holds the lease)."""
    return LeaseLost(
        f"partition {source.partition} of {source.spec.name!r} is owned by another instance of {source.group!r} now "
        f"(this instance's lease expired): {outcome}"
    )


class MemoryCore:
    """The shared state of one memory broker; every role mixin builds on it (as ``broker.redis.core.RedisCore``)."""

    transport = "memory"

    def __init__(
        self, server: MemoryServer, *, namespace: str = "fw", url: str = "memory://", max_body_bytes: int | None = None
    ) -> None:
        """``max_body_bytes``: largest body :meth:`publish` accepts and consumers read (default
        ``$FRAMEWORK_MAX_BODY_BYTES``, else 1 MiB); larger stored ones decode as errors (dead-lettered)."""
        if not _NS.match(namespace):
            raise ConfigurationError(f"invalid namespace {namespace!r}: use letters, digits, '.', '_' or '-'")
        self.server = server
        self.url = url
        self.max_body_bytes = max_body_bytes_setting(max_body_bytes)
        self._namespace = namespace
        self._specs: dict[str, DestinationSpec] = {}  # registry cache, as the Redis broker's
        self._claim_cursor: dict[tuple[str, str], str] = {}  # (stream, group) -> XAUTOCLAIM cursor
        self.closed = False

    @property
    def namespace(self) -> str:
        """Separates deployments (and test runs) on one server, as a key prefix does on Redis."""
        return self._namespace

    @property
    def registry(self) -> Registry:
        """This namespace's registry on the server."""
        return self.server.registry(self._namespace)

    async def close(self) -> None:
        """Forget this broker's caches (the server's state stays for the other brokers of the process)."""
        self._specs.clear()
        self._claim_cursor.clear()
        self.closed = True

    def partition_stream(self, destination: str, partition: int) -> str:
        """The name of ``destination``'s partition log."""
        return f"{self._namespace}:{destination}:{partition}"

    @staticmethod
    async def _checkpoint() -> None:
        """Let other tasks run (every call of a real transport waits for the server)."""
        await anyio.lowlevel.checkpoint()

    def _group_of(self, stream: str, group: str) -> tuple[Stream, Group]:
        """``stream`` and its consumer group ``group``; ``ConfigurationError`` when either does not exist
        (Redis answers NOGROUP: the group was never subscribed, or was unsubscribed)."""
        found = self.server.streams.get(stream)
        state = found.groups.get(group) if found is not None else None
        if found is None or state is None:
            raise ConfigurationError(
                f"NOGROUP: no consumer group {group!r} on stream {stream!r}: subscribe the group first "
                "(or it was unsubscribed)"
            )
        return found, state

    def _pending_in(self, stream: str, group: str, entry_id: str) -> tuple[Stream, Group, EntryId] | None:
        """Where a delivery's entry is pending for ``group`` (the settle scripts' XPENDING), or None when it is not."""
        found, state = self._group_of(stream, group)
        entry = parse_id(entry_id)
        return (found, state, entry) if entry in state.pel else None

    def _fence(self, source: GroupPartition, token: int | None) -> None:
        """The settle scripts' fencing check: ``LeaseLost`` when ``token`` is not the lease's current one."""
        if token is not None and self.server.lease(source.stream, source.group).token != token:
            raise lease_lost(source, "nothing was settled; the new owner delivers the entries again")

    def _holder(self, source: GroupPartition, consumer: str, token: int | None) -> None:
        """owned_intake.lua's check: with ``token``, only the lease's holder under it takes entries."""
        if token is None:
            return
        lease = self.server.lease(source.stream, source.group)
        if lease.owner != consumer or lease.token != token:
            raise lease_lost(source, "nothing was read or claimed")

    def _delivery(self, source: GroupPartition, stream: Stream, entry: EntryId, count: int = 1) -> Delivery:
        """The delivery of one entry of ``stream`` (decoded as the Redis broker decodes)."""
        eid = format_id(entry)
        flat = stream.entries.get(entry)
        if flat is None:  # deleted from the stream while pending
            return Delivery(source, stream.name, eid, [], None, "entry was deleted while pending", count)
        raw = list(flat)
        try:
            env = decode_flat(raw, source.spec.name, source.spec.kind, self.max_body_bytes)
        except DecodeError as exc:
            return Delivery(source, stream.name, eid, raw, None, str(exc), count)
        return Delivery(source, stream.name, eid, raw, env, None, count)
