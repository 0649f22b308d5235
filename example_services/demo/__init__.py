"""``make demo``: the example shop end to end, on real servers, with workers killed and paused.

Starts the embedded Valkey and PostgreSQL (or uses ``--broker-url`` / ``--database-url``), the
shop's services as seven worker processes (two billing, two inventory), the outbox relay and the
HTTP API; places orders through the API while showing live progress; SIGKILLs a billing worker and
SIGSTOPs an inventory worker past its partition lease halfway; shows what the framework did about
it (from the workers' own logs and metrics); runs the Spark analytics over the event log; and ends
with a ledger it asserts: exit status 1 when it does not add up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
from rich.console import Console
from rich.live import Live

from broker import redact
from example_services.demo import live, load
from example_services.demo.ledger import Check, checks, dead_letters, progress
from example_services.demo.stack import FULFILMENT_TIMEOUT, LEASE_TTL, DemoError, Stack, running_stack
from framework.faults import Recovery

console = Console(width=None if sys.stdout.isatty() else 120)
NAMESPACE = os.environ.get("FRAMEWORK_DEMO_NAMESPACE", "shop-demo")


def _bin(tool: str) -> str:
    """How to run ``tool`` from here: ``.venv/bin/framework`` when it is not on PATH."""
    folder = Path(sys.executable).parent
    try:
        return str(folder.relative_to(Path.cwd()) / tool)
    except ValueError:
        return tool


async def _workload(stack: Stack, orders: list[load.Order], say: list[str]) -> dict[str, Any]:
    """Place the orders, watch, inject the faults; return what the ledger needs."""
    from example_services.shop import db

    accepted: dict[str, load.Order] = {}
    engine = db.open_engine(stack.database_url)
    n = len(orders)
    malformed = await load.send_malformed(stack.broker_url, stack.namespace)
    placing = max(n / 150, 12.0)  # seconds: a steady stream, so the faults land mid-flow
    errors: list[str] = []
    done = anyio.Event()
    started = time.monotonic()

    async def place() -> None:
        errors.extend(await load.place_all(stack.api, orders, placing, lambda oid, o: accepted.__setitem__(oid, o)))
        done.set()

    def note(text: str) -> None:
        say.append(text)
        console.print(f"[yellow]{text}[/]")

    killed = paused = False
    pool = stack.pool
    last_plain = 0.0
    snap: dict[str, int] = {}
    counters: dict[str, dict[str, int]] = {}
    try:
        with Live(console=console, refresh_per_second=4, transient=False) as view:
            async with anyio.create_task_group() as tg:
                tg.start_soon(place)
                moved, seen = time.monotonic(), (-1, -1)  # give up only after 90 s without progress
                while time.monotonic() - moved < 90 + FULFILMENT_TIMEOUT:
                    async with engine.connect() as conn:
                        snap = await progress(conn)
                    counters = await anyio.to_thread.run_sync(pool.counters)
                    final = sum(snap.get(s, 0) for s in ("shipped", "declined", "cancelled"))
                    if (final, snap["emails"]) != seen:
                        moved, seen = time.monotonic(), (final, snap["emails"])
                    if not killed and snap["charged"] >= 0.3 * n:
                        pool.kill("billing-2")
                        killed = True
                        note(
                            f"SIGKILL billing-2 at {snap['charged']} charges: what it held stays pending; its "
                            f"leases expire within {LEASE_TTL:g} s and billing-1 takes its partitions and entries over"
                        )
                    if not paused and snap["stock_decided"] >= 0.5 * n:
                        pool.pause("inventory-2", 2 * LEASE_TTL + 1)
                        paused = True
                        note(
                            f"SIGSTOP inventory-2 for {2 * LEASE_TTL + 1:g} s, past its {LEASE_TTL:g} s lease: "
                            "inventory-1 takes its partitions over; when it wakes, its leases are gone and its late "
                            "acks are refused"
                        )
                    rate = final / max(time.monotonic() - started, 0.1)
                    view.update(live.progress_view(n, len(accepted), snap, counters, rate, say))
                    if not console.is_terminal and time.monotonic() - last_plain > 5:
                        last_plain = time.monotonic()
                        print(live.plain_line(len(accepted), snap, counters), flush=True)
                    if (
                        done.is_set()
                        and final == len(accepted)
                        and snap["emails"] >= len(accepted)
                        and not snap["outbox"]
                    ):
                        break
                    await anyio.sleep(0.5)
        took = time.monotonic() - started
        for f in pool.faults:  # a paused worker reports what it found only once it is awake again
            if f.kind == "SIGSTOP":
                await anyio.sleep(max(f.at + f.seconds - time.monotonic(), 0))
                with anyio.move_on_after(10):
                    while "lost ownership" not in pool.log(f.worker) and pool.alive(f.worker):
                        await anyio.sleep(0.2)
        console.print()
        console.print(
            f"workload done in {took:.1f} s ({len(accepted)} orders, {len(accepted) / took:.0f}/s end to end)"
        )
        for e in errors[:5]:
            console.print(f"[red]{e}[/]")
        return {
            "accepted": len(accepted),
            "invalid": sum(1 for o in accepted.values() if o.card == load.INVALID_CARD),
            "malformed": malformed,
            "killed": killed,
            "paused": paused,
            "counters": await anyio.to_thread.run_sync(pool.counters),
        }
    finally:
        await engine.dispose()


def _start_spark(stack: Stack) -> subprocess.Popen[str]:
    """Start the analytics job now (its own process and JVM); it computes when told (:func:`_spark`)."""
    env = {**os.environ, "REDIS_URL": stack.broker_url, "FRAMEWORK_NAMESPACE": stack.namespace}
    env.pop("BROKER_URL", None)
    return subprocess.Popen(
        [sys.executable, "-m", "example_services.shop.analytics", "--out", str(stack.logs / "lake"), "--when-told"],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _spark(job: subprocess.Popen[str]) -> dict[str, Any]:
    """Tell the analytics job to compute; its JSON summary."""
    started = time.monotonic()
    try:
        out, err = job.communicate("go\n", timeout=300)
    except subprocess.TimeoutExpired:
        job.kill()
        raise DemoError("the Spark job did not finish within 300 s") from None
    lines = out.strip().splitlines()
    if job.returncode != 0 or not lines or not lines[-1].startswith("{"):
        raise DemoError(f"the Spark job failed: {(err or out).strip().splitlines()[-1:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    result["seconds"] = time.monotonic() - started
    return result


async def _ledger(
    stack: Stack, w: dict[str, Any], stock: dict[str, int], spark: dict[str, Any] | None
) -> tuple[list[Any], dict[str, Any]]:
    from example_services.shop import db

    dead = await dead_letters(stack.broker_url, stack.namespace)
    engine = db.open_engine(stack.database_url)
    try:
        async with engine.connect() as conn:
            return await checks(
                conn,
                accepted=w["accepted"],
                invalid_cards=w["invalid"],
                malformed=w["malformed"],
                stock=stock,
                dead=dead,
                spark_revenue=spark["revenue_cents"] if spark else None,
            )
    finally:
        await engine.dispose()


def run(args: argparse.Namespace) -> int:
    """Run the demo; 0 when every check of the ledger holds."""
    console.rule("[bold]framework demo: the example shop, with a worker killed and one paused")
    orders = load.orders(args.orders)
    stock = load.stock_for(orders)
    t0 = time.monotonic()
    with running_stack(
        broker_url=args.broker_url, database_url=args.database_url, namespace=NAMESPACE, stock=stock, otlp=args.otlp
    ) as stack:
        console.print(f"broker: {redact(stack.broker_url)}{'  (embedded Valkey)' if stack.embedded_broker else ''}")
        console.print(f"database: {stack.database_note}")
        console.print(f"7 workers, the outbox relay and the API ({stack.api}); logs in {stack.logs}")
        say: list[str] = []
        job = None if args.no_spark else _start_spark(stack)  # the JVM starts while the orders flow
        try:
            w = anyio.run(_workload, stack, orders, say)
        except BaseException:
            if job is not None:
                job.kill()
            raise
        by_worker = {name: Recovery.from_events(stack.pool.events(name)) for name in stack.pool.procs}
        console.print(live.recovery_table(stack.pool.faults, by_worker, w["counters"]))
        spark = None
        if job is not None:
            console.print("Spark: reading the event log...")
            spark = _spark(job)
        result, figures = anyio.run(_ledger, stack, w, stock, spark)
        console.print(live.outcome_table(figures, w["accepted"]))
        for group, (d, *_) in figures["dead"].items():
            console.print(f"a dead letter of {group}: [bold]{d.ref}[/]\n  reason: {d.reason}\n  attempts: {d.attempts}")
        if spark:
            for t in live.spark_tables(spark["tables"]):
                console.print(t)
            console.print(
                f"Spark took {spark['seconds']:.0f} s; Parquet: {spark['parquet']} (per topic and date; read it "
                f"with spark.read.parquet), the tables in {Path(spark['parquet']).parent / 'tables.json'}"
            )
        faults_ok = w["killed"] and w["paused"]
        result.append(
            Check("a billing worker killed, an inventory worker paused", "yes" if faults_ok else "no", faults_ok)
        )
        console.print(live.ledger_table(result))
        ok = all(c.ok for c in result)
        fw = _bin("framework")
        console.print(
            f"took {time.monotonic() - t0:.0f} s; "
            + ("[bold green]the ledger adds up[/]" if ok else "[bold red]the ledger does NOT add up[/]")
        )
        tries = [
            (f"{fw} status --namespace {NAMESPACE}", "destinations, groups, lag, dead letters"),
            (f"{fw} dlq list --namespace {NAMESPACE}", "the invalid cards and malformed e-mails, with reasons"),
            (f"{fw} asyncapi example_services.shop.billing --html -o billing.html", "the contract as a page"),
            (f"{_bin('python')} -m pytest tests/shop", "each service's tests, the fault test among them"),
        ]
        if stack.embedded_broker:
            tries.append((f"{fw} server stop", "stop the embedded Valkey"))
        width = max(len(cmd) for cmd, _ in tries) + 2
        console.print("next:\n" + "\n".join(f"  {cmd.ljust(width)}# {why}" for cmd, why in tries), soft_wrap=True)
        if fw != "framework":
            console.print("(or `source .venv/bin/activate` first, then drop the .venv/bin/ prefix)")
        where = f"traces and metrics went to {args.otlp}" if args.otlp else "traces: rerun with --otlp URL"
        console.print(
            f"{where}; `docker compose up -d otel-collector jaeger prometheus grafana` gives a collector "
            "(--otlp http://127.0.0.1:4318), Jaeger (http://127.0.0.1:16686) and the Grafana dashboard "
            "(http://127.0.0.1:3000)",
            soft_wrap=True,
        )
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """Parse the options and run the demo."""
    parser = argparse.ArgumentParser(prog="python -m example_services.demo", description=__doc__)
    parser.add_argument("--orders", type=int, default=2000, help="orders to place (default 2000)")
    parser.add_argument("--no-spark", action="store_true", help="skip the Spark analytics")
    parser.add_argument(
        "--broker-url",
        "--redis-url",
        dest="broker_url",
        default=None,
        help="a Redis/Valkey URL (default: $REDIS_URL, else the embedded Valkey)",
    )
    parser.add_argument(
        "--database-url",
        default=None,
        help="a PostgreSQL server the demo creates (and drops) its own database on (default: embedded)",
    )
    parser.add_argument(
        "--otlp", default=None, metavar="URL", help="send traces and metrics to this OTLP/HTTP endpoint"
    )
    args = parser.parse_args(argv)
    if args.orders < 20:
        parser.error("--orders must be at least 20")
    if args.database_url and not args.database_url.startswith(("postgresql", "postgres:")):
        console.print(
            f"[red]demo: --database-url must be a PostgreSQL URL (the demo creates its own database there), "
            f"not {args.database_url!r}[/]"
        )
        return 2
    try:
        return run(args)
    except DemoError as exc:
        console.print(f"[red]demo: {exc}[/]")
        return 2
