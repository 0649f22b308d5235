"""Runtime settings: one place for every knob of a worker process, with the defaults explained."""

from __future__ import annotations

import math

import attrs

__all__ = ["RuntimeSettings"]

_DURATIONS = (
    "visibility_timeout",
    "ack_interval",
    "shutdown_timeout",
    "trim_interval",
    "retry_interval",
    "inbox_window",
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
    ack_interval        seconds acks wait to be batched into one call
    shutdown_timeout    seconds in-flight handlers get to finish after SIGTERM
    trim_interval       seconds between retention passes over topic partitions
    retry_interval      seconds between moves of due delayed retries
    consumer            consumer name (default: host name plus a slot number held by a lock file,
                        so a restarted process gets its old name and re-reads its own pending entries)
    inbox_window        seconds processed message ids are remembered for deduplication
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

    def __attrs_post_init__(self) -> None:
        for name in _DURATIONS:  # nan passes every comparison below (a nan lease crashes every task)
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number of seconds, got {value!r}")
        if self.concurrency < 1 or self.prefetch < 1:
            raise ValueError("concurrency and prefetch must be at least 1")
        if self.visibility_timeout <= 0.1:
            raise ValueError("visibility_timeout must be more than 0.1 seconds")

    @property
    def claim_interval(self) -> float:
        """Seconds between scans for entries other consumers left idle."""
        return min(max(self.visibility_timeout / 4, 0.1), 15.0)

    @property
    def extend_interval(self) -> float:
        """Seconds between extensions of entries this process still holds."""
        return self.visibility_timeout / 3
