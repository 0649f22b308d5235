"""The yardstick of the SQL-effects benchmark: a plain redis-py + psycopg 3 batch consumer.

    python -m benchmarks.plain_sql_consumer --redis-url URL --database-url URL --namespace NS --consumer NAME

What a competent engineer writes without the framework, with the same guarantees as a handler in
``ctx.sql_transaction`` (effects exactly once, nothing lost):

* ``XREADGROUP`` a batch (``--batch``, default 100; ``BLOCK`` 1 s when idle) from the same stream
  layout and entries the framework's :class:`~framework.Client` writes;
* one PostgreSQL transaction per batch: the inbox rows for the whole batch in one
  ``INSERT ... SELECT unnest(...) ON CONFLICT DO NOTHING RETURNING message_id`` (a message whose id is
  already there is a duplicate and is skipped), then per new message the same
  :data:`~benchmarks.sql_services.WORK_S` of work and the same row (``executemany``, which psycopg
  pipelines), then COMMIT;
* only after the commit: ``XACK`` + ``XDEL`` of the batch in one pipeline (the framework's queues
  delete acknowledged entries too), and the latency samples of recorded messages (``RPUSH``);
* at start, and after any error, it re-reads its own pending entries (``XREADGROUP ... 0``) before
  new ones; every 5 s it ``XAUTOCLAIM``\\ s entries idle longer than ``--claim-idle`` seconds (a dead
  consumer's);
* an undecodable entry is copied to ``<stream>:plain-dlq`` and acknowledged.

It is synchronous (one connection to each server, the work as ``time.sleep``: ``BENCH_WORK_MS``, default
2 ms, none at 0, as in :mod:`benchmarks.sql_services`), so one
process works through one batch at a time; run several processes for more. SIGTERM finishes the
current batch and exits 0. It does not retry failing handlers with backoff (the benchmark's
messages never fail): a failing batch is rolled back and read again from the pending entries.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Any

import orjson
import psycopg
import redis

from benchmarks.sql_services import EFFECTS_TABLE, PLAIN_INBOX_TABLE, WORK_S, latency_key, stream_key

__all__ = ["PLAIN_GROUP", "PlainConsumer", "main"]

PLAIN_GROUP = "plain"
_CLAIM_EVERY_S = 5.0

_CLAIM_INBOX = (
    f"INSERT INTO {PLAIN_INBOX_TABLE} (group_name, message_id) SELECT %s, unnest(%s::text[]) "
    "ON CONFLICT DO NOTHING RETURNING message_id"
)
_INSERT = f"INSERT INTO {EFFECTS_TABLE} (seq, sent_ns) VALUES (%s, %s)"


class PlainConsumer:
    """One consumer process: read a batch, apply it in one transaction, ack after the commit."""

    def __init__(
        self, redis_url: str, database_url: str, namespace: str, consumer: str, batch: int, claim_idle_s: float
    ) -> None:
        self.redis = redis.Redis.from_url(redis_url, protocol=2)
        self.redis.set_response_callback("XREADGROUP", lambda response, **_: response)
        self.redis.set_response_callback("XAUTOCLAIM", lambda response, **_: response)
        self.database_url = database_url
        self.db: psycopg.Connection[Any] | None = None
        self.stream = stream_key(namespace)
        self.dlq = f"{self.stream}:plain-dlq"
        self.latency = latency_key(namespace)
        self.consumer = consumer
        self.batch = batch
        self.claim_idle_ms = int(claim_idle_s * 1000)
        self.stopping = False
        self.own_pending = True  # re-read our own pending entries first
        self.next_claim = 0.0

    def _connect_db(self) -> psycopg.Connection[Any]:
        if self.db is None or self.db.closed:
            self.db = psycopg.connect(self.database_url)
        return self.db

    def _create_group(self) -> None:
        try:
            self.redis.xgroup_create(self.stream, PLAIN_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def _read(self) -> list[tuple[bytes, Any]]:
        """The next entries to process: own pending first, then claimed ones when due, then new ones."""
        if time.monotonic() >= self.next_claim:
            self.next_claim = time.monotonic() + _CLAIM_EVERY_S
            reply = self.redis.execute_command(
                "XAUTOCLAIM", self.stream, PLAIN_GROUP, self.consumer, self.claim_idle_ms, "0-0", "COUNT", self.batch
            )
            if reply and reply[1]:
                return list(reply[1])
        start = "0" if self.own_pending else ">"
        args: list[Any] = ["XREADGROUP", "GROUP", PLAIN_GROUP, self.consumer, "COUNT", self.batch]
        if not self.own_pending:
            args += ["BLOCK", 1000]
        reply = self.redis.execute_command(*args, "STREAMS", self.stream, start)
        entries = list(reply[0][1]) if reply else []
        if self.own_pending and not entries:
            self.own_pending = False
        return entries

    def _process(self, entries: list[tuple[bytes, Any]]) -> None:
        """Apply a batch in one transaction, then acknowledge it."""
        ids: list[bytes] = []
        messages: list[tuple[str, dict[str, Any]]] = []
        poison: list[tuple[bytes, Any]] = []
        for entry_id, raw in entries:
            ids.append(entry_id)
            if raw is None:  # deleted while pending: nothing left to apply
                continue
            fields = dict(zip(raw[::2], raw[1::2], strict=True))
            try:
                body = orjson.loads(fields[b"body"])
                messages.append(
                    (
                        fields[b"id"].decode(),
                        {"seq": int(body["seq"]), "sent_ns": int(body["sent_ns"]), "record": bool(body.get("record"))},
                    )
                )
            except (KeyError, ValueError, TypeError, orjson.JSONDecodeError):
                poison.append((entry_id, raw))
        recorded: list[tuple[int, int]] = []
        if messages:
            db = self._connect_db()
            with db.transaction(), db.cursor() as cur:
                cur.execute(_CLAIM_INBOX, (PLAIN_GROUP, [mid for mid, _ in messages]))
                new = {row[0] for row in cur.fetchall()}
                rows = []
                for mid, m in messages:
                    if mid in new:
                        if WORK_S:
                            time.sleep(WORK_S)
                        rows.append((m["seq"], m["sent_ns"]))
                        if m["record"]:
                            recorded.append((m["seq"], m["sent_ns"]))
                if rows:
                    cur.executemany(_INSERT, rows)
        committed = time.time_ns()
        pipe = self.redis.pipeline(transaction=False)
        for entry_id, raw in poison:
            pipe.xadd(self.dlq, {"entry": entry_id, "fields": orjson.dumps([v.decode("latin-1") for v in raw])})
        if recorded:
            pipe.rpush(self.latency, *(f"{seq}:{committed - sent}" for seq, sent in recorded))
        pipe.xack(self.stream, PLAIN_GROUP, *ids)
        pipe.xdel(self.stream, *ids)
        pipe.execute()

    def run(self) -> None:
        """Consume until SIGTERM; errors roll back, wait a little and re-read the pending entries."""
        self._create_group()
        while not self.stopping:
            try:
                entries = self._read()
                if entries:
                    self._process(entries)
            except (redis.ConnectionError, redis.TimeoutError, psycopg.OperationalError) as exc:
                print(f"{self.consumer}: {type(exc).__name__}: {exc}; retrying", file=sys.stderr, flush=True)
                if isinstance(exc, psycopg.OperationalError) and self.db is not None:
                    self.db.close()
                self.own_pending = True
                time.sleep(0.1)
        self.redis.close()
        if self.db is not None:
            self.db.close()


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments and consume until SIGTERM."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.plain_sql_consumer", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--consumer", required=True)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--claim-idle", type=float, default=60.0, help="seconds before another's entry is claimed")
    args = parser.parse_args(argv)
    consumer = PlainConsumer(
        args.redis_url, args.database_url, args.namespace, args.consumer, args.batch, args.claim_idle
    )

    def stop(_signum: int, _frame: Any) -> None:
        consumer.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    consumer.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
