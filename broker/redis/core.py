"""State every role of the Redis broker shares: the client, its caches and the script pipelines."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoPermissionError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from broker.codec import max_body_bytes as max_body_bytes_setting
from broker.redis.batching import CommitBatcher, ReadBatcher
from broker.redis.keys import KeySpace, PartitionKeys
from broker.redis.scripts import Script, load_scripts, script_missing
from broker.redis.wire import DEFAULT_COMMAND_TIMEOUT, Channel
from broker.topology import DestinationSpec

if TYPE_CHECKING:
    from broker.protocol import GroupPartition

__all__ = ["LeaseState", "ScriptCall", "RedisCore", "text"]

# Parse these replies ourselves: redis-py's dict building costs about 30% of a read.
_RAW = ("XREADGROUP", "XAUTOCLAIM", "XCLAIM", "XPENDING", "XINFO GROUPS", "XINFO STREAM", "XRANGE", "XREVRANGE")

ScriptCall = tuple[str, list[str], list[Any]]
"""One script call for a pipeline: (script name, keys, args)."""


def _raw(response: Any, **_: Any) -> Any:
    return response


def text(value: Any) -> str:
    """A reply value as ``str`` (replies are bytes; RESP3 maps and tests may give ``str``)."""
    return value.decode() if isinstance(value, bytes) else str(value)


@attrs.frozen
class LeaseState:
    """A partition's lease as stored: ``owner`` is '' when nobody holds it (never acquired, released)."""

    owner: str
    token: int
    until_ms: int
    since_ms: int
    now_ms: int  # the server's clock when read

    @property
    def live(self) -> bool:
        """Whether an instance holds the lease now."""
        return bool(self.owner) and self.until_ms > self.now_ms


class RedisCore:
    """The shared state of one Redis broker; every role mixin builds on it.

    The roles only touch the attributes set in :meth:`__init__` and the methods here, plus the
    methods of the roles they inherit from (publishing, settlement and administration build on
    :class:`~broker.redis.topology.Topology`), so a role can be read on its own.
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
        functions: bool = False,
    ) -> None:
        """``command_timeout``: seconds a command on a :meth:`channel` may wait for its reply (a
        blocking read waits its BLOCK time on top); it should match the client's socket timeout.
        ``max_body_bytes``: largest body :meth:`publish` accepts and consumers read (default
        ``$FRAMEWORK_MAX_BODY_BYTES``, else 1 MiB); larger stored ones decode as errors (dead-lettered).
        ``functions``: the scripts run as functions (``FCALL``; :func:`broker.redis.scripts.functions_usable`)."""
        self.redis = client
        self.command_timeout = command_timeout
        self.max_body_bytes = max_body_bytes_setting(max_body_bytes)
        self.keyspace = KeySpace(namespace)
        self.url = url
        self.cluster = cluster
        self.scripts: dict[str, Script] = load_scripts(functions=functions)
        # Registry cache: name -> stored spec. The one cache behind get_destination, route and
        # ensure_declared; tools that change the registry behind the broker's back clear it.
        self._specs: dict[str, DestinationSpec] = {}
        self._claim_cursor: dict[tuple[str, str], str] = {}  # (stream, group) -> XAUTOCLAIM cursor
        self._backlog: dict[tuple[str, str], bool] = {}  # (stream, consumer) -> the last read was full (intake)
        self._drained: dict[tuple[str, str], tuple[str, str]] = {}  # (stream, consumer) -> where the next wait starts
        self._touched: dict[tuple[str, str], float] = {}  # (stream, consumer) -> when a wait last marked it seen
        self._pkeys: dict[tuple[str, int], PartitionKeys] = {}
        self._commits: CommitBatcher | None = None  # effects commits from many tasks (made on first use)
        self._reads: ReadBatcher | None = None  # reads from many tasks (made on first use)
        self._quick: Channel | None = None  # the publishes' own connection (_run_quick; made on first use)
        self._quick_busy = False
        for command in _RAW:
            client.set_response_callback(command, _raw)

    if TYPE_CHECKING:
        # Methods a role calls on a sibling it does not inherit from: defined by that role, declared
        # here for the type checker (the caller imports no sibling).

        async def lease_state(self, source: GroupPartition) -> LeaseState:
            """:meth:`broker.redis.leases.Leases.lease_state` (``inspect.py`` reads it)."""
            ...

    @property
    def namespace(self) -> str:
        """Key prefix separating deployments (and test runs) on one server."""
        return self.keyspace.namespace

    async def close(self) -> None:
        """Close the connection pool."""
        for batcher in (self._commits, self._reads):
            if batcher is not None:
                await batcher.aclose()
        self._commits = self._reads = None
        quick, self._quick = self._quick, None
        if quick is not None:
            await quick.aclose()
        await self.redis.aclose()

    def _channels(self) -> Callable[[], Channel]:
        """Makes the batchers' channels (connections of the client's pool, this broker's timeout)."""
        return functools.partial(Channel, self.redis.connection_pool, command_timeout=self.command_timeout)

    def _commit_batcher(self) -> CommitBatcher | None:
        """The batcher of effects commits (None on a Cluster: each commit goes through the client)."""
        if self._commits is None and not self.cluster:
            self._commits = CommitBatcher(self.scripts["commit_effects"], self._channels())
        return self._commits

    async def read_shared(self, *command: Any) -> Any:
        """Run a read ``command`` in one write with other tasks' reads (its raw reply: bytes, not
        decoded). Cheaper per call than the client under load; on a Cluster it goes through the client."""
        if self.cluster:
            return await self.redis.execute_command(*command)
        if self._reads is None:
            self._reads = ReadBatcher(self._channels())
        return await self._reads.call(*command)

    async def read_hashes(
        self, keys: Sequence[str], fields: Sequence[str], *, channel: Channel | None = None
    ) -> list[list[bytes | None] | None]:
        """The same ``fields`` of each hash in ``keys`` (raw values, None where absent; None for a
        key that is not a hash), in one script call; on a Cluster the keys must share a hash tag."""
        if not keys:
            return []
        rows: list[list[bytes | None] | None]  # the script's reply
        if channel is not None:
            rows = await self.scripts["read_hashes"].on(channel, keys, fields)
        else:
            rows = (await self._run_pipeline([("read_hashes", list(keys), list(fields))]))[0]
        return rows

    def _partition_keys(self, name: str, partition: int) -> PartitionKeys:
        keys = self._pkeys.get((name, partition))
        if keys is None:
            keys = self._pkeys[(name, partition)] = self.keyspace.partition(name, partition)
        return keys

    async def _run_pipeline(self, calls: list[ScriptCall]) -> list[Any]:
        """Run script calls in one round trip, reloading scripts the server lost (NOSCRIPT means not run)."""
        results: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        for _ in range(2):
            pipe = self.redis.pipeline(transaction=False)
            for i in todo:
                name, keys, args = calls[i]
                self.scripts[name].queue(pipe, keys, args)
            replies = await pipe.execute(raise_on_error=False)
            missing = []
            for i, reply in zip(todo, replies, strict=True):
                if script_missing(reply):
                    missing.append(i)
                elif isinstance(reply, Exception):
                    raise reply
                else:
                    results[i] = reply
            if not missing:
                return results
            for script in self.scripts.values():
                await script.load(self.redis)
            todo = missing
        raise RuntimeError("scripts could not be loaded on the server")

    async def _run_quick(self, calls: list[ScriptCall]) -> list[Any]:
        """Like :meth:`_run_pipeline`, on the broker's own connection when no other call is using
        it: a one-at-a-time publisher (``Client.send`` in a loop) skips redis-py's pool, retry and
        timeout layers, about 50 µs of its CPU per call. Calls that overlap it, and every call on a
        Cluster, go as a pipeline from the pool. A lost or timed-out connection is retried once on a
        fresh one, as the client's own calls are."""
        if self._quick_busy or self.cluster:
            return await self._run_pipeline(calls)
        channel = self._quick
        if channel is None:
            channel = self._quick = self._channels()()
        self._quick_busy = True  # (set with no await since the check: no other task saw it free)
        try:
            try:
                return await self._run_on(channel, calls)
            except (RedisConnectionError, RedisTimeoutError):  # the channel dropped its connection
                return await self._run_on(channel, calls)
        finally:
            self._quick_busy = False

    async def _run_on(self, channel: Channel, calls: list[ScriptCall]) -> list[Any]:
        """Like :meth:`_run_pipeline`, on a channel."""
        commands = [self.scripts[k].command(keys, args) for k, keys, args in calls]
        replies = await channel.execute_many(commands)
        if any(script_missing(r) for r in replies):
            for script in self.scripts.values():
                await channel.execute(*script.load_command())
            redo = [i for i, r in enumerate(replies) if script_missing(r)]
            for i, reply in zip(redo, await channel.execute_many([commands[i] for i in redo]), strict=True):
                replies[i] = reply
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

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
                groups.append({text(k): v for k, v in row.items()})
            else:
                groups.append({text(row[i]): row[i + 1] for i in range(0, len(row), 2)})
        return groups
