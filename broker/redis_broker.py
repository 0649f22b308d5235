"""The Redis Streams transport: the Broker contract on Redis >= 6.2 or Valkey (single node or Cluster)."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import orjson
from redis.exceptions import NoPermissionError, NoScriptError, ResponseError

from broker.codec import check_body_size, decode_flat, encode_fields
from broker.codec import max_body_bytes as max_body_bytes_setting
from broker.envelope import Envelope, Kind, now_ms
from broker.errors import ConfigurationError, DecodeError, EffectsFailed
from broker.headers import DLQ_ERROR_MESSAGE, DLQ_ERROR_TYPE, DLQ_REASON, FIRST_FAILED_AT, IDEMPOTENCY_KEY
from broker.keys import KeySpace, PartitionKeys
from broker.protocol import Delivery, Extension, GroupPartition, Start
from broker.scripts import Script, load_scripts
from broker.topology import DestinationSpec, validate_name
from broker.wire import DEFAULT_COMMAND_TIMEOUT, Channel

__all__ = ["RedisBroker"]

_DEFAULT_DEDUP_WINDOW_MS = 24 * 3600 * 1000  # producer idempotency keys, unless the caller says otherwise
_SCRIPT_REASON = (DLQ_REASON, DLQ_ERROR_TYPE, DLQ_ERROR_MESSAGE)  # written by commit_effects.lua itself
_ACK_CHUNK = 1000  # ids per script call; Lua's unpack() limit is about 8000
_RAW = ("XREADGROUP", "XAUTOCLAIM", "XCLAIM", "XPENDING", "XINFO GROUPS", "XINFO STREAM", "XRANGE", "XREVRANGE")


def _raw(response: Any, **_: Any) -> Any:
    return response


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _partition_of(spec: DestinationSpec, env: Envelope, idem: str | None) -> int:
    """The envelope's partition: by its key, else by its idempotency key, else by its id.

    Routing by the idempotency key keeps repeats of one key in one partition, where
    ``publish_once.lua`` checks it.
    """
    return spec.partition_for(env.key, idem or env.id)


class RedisBroker:
    """Broker on Redis Streams. Use :func:`broker.connect` to build one from a URL.

    One instance is safe to share between tasks of one event loop. Blocking reads take a
    connection each from the pool for as long as they wait.
    """

    def __init__(
        self,
        client: Any,
        *,
        namespace: str = "fw",
        url: str = "",
        cluster: bool = False,
        command_timeout: float = DEFAULT_COMMAND_TIMEOUT,
        max_body_bytes: int | None = None,
    ) -> None:
        """``command_timeout``: seconds a command on a :meth:`channel` may wait for its reply (a
        blocking read waits its BLOCK time on top); it should match the client's socket timeout.
        ``max_body_bytes``: largest body :meth:`publish` accepts and consumers read (default
        ``$FRAMEWORK_MAX_BODY_BYTES``, else 1 MiB); larger stored ones decode as errors (dead-lettered)."""
        self.redis = client
        self.command_timeout = command_timeout
        self.max_body_bytes = max_body_bytes_setting(max_body_bytes)
        self.keyspace = KeySpace(namespace)
        self.url = url
        self.cluster = cluster
        self.scripts: dict[str, Script] = load_scripts()
        self._specs: dict[str, DestinationSpec] = {}
        self._claim_cursor: dict[tuple[str, str], str] = {}
        self._pkeys: dict[tuple[str, int], PartitionKeys] = {}
        for command in _RAW:  # parse stream replies ourselves: redis-py's dict building costs ~30%
            client.set_response_callback(command, _raw)

    @property
    def namespace(self) -> str:
        """Key prefix separating deployments (and test runs) on one server."""
        return self.keyspace.namespace

    async def close(self) -> None:
        """Close the connection pool."""
        await self.redis.aclose()

    # -- topology ----------------------------------------------------------------------------

    async def declare(self, spec: DestinationSpec) -> DestinationSpec:
        """Register ``spec``; an existing registration wins unless it conflicts (then raise)."""
        key = self.keyspace.destinations
        await self.redis.hsetnx(key, spec.name, orjson.dumps(spec.to_json()))
        stored = DestinationSpec.from_json(orjson.loads(await self.redis.hget(key, spec.name)))
        if stored.kind != spec.kind:
            noun = {"command": "a queue (commands: use send)", "event": "a topic (events: use publish)"}
            raise ConfigurationError(f"{spec.name!r} is already declared as {noun[stored.kind]}, not as {spec.kind}s")
        if stored.partitions != spec.partitions:
            raise ConfigurationError(
                f"{spec.name!r} already has {stored.partitions} partition(s); it cannot be declared with "
                f"{spec.partitions}. Changing a destination's partition count is not supported: "
                "use a new destination name, or declare it with the existing count."
            )
        if (stored.retention_ms, stored.max_length) != (spec.retention_ms, spec.max_length):
            # Retention may change over time; the latest declaration wins.
            await self.redis.hset(key, spec.name, orjson.dumps(spec.to_json()))
            stored = spec
        self._specs[spec.name] = stored
        return stored

    async def get_destination(self, name: str) -> DestinationSpec | None:
        """The declared spec of ``name``, or None (cached after the first look-up)."""
        spec = self._specs.get(name)
        if spec is None:
            raw = await self.redis.hget(self.keyspace.destinations, name)
            if raw is None:
                return None
            spec = self._specs[name] = DestinationSpec.from_json(orjson.loads(raw))
        return spec

    async def list_destinations(self) -> list[DestinationSpec]:
        """Every declared destination, sorted by name."""
        raw = await self.redis.hgetall(self.keyspace.destinations)
        specs = [DestinationSpec.from_json(orjson.loads(v)) for v in raw.values()]
        return sorted(specs, key=lambda s: s.name)

    async def list_subscriptions(self) -> list[tuple[str, str]]:
        """Every (destination, group) pair that has subscribed, sorted."""
        raw = await self.redis.hkeys(self.keyspace.subscriptions)
        return sorted(tuple(_text(k).split("|", 1)) for k in raw)  # type: ignore[misc]

    async def _spec_for(self, name: str, kind: Kind) -> DestinationSpec:
        spec = await self.get_destination(name)
        if spec is None:
            spec = await self.declare(DestinationSpec(name=name, kind=kind))
        elif spec.kind != kind:
            verb = "send() a command to" if kind == "command" else "publish() an event to"
            raise ConfigurationError(
                f"cannot {verb} {name!r}: it is declared as a {'queue' if spec.kind == 'command' else 'topic'}"
            )
        return spec

    def _partition_keys(self, name: str, partition: int) -> PartitionKeys:
        keys = self._pkeys.get((name, partition))
        if keys is None:
            keys = self._pkeys[(name, partition)] = self.keyspace.partition(name, partition)
        return keys

    def group_partition(self, spec: DestinationSpec, partition: int, group: str) -> GroupPartition:
        """The view of ``group`` on one partition (no server call)."""
        return GroupPartition(
            spec=spec,
            partition=partition,
            group=group,
            keys=self.keyspace.partition(spec.name, partition).group(group),
        )

    async def subscribe(self, spec: DestinationSpec, group: str, start: Start = "earliest") -> list[GroupPartition]:
        """Create ``group`` on every partition stream and its redeliver stream (idempotent)."""
        validate_name("group", group)
        spec = await self.declare(spec)
        if not spec.is_topic:
            owners = {_text(g["name"]) for g in await self.stream_groups(self.keyspace.partition(spec.name, 0).stream)}
            if owners - {group}:
                raise ConfigurationError(
                    f"queue {spec.name!r} is already consumed by {', '.join(sorted(owners))}; a queue has one "
                    f"owning service. Use a topic (events) if {group!r} should also get these messages."
                )
        first = "0" if (start == "earliest" or not spec.is_topic) else "$"
        views = [self.group_partition(spec, p, group) for p in range(spec.partitions)]
        for view in views:
            for stream, at in ((view.stream, first), (view.keys.redeliver, "0")):
                try:
                    await self.redis.xgroup_create(stream, group, id=at, mkstream=True)
                except ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise
        await self.redis.hsetnx(self.keyspace.subscriptions, f"{spec.name}|{group}", orjson.dumps({"start": start}))
        return views

    # -- publishing ----------------------------------------------------------------------------

    async def publish(self, envelopes: Sequence[Envelope], *, dedup_window_ms: int | None = None) -> list[str | None]:
        """Append envelopes in one round trip; return entry ids (None where an idempotency key repeated).

        Entries for one partition stream go in one script call (one reply for the lot), in order.
        An envelope carrying the ``idempotency-key`` header is stored at most once while that key's
        dedup window lasts: ``dedup_window_ms`` (default: one day) from the publish that stored it;
        a dropped repeat does not extend it. The key is checked in the partition the message goes
        to, chosen by the message's key, else by its idempotency key (not by its random id), so
        repeats without a message key land in one partition and are caught there. Repeats that
        carry different message keys may land in different partitions and are then not caught.
        A body over :attr:`max_body_bytes` raises :class:`~broker.errors.MessageTooLarge` and
        nothing of the call is stored.
        """
        if not envelopes:
            return []
        limit = self.max_body_bytes
        for env in envelopes:  # before anything is sent: a batch is stored whole or not at all
            check_body_size(env, limit)
        window = dedup_window_ms if dedup_window_ms is not None else _DEFAULT_DEDUP_WINDOW_MS
        calls: list[tuple[str, list[str], list[Any]]] = []
        batches: dict[str, tuple[int, list[int], list[Any]]] = {}  # stream -> (call index, positions, args)
        slots: list[tuple[int, int]] = []  # per envelope: (call index, position in that call's reply)
        for env in envelopes:
            spec = self._specs.get(env.destination)
            if spec is None or spec.kind != env.kind:
                spec = await self._spec_for(env.destination, env.kind)
            idem = env.headers.get(IDEMPOTENCY_KEY) if env.headers else None
            pkeys = self._partition_keys(spec.name, _partition_of(spec, env, idem))
            fields = encode_fields(env)
            if idem:
                batches.pop(pkeys.stream, None)  # later entries of this stream go after it: order kept
                slots.append((len(calls), -1))
                calls.append(("once", [pkeys.stream, pkeys.published], [idem, now_ms(), window, *fields]))
                continue
            batch = batches.get(pkeys.stream)
            if batch is None or len(batch[2]) > 20_000:  # keep each call (and Lua's unpack) modest
                batch = batches[pkeys.stream] = (len(calls), [], [])
                calls.append(("publish_batch", [pkeys.stream], batch[2]))
            slots.append((batch[0], len(batch[1])))
            batch[1].append(1)
            batch[2].append(len(fields))
            batch[2].extend(fields)
        replies = await self._run_pipeline(calls)
        out: list[str | None] = []
        for call, position in slots:
            reply = replies[call] if position < 0 else replies[call][position]
            out.append(None if reply is None else _text(reply))
        return out

    async def _run_pipeline(self, calls: list[tuple[str, list[str], list[Any]]]) -> list[Any]:
        """Run script calls in one round trip, reloading scripts the server lost (NOSCRIPT means not run)."""
        results: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        for _ in range(2):
            pipe = self.redis.pipeline(transaction=False)
            for i in todo:
                kind, keys, args = calls[i]
                script = self.scripts["publish_once" if kind == "once" else kind]
                script.queue(pipe, keys, args)
            replies = await pipe.execute(raise_on_error=False)
            missing = []
            for i, reply in zip(todo, replies, strict=True):
                if isinstance(reply, NoScriptError):
                    missing.append(i)
                elif isinstance(reply, Exception):
                    raise reply
                else:
                    results[i] = reply
            if not missing:
                return results
            for script in self.scripts.values():
                await self.redis.script_load(script.source)
            todo = missing
        raise RuntimeError("scripts could not be loaded on the server")

    # -- reading -------------------------------------------------------------------------------

    def _deliveries(self, source: GroupPartition, reply: Any, counts: dict[str, int] | None = None) -> list[Delivery]:
        out: list[Delivery] = []
        if not reply:
            return out
        name, kind = source.spec.name, source.spec.kind
        if isinstance(reply, dict):  # RESP3 servers/clients answer with a map
            reply = list(reply.items())
        append = out.append
        limit = self.max_body_bytes
        for stream_name, entries in reply:
            stream = _text(stream_name)
            for entry_id, flat in entries:
                eid = entry_id.decode()
                count = counts.get(eid, 1) if counts is not None else 1
                if flat is None:  # deleted from the stream while pending
                    append(Delivery(source, stream, eid, [], None, "entry was deleted while pending", count))
                    continue
                try:
                    append(Delivery(source, stream, eid, flat, decode_flat(flat, name, kind, limit), None, count))
                except DecodeError as exc:
                    append(Delivery(source, stream, eid, flat, None, str(exc), count))
        return out

    def channel(self) -> Channel | None:
        """A dedicated connection for one task's hot path (None on a Cluster: use the client)."""
        return None if self.cluster else Channel(self.redis.connection_pool, command_timeout=self.command_timeout)

    async def read(
        self, source: GroupPartition, consumer: str, count: int, block_ms: int, *, channel: Channel | None = None
    ) -> list[Delivery]:
        """XREADGROUP new entries of the partition stream and the group's redeliver stream.

        Bounded: on a channel the call waits at most ``block_ms`` plus the command timeout; through
        the client (whose socket timeout is the command timeout) BLOCK is capped at half of it.
        """
        if channel is None:
            block_ms = min(block_ms, int(self.command_timeout * 500))
        args: list[Any] = ["XREADGROUP", "GROUP", source.group, consumer, "COUNT", count]
        if block_ms > 0:
            args += ["BLOCK", block_ms]
        args += ["STREAMS", source.stream, source.keys.redeliver, ">", ">"]
        if channel is not None:
            reply = await channel.execute(*args, timeout=block_ms / 1000 + self.command_timeout)
        else:
            reply = await self.redis.execute_command(*args)
        return self._deliveries(source, reply)

    async def read_own_pending(
        self, source: GroupPartition, consumer: str, count: int, after: dict[str, str] | None = None
    ) -> list[Delivery]:
        """Re-read entries pending for ``consumer`` itself, oldest first, after ids in ``after``."""
        after = after or {}
        streams = (source.stream, source.keys.redeliver)
        starts = [after.get(s, "0") for s in streams]
        pipe = self.redis.pipeline(transaction=False)
        pipe.execute_command(
            "XREADGROUP", "GROUP", source.group, consumer, "COUNT", count, "STREAMS", *streams, *starts
        )
        for stream, start in zip(streams, starts, strict=True):
            lo = "-" if start == "0" else f"({start}"
            pipe.execute_command("XPENDING", stream, source.group, lo, "+", count, consumer)
        reply, *pending = await pipe.execute()
        counts = {_text(p[0]): int(p[3]) for rows in pending for p in rows}
        return self._deliveries(source, reply, counts)

    async def claim_idle(self, source: GroupPartition, consumer: str, min_idle_ms: int, count: int) -> list[Delivery]:
        """XAUTOCLAIM entries idle past ``min_idle_ms``; their delivery counts are raised by one."""
        out: list[Delivery] = []
        for stream in (source.stream, source.keys.redeliver):
            cursor_key = (stream, source.group)
            start = self._claim_cursor.get(cursor_key, "0-0")
            reply = await self.redis.execute_command(
                "XAUTOCLAIM", stream, source.group, consumer, min_idle_ms, start, "COUNT", count
            )
            self._claim_cursor[cursor_key] = _text(reply[0])
            entries = [e for e in reply[1] if e is not None]
            if not entries:
                continue
            ids = [_text(e[0]) for e in entries]
            rows = await self.redis.execute_command(
                "XPENDING", stream, source.group, ids[0], ids[-1], len(ids) * 2 + 10, consumer
            )
            counts = {_text(p[0]): int(p[3]) for p in rows}
            out += self._deliveries(source, [[stream, entries]], counts)
        return out

    async def release_own_pending(
        self, source: GroupPartition, consumer: str, idle_ms: int, *, keep: Iterable[str] = ()
    ) -> int:
        """Make entries pending for ``consumer`` claimable by others at once (a handover at shutdown).

        The entries stay pending (nothing is lost); their idle time is set to ``idle_ms`` (at least
        the visibility timeout), so the next claim by a live consumer takes them. Entry ids in
        ``keep`` (handlers still running them) are left alone: they are claimed only after the
        visibility timeout, so they never run twice at once. Returns how many were released.
        """
        kept = set(keep)
        released = 0
        for stream in (source.stream, source.keys.redeliver):
            rows = await self.redis.execute_command("XPENDING", stream, source.group, "-", "+", 10_000, consumer)
            ids = [i for i in (_text(r[0]) for r in rows) if i not in kept]
            for i in range(0, len(ids), 1000):
                chunk = ids[i : i + 1000]
                await self.redis.execute_command(
                    "XCLAIM", stream, source.group, consumer, 0, *chunk, "IDLE", idle_ms, "JUSTID"
                )
                released += len(chunk)
        return released

    async def prune_consumers(self, source: GroupPartition, min_idle_ms: int, *, keep: str = "") -> int:
        """Delete consumers of the group that hold nothing and were idle ``min_idle_ms`` or longer.

        Processes that died or were replaced (a new host name after a container restart) stay listed
        in the group forever otherwise, and ``framework status`` would count them. A consumer with
        pending entries is never deleted (its entries would be lost to claims), nor ``keep``. A
        live consumer reading again is recreated by the server. Returns how many consumer entries
        were deleted (a consumer is listed on the partition stream and on the redeliver stream).
        """
        deleted = 0
        for stream in (source.stream, source.keys.redeliver):
            try:
                rows = await self.redis.xinfo_consumers(stream, source.group)
            except NoPermissionError:
                raise
            except ResponseError:  # no stream or group yet
                continue
            for row in rows:
                info = {_text(k): v for k, v in row.items()}
                name = _text(info["name"])
                if name != keep and int(info["pending"]) == 0 and int(info["idle"]) >= min_idle_ms:
                    await self.redis.xgroup_delconsumer(stream, source.group, name)
                    deleted += 1
        return deleted

    async def extend(
        self, source: GroupPartition, consumer: str, deliveries: Sequence[Delivery], *, lease_ms: int = 60_000
    ) -> Extension:
        """Touch deliveries ``consumer`` still owns so they are not claimed, and extend their inbox
        leases by ``lease_ms``; return the entry ids still owned, with ``.taken``: those pending
        under another consumer. Entries no longer pending (settled meanwhile) are in neither."""
        owned: list[str] = []
        taken: list[str] = []
        by_stream: dict[str, list[Delivery]] = defaultdict(list)
        for d in deliveries:
            by_stream[d.stream].append(d)
        expiry = now_ms() + lease_ms
        for stream, items in by_stream.items():
            for i in range(0, len(items), _ACK_CHUNK):  # bounded calls: a script blocks the server while it runs
                chunk = items[i : i + _ACK_CHUNK]
                args = [
                    source.group,
                    consumer,
                    expiry,
                    len(chunk),
                    *(d.entry_id for d in chunk),
                    *(d.message_id for d in chunk),
                ]
                reply = await self.scripts["extend"](self.redis, [stream, source.keys.inbox], args)
                for d, status in zip(chunk, reply, strict=True):
                    if status == 0:
                        owned.append(d.entry_id)
                    elif status == 2:
                        taken.append(d.entry_id)
        return Extension(owned, taken)

    async def inbox_claim(
        self, source: GroupPartition, deliveries: Sequence[Delivery], lease_ms: int, *, channel: Channel | None = None
    ) -> list[int]:
        """Check deliveries against the group's inbox and lease the new ones, in one call.

        Returns a status per delivery: 0 leased to us (run it), 1 already processed (ack it),
        2 leased elsewhere (leave it pending). Redelivered entries take over stale leases.
        """
        script = self.scripts["inbox_claim"]
        keys = [source.keys.inbox]
        again = [d for d in deliveries if d.delivery_count != 1]
        if not again:  # the common case: one list, statuses in order
            args = [now_ms(), lease_ms, len(deliveries), *(d.message_id for d in deliveries)]
            if channel is not None:
                return await script.on(channel, keys, args)  # type: ignore[no-any-return]
            return await script(self.redis, keys, args)  # type: ignore[no-any-return]
        first = [d for d in deliveries if d.delivery_count == 1]
        args = [now_ms(), lease_ms, len(first), *(d.message_id for d in first), *(d.message_id for d in again)]
        reply = await (script.on(channel, keys, args) if channel is not None else script(self.redis, keys, args))
        status = dict(zip((id(d) for d in [*first, *again]), (int(x) for x in reply), strict=True))
        return [status[id(d)] for d in deliveries]

    async def trim_inbox(self, source: GroupPartition, older_than_ms: int) -> int:
        """Forget processed ids recorded before ``older_than_ms`` (the dedup window's end) and leases
        that expired (their handlers died; a redelivery takes the message over)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.zremrangebyscore(source.keys.inbox, 0, older_than_ms)
        pipe.zremrangebyscore(source.keys.inbox, f"({-now_ms()}", "(0")
        return sum(int(x) for x in await pipe.execute())

    async def commit_effects(
        self,
        delivery: Delivery,
        commands: Sequence[Sequence[Any]],
        keys: Sequence[str],
        outgoing: Sequence[Envelope] = (),
        *,
        reason: Mapping[str, str] = {},
    ) -> bool:
        """Apply ``commands``, publish ``outgoing``, mark the inbox and ack, atomically.

        Returns True when applied; False when the message was already processed (then it is only
        acked) or its entry is no longer pending for the group (settled elsewhere, or by an
        earlier failed commit: nothing is done). On a Cluster every key must share the
        delivery's hash tag, and ``outgoing`` must be empty (publish it first).

        Redis cannot roll back, so a command that fails stops the rest (``outgoing`` go after
        ``commands``, so no message is sent) and the commands before it stay applied: running the
        handler again would apply them twice. So the same script call dead-letters the message
        (its fields, ``reason`` - the base ``dlq-*`` fields the caller builds - and ``dlq-reason``,
        ``dlq-error-type``, ``dlq-error-message`` naming the command and the error), acks it,
        releases its inbox lease (a redrive runs the handler again) and drops its attempts
        counter; then :class:`~broker.errors.EffectsFailed` is raised (``applied`` may be 0).
        Server states that refuse every write (OOM, READONLY) raise the redis error instead,
        having changed nothing; the entry stays pending.
        """
        source = delivery.source
        calls: list[list[Any]] = [list(c) for c in commands]
        out_keys: list[str] = []
        for env in outgoing:
            spec = await self._spec_for(env.destination, env.kind)
            idem = env.headers.get(IDEMPOTENCY_KEY) if env.headers else None
            stream = self._partition_keys(spec.name, _partition_of(spec, env, idem)).stream
            out_keys.append(stream)
            calls.append(["XADD", stream, "*", *encode_fields(env)])
        flat: list[Any] = []
        for k, v in reason.items():
            if k not in _SCRIPT_REASON:
                flat += (k, v)
        pairs = len(flat) // 2
        for c in calls:
            flat += (len(c), *c)
        script_keys = [delivery.stream, source.keys.inbox, source.keys.attempts, source.keys.dlq, *keys, *out_keys]
        delete = "1" if source.deletes_on_ack(delivery.stream) else "0"
        args = [
            source.group,
            delete,
            now_ms(),
            delivery.entry_id,
            delivery.message_id,
            len(commands),
            len(outgoing),
            pairs,
            *flat,
        ]
        reply = await self.scripts["commit_effects"](self.redis, script_keys, args)
        if isinstance(reply, list):
            dead, error, applied = reply
            raise EffectsFailed(_text(dead), _text(error), int(applied))
        return bool(reply)

    # -- settling ------------------------------------------------------------------------------

    async def ack(
        self,
        source: GroupPartition,
        deliveries: Sequence[Delivery],
        *,
        inbox: bool = False,
        channel: Channel | None = None,
    ) -> int:
        """Acknowledge deliveries in one round trip; with ``inbox`` also record their message ids."""
        if not deliveries:
            return 0
        by_stream: dict[str, list[Delivery]] = defaultdict(list)
        for d in deliveries:
            by_stream[d.stream].append(d)
        now = now_ms()
        calls: list[tuple[str, list[str], list[Any]]] = []
        keys = source.keys
        script_keys = [keys.inbox, keys.attempts]
        for stream, items in by_stream.items():
            delete = "1" if source.deletes_on_ack(stream) else "0"
            for i in range(0, len(items), _ACK_CHUNK):
                chunk = items[i : i + _ACK_CHUNK]
                marks = [d.envelope.id for d in chunk if d.envelope is not None] if inbox else []
                counters = [d.envelope.id for d in chunk if d.delivery_count > 1 and d.envelope is not None]
                args: list[Any] = [
                    source.group,
                    delete,
                    now,
                    len(chunk),
                    len(marks),
                    len(counters),
                    *(d.entry_id for d in chunk),
                    *marks,
                    *counters,
                ]
                calls.append(("ack", [stream, *script_keys], args))
        if channel is not None:
            return sum(int(r) for r in await self._run_on(channel, calls))
        return sum(int(r) for r in await self._run_pipeline(calls))

    async def _run_on(self, channel: Channel, calls: list[tuple[str, list[str], list[Any]]]) -> list[Any]:
        """Like :meth:`_run_pipeline`, on a channel."""
        commands = [["EVALSHA", self.scripts[k].sha, len(keys), *keys, *args] for k, keys, args in calls]
        replies = await channel.execute_many(commands)
        if any(isinstance(r, NoScriptError) for r in replies):
            for script in self.scripts.values():
                await channel.execute("SCRIPT", "LOAD", script.source)
            redo = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
            for i, reply in zip(redo, await channel.execute_many([commands[i] for i in redo]), strict=True):
                replies[i] = reply
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    async def count_attempt(self, delivery: Delivery) -> int:
        """Record that a redelivered message is about to run; return how many such runs it had.

        First deliveries are not counted (that would cost a write per message): a message whose
        handler kills its process is recognised on its redeliveries.
        """
        return int(await self.redis.hincrby(delivery.source.keys.attempts, delivery.message_id, 1))

    async def count_first_redeliveries(self, deliveries: Sequence[Delivery]) -> list[bool]:
        """Count the first redelivered run of each message that has had none; one round trip.

        Per delivery: True when it had no counted redelivered run (its counter is now 1: this
        run), False when an earlier redelivered run started and did not complete (its counter is
        left as it is, for :meth:`count_attempt` to raise just before it runs again).
        """
        if not deliveries:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for d in deliveries:
            pipe.hsetnx(d.source.keys.attempts, d.message_id, 1)
        return [bool(int(r)) for r in await pipe.execute()]

    async def dead_letter(self, delivery: Delivery, reason: dict[str, str]) -> str | None:
        """Write the delivery's fields plus ``reason`` to the group's DLQ and ack it, atomically."""
        source = delivery.source
        flat: list[Any] = []
        for k, v in delivery.fields.items():
            flat += (k, v)
        for k, v in reason.items():
            flat += (k, v)
        if not flat:
            flat = ["dlq-empty", "1"]  # the entry was deleted: keep a record all the same
        delete = "1" if source.deletes_on_ack(delivery.stream) else "0"
        reply = await self.scripts["dead_letter"](
            self.redis,
            [delivery.stream, source.keys.dlq, source.keys.inbox, source.keys.attempts],
            [source.group, delivery.entry_id, delete, delivery.message_id, *flat],
        )
        return None if reply is None else _text(reply)

    async def retry_later(self, delivery: Delivery, due_ms: int, *, attempt: int | None = None) -> bool:
        """Park the delivery until ``due_ms`` for its group only, atomically with its ack.

        The parked copy carries ``attempt + 1`` (default: the delivery's attempt) and the time of
        its first failure (field ``first-failed-at``), which dead letters report.
        """
        if delivery.envelope is None:
            raise ValueError("an undecodable delivery cannot be retried; dead-letter it")
        source = delivery.source
        fields = {k: v for k, v in delivery.fields.items() if k != b"attempt"}
        fields[b"attempt"] = str((attempt if attempt is not None else delivery.attempt) + 1).encode()
        fields.setdefault(FIRST_FAILED_AT.encode(), str(now_ms()).encode())
        flat: list[Any] = []
        for k, v in fields.items():
            flat += (k, v)
        delete = "1" if source.deletes_on_ack(delivery.stream) else "0"
        reply = await self.scripts["retry_later"](
            self.redis,
            [delivery.stream, source.keys.delayed, source.keys.inbox, source.keys.attempts],
            [source.group, delivery.entry_id, delete, due_ms, delivery.message_id, *flat],
        )
        return bool(reply)

    async def move_due(self, source: GroupPartition, now_ms: int, limit: int = 500) -> int:
        """Move due delayed retries of the group to its redeliver stream."""
        keys = [source.keys.delayed, source.keys.redeliver]
        return int(await self.scripts["move_due"](self.redis, keys, [now_ms, limit]))

    # -- retention -----------------------------------------------------------------------------

    async def trim(self, spec: DestinationSpec, partition: int, now_ms: int, *, max_removed: int = 10_000) -> int:
        """Trim a topic partition by its retention, never below an unacknowledged entry.

        Queues are not trimmed (their entries are deleted on ack). Also drops producer
        idempotency keys whose dedup window ended (score = expiry <= ``now_ms``; publishing removes
        them too, see ``publish_once.lua``). Returns the number of stream entries removed.
        """
        pkeys = self.keyspace.partition(spec.name, partition)
        await self.redis.zremrangebyscore(pkeys.published, "-inf", now_ms)
        if not spec.is_topic or (spec.retention_ms is None and spec.max_length is None):
            return 0
        cutoff = f"{max(now_ms - spec.retention_ms, 0)}-0" if spec.retention_ms is not None else "0"
        return int(await self.scripts["trim"](self.redis, [pkeys.stream], [cutoff, spec.max_length or 0, max_removed]))

    # -- dead letters and subscriptions ------------------------------------------------------------

    async def dead_letter_entries(
        self, view: GroupPartition, count: int | None = None
    ) -> list[tuple[str, dict[bytes, bytes]]]:
        """The group's dead letters on this partition, oldest first: (DLQ entry id, fields)."""
        args: list[Any] = ["XRANGE", view.keys.dlq, "-", "+"]
        if count is not None:
            args += ["COUNT", count]
        rows = await self.redis.execute_command(*args)
        return [(_text(eid), dict(zip(flat[::2], flat[1::2], strict=True))) for eid, flat in rows]

    async def redrive(self, view: GroupPartition, dlq_entry_id: str) -> str | None:
        """Move one dead letter back to its group only, as a first attempt; None if it is gone."""
        reply = await self.scripts["redrive"](self.redis, [view.keys.dlq, view.keys.redeliver], [dlq_entry_id])
        return None if reply is None else _text(reply)

    async def purge_dead_letters(self, view: GroupPartition, dlq_entry_ids: Sequence[str]) -> int:
        """Delete dead letters for good; returns how many existed."""
        if not dlq_entry_ids:
            return 0
        return int(await self.redis.xdel(view.keys.dlq, *dlq_entry_ids))

    async def unsubscribe(self, spec: DestinationSpec, group: str) -> None:
        """Remove ``group`` from every partition of ``spec`` with its retry, DLQ and inbox keys.

        No check here: workers still consuming crash on the missing group, and a group created
        again replays what the topic retains with its inbox gone. ``framework unsubscribe``
        refuses while consumers are alive and says what would replay.
        """
        for p in range(spec.partitions):
            view = self.group_partition(spec, p, group)
            for stream in (view.stream, view.keys.redeliver):
                with contextlib.suppress(ResponseError):
                    await self.redis.xgroup_destroy(stream, group)
            keys = view.keys
            await self.redis.delete(keys.redeliver, keys.delayed, keys.dlq, keys.inbox, keys.attempts)
        await self.redis.hdel(self.keyspace.subscriptions, f"{spec.name}|{group}")

    async def delete_destination(self, spec: DestinationSpec, *, force: bool = False) -> int:
        """Delete ``spec`` and every key it has; return how many keys were deleted.

        Goes: each partition's stream and producer idempotency keys, the retry, delayed,
        dead-letter, inbox and attempt keys of every group (registered, or present on a stream),
        then its registry entries (last, so an interrupted delete can be run again: ``unsubscribe``
        also drops its registry entry last). Refuses with ConfigurationError while a group is
        subscribed or entries are stored, unless ``force``. No SCAN: the ACL stays small.
        """
        groups = {g for d, g in await self.list_subscriptions() if d == spec.name}
        entries = 0
        for p in range(spec.partitions):
            stream = self.keyspace.partition(spec.name, p).stream
            groups |= {_text(info["name"]) for info in await self.stream_groups(stream)}
            entries += int(await self.redis.xlen(stream))
        if (groups or entries) and not force:
            raise ConfigurationError(
                f"{spec.name!r} still has {len(groups)} consumer group(s) ({', '.join(sorted(groups)) or 'none'}) "
                f"and {entries} stored entr{'y' if entries == 1 else 'ies'}: unsubscribe the groups and let them "
                "drain first, or force the delete"
            )
        deleted = 0
        for p in range(spec.partitions):
            pkeys = self.keyspace.partition(spec.name, p)
            keys = {pkeys.stream, pkeys.published}
            for group in groups:
                g = pkeys.group(group)
                keys |= {g.redeliver, g.delayed, g.dlq, g.inbox, g.attempts}
            deleted += int(await self.redis.delete(*sorted(keys)))
            self._pkeys.pop((spec.name, p), None)
        for group in groups:
            await self.redis.hdel(self.keyspace.subscriptions, f"{spec.name}|{group}")
        await self.redis.hdel(self.keyspace.destinations, spec.name)
        self._specs.pop(spec.name, None)
        return deleted

    # -- inspection helpers --------------------------------------------------------------------

    async def stream_groups(self, stream: str) -> list[dict[str, Any]]:
        """XINFO GROUPS of a stream as dicts with str keys ([] when the stream does not exist)."""
        try:
            reply = await self.redis.execute_command("XINFO GROUPS", stream)
        except NoPermissionError:  # an ACL refusal is not "no such stream": say it
            raise
        except ResponseError:
            return []
        groups = []
        for row in reply:
            if isinstance(row, dict):
                groups.append({_text(k): v for k, v in row.items()})
            else:
                groups.append({_text(row[i]): row[i + 1] for i in range(0, len(row), 2)})
        return groups

    @staticmethod
    def entries_to_deliveries(source: GroupPartition, stream: str, entries: Iterable[Any]) -> list[Delivery]:
        """Turn raw XRANGE rows of ``stream`` into deliveries (used by DLQ tools and tests)."""
        out = []
        for entry_id, flat in entries:
            try:
                env: Envelope | None = decode_flat(flat, source.spec.name, source.spec.kind)
                err = None
            except DecodeError as exc:
                env, err = None, str(exc)
            out.append(Delivery(source, stream, _text(entry_id), flat, env, err))
        return out
