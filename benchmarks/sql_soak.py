"""Soak: the SQL-effects path under a steady load and a mix of faults, minute after minute (issue #15).

    python -m benchmarks soak [--minutes 20] [--rate R] [--workers 3]

Not part of the default run or CI. On an embedded Valkey (or ``$REDIS_URL``) and a scratch
PostgreSQL database (``$DATABASE_URL``'s server, else embedded), with the workers of
:mod:`benchmarks.sql_services` (``python -m framework run``, default settings, one queue):

1. **capacity**: unless ``--rate`` is given, a fault-free drain of 3,000 messages by the same
   number of workers measures the capacity; the soak offers 80% of it.
2. **load**: for ``--minutes``, messages are published at the rate (a tick every 50 ms sends what
   is due, with :meth:`RedisBroker.publish` and message ids fixed before the first try, so a
   publish repeated after a reset connection repeats the same ids). Of them 1% always fail (the
   handler raises inside its transaction: retries, then the dead-letter stream) and 0.5% are
   malformed (raw entries without a body, with a body that is not JSON, or with JSON of the wrong
   shape: dead-lettered at once).
3. **faults**, during the load: every 20-40 s two of the workers (``w1`` and ``w2``; ``w0`` lives
   throughout, so its RSS shows a leak) are SIGKILLed and restarted under their names; once a
   minute every client connection is reset (``CLIENT KILL TYPE normal SKIPME yes``: the
   publisher's too, the monitor's own is skipped).
4. **every minute** a line: offered and processed (this minute and in total), lag now and its
   maximum this minute (entries behind: the stream's unacknowledged entries plus the group's
   redelivery stream; seconds of traffic behind: entries / rate), dead letters, worker RSS, the
   server's ``used_memory`` and the memory of the group's Redis inbox.
5. **drain**: load and faults stop; the time until every good message has its row, every bad
   one is dead-lettered and nothing is left in the stream, retry and delay structures.

Pass criteria (printed at the end): lag never above 30 s of traffic; drained within 60 s of the
load's end; every good message's row present exactly once (nothing lost, nothing applied twice);
no row of a failing message; every failing and malformed message in the dead-letter stream (by
message id) and no good one; worker ``w0``'s RSS and the server's ``used_memory`` apart from the
group's Redis inbox, its dead-letter stream, the backlog (the streams and delayed retries: that is
the lag, judged above) and the server's key tables flat: median of the load's
last quarter at most 1.10x the first quarter's (the inbox keeps every processed id for its window
and the DLQ every dead letter until purged, by design, and the key tables grow in steps with the
inbox's bucket keys; the inbox is judged by its bytes per remembered id instead, at most 32).
``--kind framework-sqlinbox`` runs ``inbox="sql"`` (no Redis inbox).
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import attrs
import psycopg
import redis

from benchmarks import sql_bench
from benchmarks.procs import Child, rss_kib
from benchmarks.sql_services import EFFECTS_TABLE, GROUP, SQL_QUEUE, SqlMessage, stream_key
from broker import COMMAND
from broker.ids import new_id
from framework import Client
from framework._messages import build_envelope
from framework.testing import delete_namespace, unique_namespace

__all__ = ["Options", "parse", "run"]

LAG_LIMIT_S = 30.0
DRAIN_LIMIT_S = 60.0
FLAT_LIMIT = 1.10
CAPACITY_SHARE = 0.8
TICK_S = 0.05

Progress = Callable[[str], None]


@attrs.frozen
class Options:
    """What the soak does: how long, how fast (None: 80% of the measured capacity), how many workers."""

    minutes: float = 20.0
    rate: float | None = None
    workers: int = 3
    fail_every: int = 100  # 1 in 100 messages always fails
    malformed_every: int = 200  # 1 in 200 is malformed
    kill_every: tuple[float, float] = (20.0, 40.0)
    reset_every: float = 60.0
    capacity_messages: int = 3000
    drain_timeout: float = 180.0
    kind: str = "framework"


def parse(argv: Sequence[str]) -> Options:
    """``python -m benchmarks soak`` arguments."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks soak", description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="minutes of load (default 20)")
    parser.add_argument("--rate", type=float, default=None, help="msg/s offered (default: 80%% of measured capacity)")
    parser.add_argument("--workers", type=int, default=3, help="worker processes (default 3; two are killed)")
    parser.add_argument(
        "--kind",
        choices=("framework", *sql_bench.FRAMEWORK_MODES),
        default="framework",
        help="framework mode (default: framework, the Redis inbox on; framework-sqlinbox: inbox='sql')",
    )
    args = parser.parse_args(list(argv))
    if args.workers < 3:
        parser.error("--workers must be at least 3 (two are killed at a time, one lives throughout)")
    return Options(minutes=args.minutes, rate=args.rate, workers=args.workers, kind=args.kind)


def _kind(seq: int, options: Options) -> str:
    if seq % options.malformed_every == options.malformed_every - 1:
        return "malformed"
    if seq % options.fail_every == options.fail_every // 2:
        return "fail"
    return "good"


class Ledger:
    """What the publisher sent, by kind: sequence numbers of good and failing messages, bad message ids."""

    def __init__(self) -> None:
        self.sent = 0
        self.good: set[int] = set()
        self.fail_seqs: set[int] = set()
        self.bad_ids: set[str] = set()  # failing and malformed: all must reach the dead-letter stream
        self.good_ids: set[str] = set()
        self.publish_retries = 0


_MALFORMED_BODIES = (None, b"{not json", b'{"nope": 1}')


async def _publish(url: str, namespace: str, rate: float, seconds: float, options: Options, ledger: Ledger) -> None:
    """Offer ``rate`` msg/s for ``seconds``; a failed publish is repeated with the same ids until it succeeds."""
    stream = stream_key(namespace)
    async with Client(url, namespace=namespace) as client:
        broker = client.broker
        await broker.declare(SQL_QUEUE.spec())
        began = time.monotonic()
        seq = 0
        while (now := time.monotonic()) - began < seconds:
            due = int((now - began) * rate)
            envelopes, raw = [], []
            for s in range(seq, due):
                kind = _kind(s, options)
                if kind == "malformed":
                    mid = new_id()
                    fields: list[Any] = ["id", mid, "type", "SqlMessage", "ts", time.time_ns() // 1_000_000]
                    body = _MALFORMED_BODIES[(s // options.malformed_every) % len(_MALFORMED_BODIES)]
                    if body is not None:
                        fields += ["body", body]
                    raw.append(fields)
                    ledger.bad_ids.add(mid)
                    continue
                msg = SqlMessage(s, time.time_ns(), fail=kind == "fail")
                env, _ = build_envelope(SQL_QUEUE, COMMAND, msg, key=str(s % sql_bench.KEYS))
                envelopes.append(env)
                if kind == "fail":
                    ledger.fail_seqs.add(s)
                    ledger.bad_ids.add(env.id)
                else:
                    ledger.good.add(s)
                    ledger.good_ids.add(env.id)
            while envelopes or raw:
                try:
                    if envelopes:
                        await broker.publish(envelopes)
                        envelopes = []
                    for fields in list(raw):
                        await broker.redis.execute_command("XADD", stream, "*", *fields)
                        raw.remove(fields)
                except Exception:
                    ledger.publish_retries += 1
                    await anyio.sleep(0.05)
            ledger.sent = due
            seq = due
            await anyio.sleep(TICK_S)


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
        buckets = [k for k in keys if b":b:" in (k if isinstance(k, bytes) else k.encode())]
        for key in buckets:
            pipe.hlen(key)
        pipe.zcard(self.inbox)
        replies = pipe.execute(raise_on_error=False)
        sizes, counts = replies[: len(keys)], replies[len(keys) :]
        used = sum(int(v) + _KEY_ENTRY_BYTES for v in sizes if isinstance(v, int))
        return used, sum(int(v) for v in counts if isinstance(v, int)), len(keys)

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


INBOX_BYTES_LIMIT = 32  # issue #15's target
_KEY_ENTRY_BYTES = 56  # a key's keyspace and expiry entries, which MEMORY USAGE leaves out (an estimate)


def _quarters(values: list[float]) -> tuple[float, float]:
    q = max(1, len(values) // 4)
    return statistics.median(values[:q]), statistics.median(values[-q:])


def _soak(url: str, db_url: str, rate: float, options: Options, progress: Progress) -> int:
    namespace = unique_namespace("bench-soak")
    soak = Soak(url, db_url, namespace, rate, options, progress)
    ledger = Ledger()
    seconds = options.minutes * 60
    sql_bench.truncate(db_url)
    try:
        with psycopg.connect(db_url, autocommit=True) as db:
            soak.workers = [soak.start(i) for i in range(options.workers)]
            names = {f"w{i}" for i in range(options.workers)}
            sql_bench.wait_ready(soak.mon, soak.stream, GROUP, names, soak.workers, timeout=60)
            progress(
                f"soak: {options.minutes:g} min at {rate:,.0f} msg/s, {options.workers} workers; "
                f"1/{options.fail_every} failing, 1/{options.malformed_every} malformed; "
                f"w1+w2 SIGKILLed every {options.kill_every[0]:g}-{options.kill_every[1]:g} s; "
                f"connections reset every {options.reset_every:g} s"
            )
            monitor = threading.Thread(target=soak.monitor, args=(ledger, seconds, db), name="soak-monitor")
            monitor.start()
            try:
                anyio.run(_publish, url, namespace, rate, seconds, options, ledger)
            except BaseException:  # Ctrl-C, SIGTERM: no more faults, no restarts; stop now
                soak.stopping.set()
                raise
            finally:
                monitor.join()
            load_end = time.monotonic()
            progress(f"soak: load over ({ledger.sent:,} sent); faults stopped; waiting for the drain")
            drain_s: float | None = None
            while time.monotonic() - load_end < options.drain_timeout:
                if soak.drained(ledger, db):
                    drain_s = time.monotonic() - load_end
                    break
                for w in soak.workers:
                    w.check()
                time.sleep(0.2)
            dup = db.execute(
                f"SELECT count(*) FROM (SELECT seq FROM {EFFECTS_TABLE} GROUP BY seq HAVING count(*) > 1) d"
            ).fetchone()
            seqs = {row[0] for row in db.execute(f"SELECT DISTINCT seq FROM {EFFECTS_TABLE}")}
        dead_ids = soak.dead_letter_ids()
        lost = ledger.good - seqs
        failing_applied = ledger.fail_seqs & seqs
        bad_missing = ledger.bad_ids - dead_ids
        good_dead = ledger.good_ids & dead_ids
        duplicates = int(dup[0]) if dup else 0
        max_lag_s = max((s["lag_s"] for s in soak.samples), default=0.0)
        rss_first, rss_last = _quarters([s["rss_w0"] for s in soak.samples])
        # the inbox remembers every processed id for its window and the DLQ keeps every dead letter
        # until purged, both by design (sizing rule for the inbox: bytes per id x rate x window,
        # docs/idempotency.md), the key tables grow with the inbox's bucket keys, and the streams
        # hold the backlog (judged as lag): the server's memory apart from them must stay flat
        # (the key tables' share is measured: the per-key estimate in the inbox's bytes is taken back out)
        apart = [
            used - (inbox - _KEY_ENTRY_BYTES * keys) - dlq - tables for used, inbox, _, keys, dlq, tables in soak.memory
        ]
        mem_first, mem_last = _quarters(apart or [0])
        inbox_bytes, inbox_ids = soak.memory[-1][1:3] if soak.memory else (0, 0)
        per_id = inbox_bytes / inbox_ids if inbox_ids else 0.0
        checks = [
            (f"lag never above {LAG_LIMIT_S:g} s of traffic", f"max {max_lag_s:.1f} s", max_lag_s <= LAG_LIMIT_S),
            (
                f"drained within {DRAIN_LIMIT_S:g} s of the load's end",
                f"not drained after {options.drain_timeout:.0f} s" if drain_s is None else f"{drain_s:.1f} s",
                drain_s is not None and drain_s <= DRAIN_LIMIT_S,
            ),
            (
                "nothing lost (every good message has its row)",
                f"{len(lost):,} of {len(ledger.good):,} missing",
                not lost,
            ),
            ("nothing applied twice", f"{duplicates:,} messages with more than one row", duplicates == 0),
            ("no failing message applied", f"{len(failing_applied):,} rows", not failing_applied),
            (
                "failing + malformed all dead-lettered",
                f"{len(ledger.bad_ids) - len(bad_missing):,} of {len(ledger.bad_ids):,} "
                f"({len(ledger.fail_seqs):,} failing, {len(ledger.bad_ids) - len(ledger.fail_seqs):,} malformed)",
                not bad_missing,
            ),
            ("no good message dead-lettered", f"{len(good_dead):,}", not good_dead),
            (
                f"worker w0 RSS flat (last quarter ≤ {FLAT_LIMIT:.2f}x first)",
                f"{rss_first / 1024:.1f} → {rss_last / 1024:.1f} MiB ({rss_last / max(rss_first, 1):.2f}x)",
                rss_last <= FLAT_LIMIT * rss_first,
            ),
            (
                f"server memory apart from inbox, DLQ, backlog, key tables flat (last 1/4 ≤ {FLAT_LIMIT:.2f}x first)",
                f"{mem_first / 2**20:.1f} → {mem_last / 2**20:.1f} MiB ({mem_last / max(mem_first, 1):.2f}x)",
                mem_last <= FLAT_LIMIT * mem_first,
            ),
            (
                f"inbox bytes per remembered id ≤ {INBOX_BYTES_LIMIT}",
                f"{per_id:.1f} B ({inbox_ids:,} ids, {inbox_bytes / 2**20:.1f} MiB)"
                if inbox_ids
                else f"no Redis inbox ({inbox_bytes / 2**20:.1f} MiB)",
                per_id <= INBOX_BYTES_LIMIT,
            ),
        ]
        print(
            f"\nsoak: {options.minutes:g} min at {rate:,.0f} msg/s: {ledger.sent:,} offered, "
            f"{soak.kills} worker kills, {soak.resets} connection resets, {ledger.publish_retries} publish retries"
        )
        width = max(len(c[0]) for c in checks)
        for name, value, ok in checks:
            print(f"  {'pass' if ok else 'FAIL'}  {name:<{width}}  {value}")
        passed = all(ok for _, _, ok in checks)
        print(f"soak {'PASSED' if passed else 'FAILED'}", flush=True)
        return 0 if passed else 1
    finally:
        for w in soak.workers:
            w.stop(grace=5.0)
        soak.mon.close()
        delete_namespace(url, namespace)


def run(url: str, options: Options, *, progress: Progress) -> int:
    """Measure the capacity unless a rate is given, then soak at 80% of it; 0 if every criterion passed."""
    with sql_bench.database(prefix="sql_soak") as db_url:
        rate = options.rate
        if rate is None:
            progress(
                f"soak: measuring fault-free capacity ({options.capacity_messages:,} messages, "
                f"{options.workers} workers)"
            )
            trial = sql_bench.drain_trial(
                url, db_url, options.kind, options.workers, options.capacity_messages, progress=progress
            )
            rate = CAPACITY_SHARE * trial["msgs_per_s"]
            progress(f"soak: capacity {trial['msgs_per_s']:,.0f} msg/s → offering {rate:,.0f} msg/s")
        return _soak(url, db_url, rate, options, progress)
