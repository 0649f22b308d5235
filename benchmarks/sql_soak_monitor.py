"""The soak's side of a run of :mod:`benchmarks.sql_soak`: the workers, the faults injected into
them and their connections, and the per-second samples and per-minute lines of what the server holds.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import psycopg
import redis

from benchmarks import sql_bench
from benchmarks.procs import Child, rss_kib
from benchmarks.sql_services import GROUP, stream_key
from benchmarks.sql_soak_load import Ledger, Options, Progress

__all__ = ["KEY_ENTRY_BYTES", "Soak"]

KEY_ENTRY_BYTES = 56  # a key's keyspace and expiry entries, which MEMORY USAGE leaves out (an estimate)


class Soak:
    """The workers, the faults and the per-minute monitor of one soak run."""

    def __init__(
        self, url: str, db_url: str, namespace: str, rate: float, options: Options, progress: Progress
    ) -> None:
        self.url = url
        self.db_url = db_url
        self.namespace = namespace
        self.rate = rate
        self.options = options
        self.progress = progress
        self.stream = stream_key(namespace)
        base = f"{self.stream}:g:{GROUP}"
        self.redeliver, self.delayed, self.dlq, self.inbox = (
            f"{base}:{k}" for k in ("redeliver", "delayed", "dlq", "inbox")
        )
        self.mon = redis.Redis.from_url(url, protocol=2)  # one connection: it issues CLIENT KILL and is skipped
        self.workers: list[Child] = []
        self.kills = 0
        self.resets = 0
        self.stopping = threading.Event()  # set on Ctrl-C or SIGTERM: the monitor stops injecting faults
        self.samples: list[dict[str, float]] = []  # one per second: t, lag, rss_w0, used_memory
        # per minute: used_memory, inbox bytes, inbox ids, inbox keys, DLQ and backlog bytes, key tables
        self.memory: list[tuple[int, int, int, int, int, int]] = []

    def start(self, i: int) -> Child:
        """Start worker ``w<i>``."""
        args, env = sql_bench.worker_args(self.options.kind, self.url, self.db_url, self.namespace, f"w{i}")
        return Child(f"soak-w{i}", args, env)

    def lag(self) -> int:
        """Entries behind: unacknowledged in the stream plus waiting in the group's redelivery stream."""
        pipe = self.mon.pipeline(transaction=False)
        pipe.xlen(self.stream)
        pipe.xlen(self.redeliver)
        return sum(pipe.execute())

    def _kill_and_restart(self) -> None:
        for i in range(1, 3):
            w = self.workers[i]
            w.proc.kill()
            w.proc.wait()
            w.stop(grace=0)
            self.workers[i] = self.start(i)
        self.kills += 2

    def monitor(self, ledger: Ledger, seconds: float, db: psycopg.Connection[Any]) -> None:
        """Sample every second, inject faults, print a line a minute; returns when the load ends."""
        began = time.monotonic()
        next_kill = began + random.uniform(*self.options.kill_every)
        next_reset = began + self.options.reset_every
        next_line, minute = began + 60, 1
        last = {"sent": 0, "processed": 0}
        max_lag = 0.0
        print(
            f"{'min':>4} {'offered':>8} {'total':>8} {'processed':>9} {'total':>8} {'lag now':>8} {'lag s':>6} "
            f"{'max lag s':>9} {'DLQ':>6} {'worker RSS MiB (w0 w1 w2)':>26} {'server MiB':>10} {'inbox MiB':>9} "
            f"{'kills':>5} {'resets':>6}",
            flush=True,
        )
        while (now := time.monotonic()) - began < seconds and not self.stopping.is_set():
            lag = self.lag()
            lag_s = lag / self.rate
            max_lag = max(max_lag, lag_s)
            used = int(self.mon.info("memory")["used_memory"])
            rss0 = rss_kib(self.workers[0].pid) or 0
            self.samples.append({"t": now - began, "lag": lag, "lag_s": lag_s, "rss_w0": rss0, "used_memory": used})
            if now >= next_kill:
                self._kill_and_restart()
                next_kill = now + random.uniform(*self.options.kill_every)
            if now >= next_reset:
                self.mon.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
                self.resets += 1
                next_reset = now + self.options.reset_every
            if now >= next_line or now - began + 1 >= seconds:
                self._line(minute, ledger, db, lag, lag_s, max_lag, used, last)
                next_line += 60
                minute += 1
                max_lag = 0.0
            self.stopping.wait(max(0.0, 1.0 - (time.monotonic() - now)))

    def _line(
        self,
        minute: int,
        ledger: Ledger,
        db: psycopg.Connection[Any],
        lag: int,
        lag_s: float,
        max_lag: float,
        used: int,
        last: dict[str, int],
    ) -> None:
        rows = sql_bench.count_rows(db)
        dead = int(self.mon.xlen(self.dlq))
        processed = rows + dead
        inbox, ids, keys = self.inbox_usage()
        dlq_bytes = int(self.mon.memory_usage(self.dlq, samples=0) or 0)
        self.memory.append((used, inbox, ids, keys, dlq_bytes + self.backlog_bytes(), self.keyspace_tables()))
        rss = " ".join(f"{(rss_kib(w.pid) or 0) / 1024:.0f}" for w in self.workers)
        sent = ledger.sent
        print(
            f"{minute:>4} {sent - last['sent']:>8,} {sent:>8,} {processed - last['processed']:>9,} {processed:>8,} "
            f"{lag:>8,} {lag_s:>6.1f} {max_lag:>9.1f} {dead:>6,} {rss:>26} {used / 2**20:>10.1f} "
            f"{inbox / 2**20:>9.1f} {self.kills:>5} {self.resets:>6}",
            flush=True,
        )
        last["sent"], last["processed"] = sent, processed

    def backlog_bytes(self) -> int:
        """Bytes of the work not yet done (the stream, the redelivery stream, the delayed retries):
        it follows the lag, which is judged on its own."""
        pipe = self.mon.pipeline(transaction=False)
        for key in (self.stream, self.redeliver, self.delayed):
            pipe.memory_usage(key, samples=0)
        return sum(int(v or 0) for v in pipe.execute(raise_on_error=False) if isinstance(v, int))

    def keyspace_tables(self) -> int:
        """Bytes of the server's key tables (``MEMORY STATS``: each database's main and expiry hash
        tables, and Valkey's lookup tables). They grow in steps with the number of keys, which the
        inbox's buckets dominate; ``MEMORY USAGE`` of a key leaves them out."""
        stats = self.mon.memory_stats()
        total = int(stats.get("overhead.db.hashtable.lut", 0) or 0)
        for name, value in stats.items():
            if name.startswith("db.") and isinstance(value, dict):
                total += int(value.get("overhead.hashtable.main", 0)) + int(value.get("overhead.hashtable.expires", 0))
        return total

    def inbox_usage(self) -> tuple[int, int, int]:
        """Server bytes of the group's Redis inbox (every key: zset, buckets, slot records; MEMORY
        USAGE + about 56 bytes of keyspace and expiry entries each), the ids it remembers, its keys."""
        keys = [self.inbox, *self.mon.scan_iter(f"{self.inbox}:*", count=1000)]
        pipe = self.mon.pipeline(transaction=False)
        for key in keys:
            pipe.memory_usage(key, samples=0)
        names = [k if isinstance(k, bytes) else k.encode() for k in keys]
        hashes = [k for k in names if b":b:" in k]  # a hash bucket: a field per id
        flats = [k for k in names if b":a:" in k]  # a flat bucket: 13 bytes per id
        for key in hashes:
            pipe.hlen(key)
        for key in flats:
            pipe.strlen(key)
        pipe.zcard(self.inbox)
        replies = pipe.execute(raise_on_error=False)
        sizes, counts = replies[: len(keys)], replies[len(keys) :]
        used = sum(int(v) + KEY_ENTRY_BYTES for v in sizes if isinstance(v, int))
        n = [int(v) if isinstance(v, int) else 0 for v in counts]
        ids = sum(n[: len(hashes)]) + sum(v // 13 for v in n[len(hashes) : -1]) + n[-1]
        return used, ids, len(keys)

    def dead_letter_ids(self) -> set[str]:
        """Message ids in the group's dead-letter stream (a repeated publish may have left two entries)."""
        ids: set[str] = set()
        for _, fields in self.mon.xrange(self.dlq, "-", "+"):
            if b"id" in fields:
                ids.add(fields[b"id"].decode())
        return ids

    def drained(self, ledger: Ledger, db: psycopg.Connection[Any]) -> bool:
        """Every good row written, every bad message dead-lettered, nothing left to process or retry."""
        pipe = self.mon.pipeline(transaction=False)
        pipe.xlen(self.stream)
        pipe.xlen(self.redeliver)
        pipe.zcard(self.delayed)
        if any(pipe.execute()):
            return False
        return sql_bench.count_rows(db) >= len(ledger.good) and ledger.bad_ids <= self.dead_letter_ids()
