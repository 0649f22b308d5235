"""Services run as real worker processes on RabbitMQ by tests/test_rabbitmq_end_to_end.py.

``jobs`` apply each command once through ``ctx.sql_transaction`` on the SQLite file ``RESULTS_DB``
(the SQL inbox: no Redis on this transport); every run, ``flaky``'s attempts (it fails every time:
retried with backoff, then dead-lettered) and ``later``'s arrivals (a delayed command) are written
to another SQLite file, ``RUNS_DB``, so those writes never wait for a handler's transaction.
``billing`` has the default inbox (the Redis inbox beside RabbitMQ) and writes what it does to files.
"""

from __future__ import annotations

import os
import sqlite3
import time

from framework import Context, Queue, RetryPolicy, Service, Topic

JOBS = Queue("rabbit.jobs", partitions=2)
FLAKY = Queue("rabbit.flaky")
LATER = Queue("rabbit.later")
CRASHY = Queue("rabbit.crashy")
NOTED = Topic("rabbit.noted")
TICKS = Queue("rabbit.ticks", partitions=2)
CHARGES = Queue("rabbit.charges", partitions=2)

SLEEP = float(os.environ.get("JOB_SLEEP", "0"))
_engine = None


def _db():  # type: ignore[no-untyped-def]
    global _engine
    if _engine is None:
        from framework.sql import create_engine

        _engine = create_engine(f"sqlite+aiosqlite:///{os.environ['RESULTS_DB']}")
    return _engine


def _record(sql: str, *args: object) -> None:
    """Write a row outside any transaction of the handler (attempts that fail still count)."""
    with sqlite3.connect(os.environ["RUNS_DB"], timeout=30) as conn:
        conn.execute(sql, args)


shop = Service("shop", inbox="sql", retry=RetryPolicy(max_attempts=3, immediate=0, backoff=0.3, jitter=False))


@shop.command(JOBS, key=lambda c: c["key"])
async def job(cmd: dict, ctx: Context) -> None:
    """Applies a job once (its row and the inbox row commit together), in order per key."""
    import anyio
    from sqlalchemy import text

    _record("INSERT INTO runs (n, consumer) VALUES (?, ?)", cmd["n"], os.environ.get("CONSUMER_NAME", "?"))
    async with ctx.sql_transaction(_db()) as conn:
        if SLEEP:
            await anyio.sleep(SLEEP)
        await conn.execute(
            text("INSERT INTO applied (n, key, seq) VALUES (:n, :key, :seq)"),
            {"n": cmd["n"], "key": cmd["key"], "seq": cmd["seq"]},
        )


@shop.command(FLAKY, inbox=False)
def flaky(cmd: dict, ctx: Context) -> None:
    """Fails every time: retried with backoff, then dead-lettered with the reason."""
    _record("INSERT INTO attempts (n, attempt, at) VALUES (?, ?, ?)", cmd["n"], ctx.attempt, time.time())
    raise ValueError(f"flaky job {cmd['n']} failed on purpose")


@shop.command(LATER, inbox=False)
def later(cmd: dict, ctx: Context) -> None:
    """Records when a delayed command arrived, and publishes that it did (to every subscribing service)."""
    _record("INSERT INTO arrivals (n, at) VALUES (?, ?)", cmd["n"], time.time())
    ctx.publish(NOTED, {"n": cmd["n"]})


audit = Service("audit", inbox=False)
mail = Service("mail", inbox=False)


@audit.event(NOTED)
def audit_noted(evt: dict, ctx: Context) -> None:
    """One subscriber of the event: each service gets its own copy."""
    _record("INSERT INTO noted (service, n) VALUES ('audit', ?)", evt["n"])


@mail.event(NOTED)
def mail_noted(evt: dict, ctx: Context) -> None:
    """The other subscriber."""
    _record("INSERT INTO noted (service, n) VALUES ('mail', ?)", evt["n"])


@shop.command(CRASHY, inbox=False)
def crashy(cmd: dict, ctx: Context) -> None:
    """A command named 'crash' kills its process every time; the others are recorded."""
    _record("INSERT INTO arrivals (n, at) VALUES (?, ?)", -1 if cmd["n"] == "crash" else cmd["n"], time.time())
    if cmd["n"] == "crash":
        os._exit(17)


ticker = Service("ticker", inbox=False)


@ticker.command(TICKS, key=lambda c: c["key"])
def tick(cmd: dict, ctx: Context) -> None:
    """Appends ``key n`` to this worker's own file in ``RUNS_DIR`` (no lock a paused worker could hold)."""
    time.sleep(SLEEP)
    path = os.path.join(os.environ["RUNS_DIR"], os.environ.get("CONSUMER_NAME", "w"))
    with open(path, "a") as f:
        f.write(f"{cmd['key']} {cmd['n']}\n")


billing = Service("billing")  # the default inbox: on RabbitMQ, the Redis inbox beside the server


def _line(text: str) -> None:
    """Append a line to this worker's own file in ``RUNS_DIR`` (written through at once: survives a SIGKILL)."""
    path = os.path.join(os.environ["RUNS_DIR"], os.environ.get("CONSUMER_NAME", "w"))
    with open(path, "a") as f:
        f.write(text + "\n")


@billing.command(CHARGES, key=lambda c: c["key"])
def charge(cmd: dict, ctx: Context) -> None:
    """Writes ``start n``, works, then writes ``end n``: its effect, which must happen once per message."""
    _line(f"start {cmd['n']} {ctx.message_id}")
    time.sleep(SLEEP)
    _line(f"end {cmd['n']} {ctx.message_id}")


everything = [shop, audit, mail]  # framework run rabbitapp:everything
