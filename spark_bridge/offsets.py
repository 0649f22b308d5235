"""Where a read starts and stops in each partition stream: resolving positions, latest ids, read limits.

An offset, as Spark checkpoints it, is ``{topic: {partition: {"id": ..., "n": ...}}}``: ``id`` is
the last entry id read (``"0-0"`` before anything) and ``n`` how many entries the stream had
received up to it (XINFO's ``entries-added`` counts every entry ever added). Retention trims a
stream from its head, so ``entries-added - length`` is how many entries were deleted: when that
exceeds ``n``, events the query had not read are gone (see :mod:`spark_bridge.fetch`). ``n`` is
None on Redis 6.2, which does not count, and there gaps cannot be detected.

Everything here runs on the driver with a plain (sync) redis-py client and reads stream metadata;
counting entries (``maxEventsPerTrigger``, a start given as a time or id) runs in a small Lua
script on the server, in bounded chunks, so entries never cross the wire just to be counted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson
import redis
from redis.exceptions import ResponseError

from broker.errors import BrokerUnavailable, ConfigurationError
from broker.redis.keys import KeySpace
from broker.redis.sync_client import sync_client
from broker.topology import DestinationSpec
from spark_bridge.options import Position

__all__ = [
    "MAX_SEQ",
    "Offsets",
    "StreamInfo",
    "SyncClient",
    "before",
    "cap",
    "fair_shares",
    "id_key",
    "is_cluster_client",
    "limit_by_count",
    "load_topics",
    "open_client",
    "resolve",
    "stream_info",
]

MAX_SEQ = 2**64 - 1
SyncClient = redis.Redis | redis.RedisCluster
"""What :func:`open_client` returns: a single-server or a Cluster client."""
Offsets = dict[str, dict[str, dict[str, Any]]]
"""``{topic: {partition: {"id": last entry id read, "n": entries the stream had received up to it}}}``."""

_COUNT_CHUNK = 100_000  # entries counted per script call: keeps each call to some tens of milliseconds

# KEYS[1] a partition stream; ARGV[1] exclusive start id, ARGV[2] inclusive end id, ARGV[3] at most
# this many entries. Returns {count, id of the last of them (or false)}: counting on the server
# keeps entries off the wire when the driver only needs to know where N events end.
_SEEK = """
local r = redis.call('XRANGE', KEYS[1], '(' .. ARGV[1], ARGV[2], 'COUNT', tonumber(ARGV[3]))
if #r == 0 then return {0, false} end
return {#r, r[#r][1]}
"""


def id_key(entry_id: str) -> tuple[int, int]:
    """Sort key of a stream entry id (``"ms-seq"`` or ``"ms"``)."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def before(entry_id: str) -> str:
    """The largest id below ``entry_id`` (so that reading after it starts at ``entry_id``)."""
    ms, seq = id_key(entry_id)
    if seq > 0:
        return f"{ms}-{seq - 1}"
    return f"{ms - 1}-{MAX_SEQ}" if ms > 0 else "0-0"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _later(a: str, b: str) -> str:
    return a if id_key(a) >= id_key(b) else b


def _earlier(a: str, b: str) -> str:
    return a if id_key(a) <= id_key(b) else b


def _raw(response: Any, **_: Any) -> Any:
    return response


def open_client(url: str, *, cluster: bool | None = None) -> SyncClient:
    """A sync client answering in RESP2 lists (the caller parses stream replies itself).

    A ``redis.RedisCluster`` when the server is a Cluster node (``cluster`` skips asking when the
    caller knows): every command on one partition stream goes to the node owning its slot.
    """
    client: Any = sync_client(url, cluster=cluster, protocol=2, socket_connect_timeout=5, socket_keepalive=True)
    # A cluster client parses replies on each node's client first: the raw callbacks go there.
    targets = [n.redis_connection for n in client.get_nodes()] if isinstance(client, redis.RedisCluster) else [client]
    for target in targets:
        for command in ("XRANGE", "XREVRANGE", "XINFO STREAM"):
            target.set_response_callback(command, _raw)
    return client


def is_cluster_client(client: Any) -> bool:
    """Whether ``client`` (from :func:`open_client`) talks to a Redis Cluster."""
    return isinstance(client, redis.RedisCluster)


def _queue_seek(pipe: Any, sha: str, stream: str, after: str, until: str, count: int) -> None:
    """Queue a call of ``_SEEK`` (loaded as ``sha``) on a pipeline of either client: redis-py's
    cluster pipeline refuses ``Script`` objects and ``evalsha()``, but routes EVALSHA by its key."""
    pipe.execute_command("EVALSHA", sha, 1, stream, after, until, count)


def load_topics(client: SyncClient, namespace: str, topics: Sequence[str], url: str) -> dict[str, DestinationSpec]:
    """The registered spec of each topic; raise naming unknown topics, queues, or an unreachable broker."""
    keyspace = KeySpace(namespace)
    try:
        raw = client.hgetall(keyspace.destinations)
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        from broker.connect import redact

        raise BrokerUnavailable(
            f"cannot reach the broker at {redact(url)}: {str(exc).rstrip('.')}. Start one (`framework server start`, "
            "or `redis-server --port 6379` and REDIS_URL=redis://127.0.0.1:6379/0), or point to the right server "
            "(REDIS_URL, the url option, spark_bridge.register(spark, url=...), or --redis-url)"
        ) from None
    specs = {k.decode(): DestinationSpec.from_json(orjson.loads(v)) for k, v in raw.items()}
    missing = [t for t in topics if t not in specs]
    if missing:
        known = ", ".join(sorted(n for n, s in specs.items() if s.is_topic)) or "none"
        raise ConfigurationError(
            f"unknown topic(s) {', '.join(missing)} in namespace {namespace!r}; known topics: {known}. "
            "A topic exists once a service declared or published to it; check the name and the namespace option."
        )
    queues = [t for t in topics if not specs[t].is_topic]
    if queues:
        raise ConfigurationError(
            f"{', '.join(queues)}: a queue, not a topic. The Spark bridge reads topics (events), whose "
            "entries are retained; queue entries are deleted as soon as their consumer acknowledges them."
        )
    return {t: specs[t] for t in topics}


class StreamInfo:
    """What XINFO STREAM says of one partition stream (an absent stream reads as empty and never written)."""

    __slots__ = ("added", "exists", "first", "last", "length", "max_deleted")

    def __init__(self, reply: Any) -> None:
        self.exists = not isinstance(reply, Exception)
        self.first = self.last = self.max_deleted = "0-0"
        self.length = 0
        self.added: int | None = 0
        if not self.exists:
            return
        fields = {reply[i].decode(): reply[i + 1] for i in range(0, len(reply), 2)}
        self.length = int(fields["length"])
        self.last = fields["last-generated-id"].decode()
        added = fields.get("entries-added")  # Redis >= 7.0 and Valkey; absent on 6.2
        self.added = int(added) if added is not None else None
        deleted = fields.get("max-deleted-entry-id")  # XDEL only: trimming does not move it
        self.max_deleted = deleted.decode() if deleted is not None else "0-0"
        first = fields.get("first-entry")
        self.first = first[0].decode() if first else self.last

    @property
    def deleted(self) -> int | None:
        """Entries deleted from the stream so far (retention trims from the head), None if unknown."""
        return None if self.added is None else self.added - self.length

    @property
    def has_holes(self) -> bool:
        """True when XDEL removed entries among the retained ones, so ``deleted`` is not all at the head."""
        return self.length > 0 and self.max_deleted != "0-0" and id_key(self.max_deleted) >= id_key(self.first)


def stream_info(client: SyncClient, streams: Sequence[str]) -> list[StreamInfo]:
    """XINFO STREAM of every stream in one round trip."""
    pipe = client.pipeline(transaction=False)
    for stream in streams:
        pipe.execute_command("XINFO STREAM", stream)
    replies = pipe.execute(raise_on_error=False)
    for reply in replies:
        if isinstance(reply, Exception) and not (isinstance(reply, ResponseError) and "no such key" in str(reply)):
            raise reply
    return [StreamInfo(r) for r in replies]


def _partitions(specs: Mapping[str, DestinationSpec], keyspace: KeySpace) -> list[tuple[str, str, str]]:
    return [(t, str(p), keyspace.partition(t, p).stream) for t, spec in specs.items() for p in range(spec.partitions)]


def _position(at: str, n: int | None) -> dict[str, Any]:
    return {"id": at, "n": n}


def _count(client: SyncClient, stream: str, after: str, until: str) -> int:
    """Entries in ``(after, until]``, counted on the server in chunks."""
    seek = client.register_script(_SEEK)
    total = 0
    while True:
        found, last = seek(keys=[stream], args=[after, until, _COUNT_CHUNK])
        total += int(found)
        if int(found) < _COUNT_CHUNK:
            return total
        after = last.decode()


def _number_of(client: SyncClient, stream: str, at: str, info: StreamInfo) -> int | None:
    """How many entries the stream had received up to ``at`` (counting from the nearer end)."""
    if info.added is None or info.deleted is None:
        return None
    if id_key(at) < id_key(info.first) or info.length == 0:
        return info.deleted
    if id_key(at) >= id_key(info.last):
        return info.added
    from_first, to_last = id_key(at)[0] - id_key(info.first)[0], id_key(info.last)[0] - id_key(at)[0]
    if from_first <= to_last:  # ids carry milliseconds: the nearer end in time is usually the cheaper count
        return info.deleted + _count(client, stream, "0-0", at)
    return info.added - _count(client, stream, at, "+")


def resolve(
    client: SyncClient, specs: Mapping[str, DestinationSpec], namespace: str, position: Position, *, ending: bool
) -> Offsets:
    """Turn a position (see :mod:`spark_bridge.options`) into an offset per partition.

    ``earliest`` is just before the oldest retained event, so a query starting there never reports
    data loss for what was gone before it began; a time or id older than that is clamped to it.
    Ending offsets carry no count (only a start needs one).
    """
    parts = _partitions(specs, KeySpace(namespace))
    infos = stream_info(client, [stream for _, _, stream in parts])
    out: Offsets = {t: {} for t in specs}
    for (topic, partition, stream), info in zip(parts, infos, strict=True):
        where: Position = position
        if isinstance(position, dict):
            where = position.get(topic, {}).get(partition, "latest" if ending else "earliest")
        if where == "earliest":
            at = _position("0-0", info.deleted)
        elif where == "latest":
            at = _position(info.last, info.added)
        else:  # a time (int) or an entry id: a start includes it, an end excludes it
            target = before(f"{where}-0" if isinstance(where, int) else str(where))
            if ending:
                at = _position(_earlier(target, info.last), None)
            elif info.length == 0 or id_key(target) < id_key(info.first):
                at = _position("0-0", info.deleted)
            else:
                target = _earlier(target, info.last)
                at = _position(target, _number_of(client, stream, target, info))
        out[topic][partition] = at
    return out


def cap(offsets: Offsets, limit: Offsets) -> Offsets:
    """``offsets`` with no partition past ``limit`` (partitions ``limit`` lacks are left alone)."""
    out: Offsets = {}
    for topic, parts in offsets.items():
        out[topic] = {}
        for p, at in parts.items():
            bound = limit.get(topic, {}).get(p)
            out[topic][p] = bound if bound is not None and id_key(bound["id"]) < id_key(at["id"]) else at
    return out


def fair_shares(available: Sequence[int], budget: int) -> list[int]:
    """Split ``budget`` over partitions with ``available`` events each: equal shares, leftovers refilled."""
    shares = [0] * len(available)
    open_ = [i for i, a in enumerate(available) if a > 0]
    while budget > 0 and open_:
        each = max(budget // len(open_), 1)
        for i in list(open_):
            take = min(each, available[i] - shares[i], budget)
            shares[i] += take
            budget -= take
            if shares[i] >= available[i]:
                open_.remove(i)
            if budget == 0:
                break
    return shares


def limit_by_count(client: SyncClient, namespace: str, start: Offsets, end: Offsets, max_events: int) -> Offsets:
    """Move ``end`` back so that at most ``max_events`` entries lie between ``start`` and it, fairly spread."""
    keyspace = KeySpace(namespace)
    zero = _position("0-0", 0)
    moving = [
        (t, p)
        for t, parts in end.items()
        for p, until in parts.items()
        if id_key(until["id"]) > id_key(start.get(t, {}).get(p, zero)["id"])
    ]
    if not moving:
        return end
    sha = _text(client.script_load(_SEEK))  # on every primary of a Cluster
    pipe = client.pipeline(transaction=False)
    for t, p in moving:
        after = start.get(t, {}).get(p, zero)["id"]
        _queue_seek(pipe, sha, keyspace.partition(t, int(p)).stream, after, end[t][p]["id"], max_events)
    shares = fair_shares([int(reply[0]) for reply in pipe.execute()], max_events)
    out = {t: dict(parts) for t, parts in end.items()}
    for (t, p), share in zip(moving, shares, strict=True):
        begin = start.get(t, {}).get(p, zero)
        if share == 0:
            out[t][p] = begin
            continue
        stream = keyspace.partition(t, int(p)).stream
        # One MULTI: the count and the deletions it is measured against must be from the same moment.
        multi = client.pipeline(transaction=True)
        multi.execute_command("XINFO STREAM", stream)
        _queue_seek(multi, sha, stream, begin["id"], end[t][p]["id"], share)
        info_reply, (found, last) = multi.execute()
        info = StreamInfo(info_reply)
        if not last:
            out[t][p] = begin
            continue
        # Entries after `begin` are numbered from begin's n, or from the deleted count if retention
        # removed some of them (the read will report that gap).
        base = None if begin["n"] is None or info.deleted is None else max(begin["n"], info.deleted)
        out[t][p] = _position(last.decode(), None if base is None else base + int(found))
    return out
