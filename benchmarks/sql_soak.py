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
import statistics
import threading
import time
from collections.abc import Sequence

import anyio
import psycopg

from benchmarks import sql_bench
from benchmarks.sql_services import EFFECTS_TABLE, GROUP
from benchmarks.sql_soak_load import Ledger, Options, Progress, publish
from benchmarks.sql_soak_monitor import KEY_ENTRY_BYTES, Soak
from framework.testing import delete_namespace, unique_namespace

__all__ = ["Options", "parse", "run"]

LAG_LIMIT_S = 30.0
DRAIN_LIMIT_S = 60.0
FLAT_LIMIT = 1.10
CAPACITY_SHARE = 0.8
INBOX_BYTES_LIMIT = 32  # issue #15's target


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
                anyio.run(publish, url, namespace, rate, seconds, options, ledger)
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
            used - (inbox - KEY_ENTRY_BYTES * keys) - dlq - tables for used, inbox, _, keys, dlq, tables in soak.memory
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
