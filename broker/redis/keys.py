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
    <ns>:{<dest>:<p>}:g:<group>:inbox          zset    message ids (text): score < 0 leased to a running
                                                       handler until -score ms; score >= 0 processed at (ms,
                                                       final) for ids that are not UUIDv7/v8, and records
                                                       written before the buckets below (read until trimmed)
    <ns>:{<dest>:<p>}:g:<group>:inbox:info     hash    window = the group's dedup window, ms; fine, flat = 1:
                                                       the layouts its writers may use (inbox_layout_fields)
    <ns>:{<dest>:<p>}:g:<group>:inbox:<slot>   hash    r = the slot's bucket spans, n = ids recorded,
                                                       h = highest id time recorded
    <ns>:{<dest>:<p>}:g:<group>:inbox:<slot>:k set     the slot's bucket keys
    <ns>:{<dest>:<p>}:g:<group>:inbox:b:<S>:<t>
                                               hash    processed UUIDv7/v8 ids whose time >> S is t (hex):
                                                       field = id bytes 4..16 (13 bytes), value 1
    <ns>:{<dest>:<p>}:g:<group>:inbox:a:<S>:<t>
                                               string  the same, flat: the 13-byte fields one after another
                                                       (groups whose inbox:info says flat = 1: by default
                                                       every inbox a claim stores its window in first)
    <ns>:{<dest>:<p>}:g:<group>:attempts       hash    id -> attempts started on redeliveries (crash loops)
    <ns>:{<dest>:<p>}:g:<group>:lease          hash    the partition's owner in the group (lease.lua): owner =
                                                       instance ('' when released), token = fencing token (raised
                                                       by every acquisition, never reset), until / since = server
                                                       ms the lease ends / was acquired
    <ns>:members:<dest>:<group>                zset    live instances of the group on the destination (members.lua):
                                                       member = instance, score = server ms its heartbeat ends
    <ns>:workers                               hash    worker processes' heartbeats (worker_beat.lua): name ->
                                                       "<server ms seen>|<ttl ms>|<JSON groups and info>"
    <ns>:{<dest>:<p>}:scheduled                zset    scheduled messages (broker/redis/scheduling.py): member =
                                                       message id, score = due ms
    <ns>:{<dest>:<p>}:scheduled:envelopes      hash    message id -> cmsgpack of the entry's field/value list
    <ns>:{<dest>:<p>}:job                      hash    a recurring job's queue (partition 0): last = latest tick
                                                       fired (ms), fired = ticks fired (job_tick.lua)
    <ns>:scheduled                             zset    index of partitions holding scheduled messages: member =
                                                       "<dest>|<p>", score = a hint of the earliest due ms
    <ns>:{<dest>:<p>}:saga:<correlation id>    hash    a state of the state store (broker/redis/state.py): a saga
                                                       instance's on its queue <service>.saga.<name>
                                                       (framework/saga/): v = version, s = state JSON, t = pending
                                                       timeout ids; after completion v and done = 1, with an expiry

``<ns>`` (default ``fw``) separates deployments and test runs sharing one server.

The inbox's buckets (``broker/redis/lua/inbox_store.lua`` has the details): ``<slot>`` is the id's own
time >> 20 ms (17.5-minute slots, the id's first 7 hex digits); a bucket holds the ids of 2^S ms of
id time, S chosen per slot from the rate so a bucket holds about 64 ids. Ids are time-ordered, so a
batch's ids fall in a handful of buckets: one HMGET per bucket checks a batch, one HSET per bucket
records it, and a bucket stays in the server's compact listpack encoding (about 20 bytes per id,
against about 108 for a zset member). Every write sets the expiry of the keys it touched to the
window, so whole buckets expire a window after their last write.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence

import attrs

from broker.errors import ConfigurationError

__all__ = [
    "INBOX_SLOT_MS",
    "GroupKeys",
    "KeySpace",
    "PartitionKeys",
    "INBOX_HASHED",
    "compact_id",
    "hashed_generations",
    "hashed_record",
    "inbox_record",
    "inbox_records",
    "inbox_slot",
]

_NS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")

INBOX_SLOT_MS = 1 << 20
"""Milliseconds of id time one inbox slot covers (17.5 minutes)."""


_UUID78 = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[78][0-9a-fA-F]{3}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
INBOX_HASHED = 1
"""The 7th byte of the inbox record of an id that is not a UUIDv7/v8 (a hash; see :func:`inbox_record`)."""


INBOX_FINE_ENV = "FRAMEWORK_INBOX_FINE_BUCKETS"
INBOX_FLAT_ENV = "FRAMEWORK_INBOX_FLAT_BUCKETS"


def inbox_layout_fields() -> dict[str, str]:
    """The ``<inbox>:info`` fields a subscribe writes: ``fine`` (buckets finer than a millisecond for
    bursts) and ``flat`` (buckets kept as strings of 13-byte fields, ``broker/redis/lua/inbox_store.lua``),
    ``"1"`` where ``$FRAMEWORK_INBOX_FINE_BUCKETS`` / ``$FRAMEWORK_INBOX_FLAT_BUCKETS`` say on
    (``1``/``true``/``yes``/``on``), ``"0"`` where they say off (``0``/``false``/``no``/``off``); a
    group is left as it is where they are unset. Every worker of this release reads both layouts;
    workers of earlier releases cannot. So fine buckets stay off until the operator turns them on,
    and flat ones are on only for an inbox that is new: the first claim that stores the group's
    window (``inbox_lease.lua``) sets ``flat = 1`` unless a subscribe wrote ``0`` before it."""
    fields: dict[str, str] = {}
    for field, env in (("fine", INBOX_FINE_ENV), ("flat", INBOX_FLAT_ENV)):
        raw = os.environ.get(env, "").strip().lower()
        if raw in ("1", "true", "yes", "on"):
            fields[field] = "1"
        elif raw in ("0", "false", "no", "off"):
            fields[field] = "0"
    return fields


def compact_id(message_id: str) -> bytes:
    """The 16 bytes of a UUIDv7/v8 text id (8-4-4-4-12 hex digits, either case); ``b""`` for any
    other id. The inbox keeps these ids by their time (``broker/redis/lua/inbox_store.lua``)."""
    if len(message_id) != 36 or _UUID78.fullmatch(message_id) is None:
        return b""
    return bytes.fromhex(message_id.replace("-", ""))


def hashed_record(message_id: str) -> bytes:
    """The inbox record of an id that is not a UUIDv7/v8: the first 16 bytes of its SHA-1 with the
    7th byte set to :data:`INBOX_HASHED` (``broker/redis/lua/inbox_hashed.lua`` computes the same in
    Lua and states the collision odds)."""
    digest = hashlib.sha1(message_id.encode(), usedforsecurity=False).digest()
    return digest[:6] + b"\x01" + digest[7:16]


def inbox_records(message_ids: Sequence[str]) -> bytes:
    """The ids' 16-byte inbox records in one string, as the inbox scripts take them (:func:`inbox_record`)."""
    return inbox_records_spanned(message_ids)[0]


def inbox_records_spanned(message_ids: Sequence[str]) -> tuple[bytes, tuple[int, int] | None]:
    """:func:`inbox_records` and, when every id is a UUIDv7/v8 in lowercase (the framework's own),
    the lowest and highest id time (Unix ms) among them, else None: the inbox check skips reading
    the records one by one when nothing that old was recorded (``inbox_read.lua``)."""
    n = len(message_ids)
    joined = "".join(message_ids)
    # A fetched batch of the framework's own ids converts in a few C calls, not a call per id: every
    # id 36 characters with its dashes in place, version 7 or 8 and hex digits elsewhere gives
    # exactly compact_id's bytes.
    if (
        n
        and set(map(len, message_ids)) == {36}
        and joined.count("-") == 4 * n
        and joined[8::36].count("-") == n
        and joined[13::36].count("-") == n
        and joined[18::36].count("-") == n
        and joined[23::36].count("-") == n
        and not joined[14::36].strip("78")
    ):
        try:
            raw = bytes.fromhex(joined.replace("-", ""))
        except ValueError:  # not hex: per id below
            raw = b""
        if len(raw) == 16 * n:  # (fromhex skips whitespace: a shorter result means some id had some)
            if joined != joined.lower():  # (text order is time order only in one case)
                return raw, None
            lo, hi = min(message_ids), max(message_ids)
            return raw, (int(lo[:8] + lo[9:13], 16), int(hi[:8] + hi[9:13], 16))
    return b"".join([inbox_record(i) for i in message_ids]), None


def inbox_record(message_id: str) -> bytes:
    """One id's 16-byte inbox record: a UUIDv7/v8's own 16 bytes (:func:`compact_id`), else
    :func:`hashed_record`. The Lua scripts derive the same record from the id (``inbox_record_of``)."""
    return compact_id(message_id) or hashed_record(message_id)


def hashed_generations(raw: bytes | str | None) -> list[tuple[int, int, int]]:
    """The generations of an inbox's hashed ids (``<inbox>:h`` field ``g``, written by
    ``inbox_hashed.lua``): (start Unix ms, bits of the bucket number, ids recorded), oldest first."""
    if not raw:
        return []
    value = raw.decode() if isinstance(raw, bytes) else raw
    out = []
    for part in value.split(","):
        start, bits, count = part.split(":")
        out.append((int(start), int(bits), int(count)))
    return out


def inbox_slot(time_ms: int) -> str:
    """The name of the inbox slot that holds ids of ``time_ms`` (7 hex digits)."""
    return f"{time_ms >> 20:07x}"


@attrs.frozen
class PartitionKeys:
    """Keys of one partition of a destination."""

    destination: str
    partition: int
    stream: str
    published: str

    @property
    def scheduled(self) -> str:
        """Zset of the partition's scheduled messages (member = message id, score = due ms)."""
        return f"{self.stream}:scheduled"

    @property
    def scheduled_envelopes(self) -> str:
        """Hash of the scheduled messages' entries (message id -> cmsgpack of field/value list)."""
        return f"{self.stream}:scheduled:envelopes"

    @property
    def job(self) -> str:
        """Hash of a recurring job's state, on its queue's partition (job_tick.lua)."""
        return f"{self.stream}:job"

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
            lease=f"{base}:lease",
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
    lease: str


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

    @property
    def scheduled_index(self) -> str:
        """Zset of the partitions holding scheduled messages ("<dest>|<p>" -> earliest due ms, a hint)."""
        return f"{self.namespace}:scheduled"

    @property
    def workers(self) -> str:
        """Hash of worker processes' heartbeats (worker_beat.lua): name -> "<seen ms>|<ttl ms>|<JSON>"."""
        return f"{self.namespace}:workers"

    def members(self, destination: str, group: str) -> str:
        """Zset of the live instances of ``group`` on ``destination`` (partition ownership)."""
        return f"{self.namespace}:members:{destination}:{group}"

    def partition(self, destination: str, partition: int) -> PartitionKeys:
        """Keys of ``destination``'s partition number ``partition``."""
        stream = f"{self.namespace}:{{{destination}:{partition}}}"
        return PartitionKeys(
            destination=destination, partition=partition, stream=stream, published=f"{stream}:published"
        )
