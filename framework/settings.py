"""Runtime settings: one place for every knob of a worker process, with the defaults explained."""

from __future__ import annotations

import math
import os

import attrs

__all__ = ["RuntimeSettings", "inbox_memory_budget", "lease_ttl", "ownership_mode", "parse_bytes"]

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}  # fmt: skip


def parse_bytes(text: str) -> int:
    """A size such as ``268435456``, ``256MiB``, ``1.5 GiB`` or ``512MB``, in bytes."""
    value = text.strip()
    number = value.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ ")
    unit = value[len(number) :].strip().lower()
    try:
        size = float(number) * _UNITS[unit]
    except (KeyError, ValueError):
        raise ValueError(f"not a size: {text!r} (use bytes, or a unit: KiB, MiB, GiB, MB, GB)") from None
    if not math.isfinite(size) or size < 0:
        raise ValueError(f"not a size: {text!r}")
    return int(size)


def inbox_memory_budget() -> int:
    """``$FRAMEWORK_INBOX_MEMORY_BUDGET`` in bytes, else 256 MiB."""
    raw = os.environ.get("FRAMEWORK_INBOX_MEMORY_BUDGET", "").strip()
    return parse_bytes(raw) if raw else 256 * 2**20


_OWNERSHIP = ("partitioned", "all", "off")


def ownership_mode() -> str:
    """``$FRAMEWORK_OWNERSHIP`` (partitioned, all or off), else ``partitioned``."""
    return os.environ.get("FRAMEWORK_OWNERSHIP", "").strip().lower() or "partitioned"


def lease_ttl() -> float:
    """``$FRAMEWORK_LEASE_TTL`` in seconds, else 5."""
    raw = os.environ.get("FRAMEWORK_LEASE_TTL", "").strip()
    return float(raw) if raw else 5.0


def pattern_refresh() -> float:
    """``$FRAMEWORK_PATTERN_REFRESH`` in seconds, else 5."""
    raw = os.environ.get("FRAMEWORK_PATTERN_REFRESH", "").strip()
    try:
        return float(raw) if raw else 5.0
    except ValueError:
        raise ValueError(f"FRAMEWORK_PATTERN_REFRESH={raw!r} is not a number of seconds (e.g. 5)") from None


_DURATIONS = (
    "visibility_timeout",
    "ack_interval",
    "shutdown_timeout",
    "trim_interval",
    "retry_interval",
    "inbox_window",
    "group_commit_wait",
    "lease_ttl",
    "pattern_refresh",
)


@attrs.frozen
class RuntimeSettings:
    """How a worker process fetches, runs and settles messages.

    concurrency         lanes in the process: handlers that may run at once (global bound)
    prefetch            entries fetched per read (XREADGROUP COUNT); a consumer keeps at most
                        twice this many unsettled per partition, which bounds memory
    block_ms            how long one read waits for new entries
    visibility_timeout  seconds an entry may stay unacknowledged before another consumer claims
                        it; entries this process holds are extended while their handlers run
    ack_interval        seconds acks wait to be batched into one call while other messages are
                        in flight (with none in flight, a low rate, they go at once)
    shutdown_timeout    seconds in-flight handlers get to finish after SIGTERM
    trim_interval       seconds between retention passes over topic partitions
    retry_interval      seconds between moves of due delayed retries
    consumer            consumer name (default: host name plus a slot number held by a lock file,
                        so a restarted process gets its old name and re-reads its own pending entries)
    inbox_window        seconds processed message ids are remembered for deduplication
    inbox_memory_budget server bytes a group's Redis inbox may need over its window (bytes per id x
                        ids per second x window; see docs/idempotency.md) before a worker warns at
                        start and ``framework status`` flags it (default ``$FRAMEWORK_INBOX_MEMORY_BUDGET``,
                        e.g. ``512MiB``, else 256 MiB)
    group_commit_size   ``ctx.sql_transaction`` blocks (PostgreSQL) committed together at most: the
                        blocks of one worker run as members of a shared transaction that commits
                        after this many, after ``group_commit_wait``, or at once when no other block
                        waits for its connection and the next block would not start and finish
                        within the wait (moving averages);
                        1 is one transaction per message. Keep it at most
                        64 (PostgreSQL's per-transaction cache of subtransactions)
    group_commit_wait   seconds a finished block waits at most for others to join its commit (plus
                        the rest of the block running at that moment): the latency group commit adds
    ownership           which destinations' partitions are owned by one instance of a group at a
                        time (docs/partition-ownership.md): ``partitioned`` (default) those with more than one
                        partition, ``all`` every destination, ``off`` none (every instance reads every
                        partition; per-key order holds only inside one process). Default
                        ``$FRAMEWORK_OWNERSHIP``, else ``partitioned``
    lease_ttl           seconds a partition's lease lasts without a heartbeat: an instance that dies
                        or stalls loses its partitions this long after its last heartbeat (renewed
                        every third of it). Default ``$FRAMEWORK_LEASE_TTL``, else 5
    sql_connections     connections per engine for ``ctx.sql_transaction`` blocks in this process,
                        so blocks on one engine run at most this many at a time (bounded by the
                        engine's pool size + overflow; logged when the engine is first used)
    pattern_refresh     seconds between looks at the destination registry for new topics matching a
                        pattern subscription (``@svc.event("orders.*")``). Default
                        ``$FRAMEWORK_PATTERN_REFRESH``, else 5
    """

    concurrency: int = 64
    prefetch: int = 500
    block_ms: int = 2000
    visibility_timeout: float = 60.0
    ack_interval: float = 0.002
    shutdown_timeout: float = 30.0
    trim_interval: float = 30.0
    retry_interval: float = 0.25
    consumer: str | None = None
    inbox_window: float = 7 * 24 * 3600.0
    inbox_memory_budget: int = attrs.field(factory=lambda: inbox_memory_budget())
    group_commit_size: int = 32
    group_commit_wait: float = 0.005
    sql_connections: int = 8
    ownership: str = attrs.field(factory=lambda: ownership_mode())
    lease_ttl: float = attrs.field(factory=lambda: lease_ttl())
    pattern_refresh: float = attrs.field(factory=lambda: pattern_refresh())

    def __attrs_post_init__(self) -> None:
        for name in _DURATIONS:  # nan passes every comparison below (a nan lease crashes every task)
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number of seconds, got {value!r}")
        if self.concurrency < 1 or self.prefetch < 1:
            raise ValueError("concurrency and prefetch must be at least 1")
        if self.group_commit_size < 1 or self.sql_connections < 1:
            raise ValueError("group_commit_size and sql_connections must be at least 1")
        if self.group_commit_wait < 0:
            raise ValueError("group_commit_wait must not be negative")
        if self.ownership not in _OWNERSHIP:
            raise ValueError(f"ownership must be one of {', '.join(_OWNERSHIP)}, got {self.ownership!r}")
        if self.lease_ttl < 0.3:
            raise ValueError("lease_ttl must be at least 0.3 seconds")
        if self.pattern_refresh <= 0:
            raise ValueError("pattern_refresh must be a positive number of seconds")
        if self.visibility_timeout <= 0.1:
            raise ValueError("visibility_timeout must be more than 0.1 seconds")

    @property
    def claim_interval(self) -> float:
        """Seconds between scans for entries other consumers left idle."""
        return min(max(self.visibility_timeout / 4, 0.1), 15.0)

    @property
    def heartbeat_interval(self) -> float:
        """Seconds between heartbeats (and lease renewals) of partition ownership."""
        return self.lease_ttl / 3

    def owns_partitions(self, partitions: int) -> bool:
        """Whether a destination with ``partitions`` partitions is consumed with partition ownership."""
        return self.ownership == "all" or (self.ownership == "partitioned" and partitions > 1)

    @property
    def extend_interval(self) -> float:
        """Seconds between extensions of entries this process still holds."""
        return self.visibility_timeout / 3
