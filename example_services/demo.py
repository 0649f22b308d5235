"""``make demo``: two services end to end on a real broker, with a worker killed mid-stream.

Starts the embedded Valkey (or uses ``$REDIS_URL``), runs ``orders`` and two ``billing`` workers as
separate processes, places orders (a few with declined cards), SIGKILLs one billing worker while
it is busy, and checks the outcome: every good order charged exactly once, every declined one in
billing's dead-letter queue with its reason, nothing lost, nothing doubled.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import redis
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from broker import connect, redact, resolve_url
from broker.redis import default_data_dir
from broker.redis.inspect import describe
from framework import SyncClient
from framework.dead_letters import DeadLetters
from framework.testing import delete_namespace

console = Console()
NAMESPACE = os.environ.get("FRAMEWORK_DEMO_NAMESPACE", "demo")
os.environ["FRAMEWORK_NAMESPACE"] = NAMESPACE  # before quickstart is imported: its keys live there too


from example_services.quickstart import CHARGES_KEY, PLACE_ORDER, REVENUE_KEY, PlaceOrder  # noqa: E402


def _start_worker(target: str, name: str, url: str, logs: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "REDIS_URL": url, "FRAMEWORK_NAMESPACE": NAMESPACE, "FRAMEWORK_LOG_FORMAT": "json"}
    log = open(logs / f"{name}.log", "ab")  # noqa: SIM115 - lives as long as the worker
    return subprocess.Popen(
        [sys.executable, "-m", "framework", "run", target, "--consumer", name, "--visibility-timeout", "3"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _wait(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"demo: timed out waiting for {what}")
        time.sleep(0.05)


def _orders(n: int) -> list[PlaceOrder]:
    return [
        PlaceOrder(
            order_id=f"order-{i:05d}",
            customer=f"customer-{i % 50:02d}",
            total_cents=100 + (i * 37) % 9_900,
            card="4000-0000-0000-0002" if i % 97 == 13 else "4242-4242-4242-4242",
        )
        for i in range(n)
    ]


def _report(url: str) -> tuple[list[list[str]], list]:  # type: ignore[type-arg]
    async def go() -> tuple[list, list]:  # type: ignore[type-arg]
        broker = await connect(url, namespace=NAMESPACE)
        try:
            return await describe(broker), await DeadLetters(broker).list()
        finally:
            await broker.close()

    return anyio.run(go)


def main(argv: list[str] | None = None) -> int:
    """Run the demo; exit status 0 when every check holds."""
    parser = argparse.ArgumentParser(prog="python -m example_services.demo", description=__doc__)
    parser.add_argument("--orders", type=int, default=3000, help="orders to place (default 3000)")
    parser.add_argument("--redis-url", default=None, help="default: $REDIS_URL, else the embedded Valkey")
    args = parser.parse_args(argv)
    if args.orders < 100:
        parser.error("--orders must be at least 100")

    console.rule("[bold]framework demo: orders -> billing, with a worker killed mid-stream")
    url = resolve_url(args.redis_url)
    embedded = not (args.redis_url or os.environ.get("REDIS_URL"))
    where = f"  (embedded Valkey, data in {default_data_dir()}, AOF on)" if embedded else ""
    console.print(f"broker: {redact(url)}{where}")
    delete_namespace(url, NAMESPACE)  # the demo's own keys only
    r = redis.Redis.from_url(url)
    r.delete(CHARGES_KEY, REVENUE_KEY)
    logs = Path(tempfile.mkdtemp(prefix="framework-demo-"))

    workers = {
        "orders-1": _start_worker("example_services.quickstart:orders", "orders-1", url, logs),
        "billing-a": _start_worker("example_services.quickstart:billing", "billing-a", url, logs),
        "billing-b": _start_worker("example_services.quickstart:billing", "billing-b", url, logs),
    }
    try:
        _wait(lambda: len(r.hkeys(f"{NAMESPACE}:subscriptions")) >= 2, 30, "the workers to subscribe")
        console.print(f"workers: {', '.join(workers)} (logs in {logs})")
        orders = _orders(args.orders)
        declined = {o.order_id for o in orders if o.card.endswith("0002")}
        expected = {o.order_id: o.total_cents for o in orders if o.order_id not in declined}

        killed = False
        checks: list[tuple[str, object, bool]] = [("demo finished", "no", False)]
        with Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
        ) as progress:
            placing = progress.add_task("placing orders", total=len(orders))
            charging = progress.add_task("charged once", total=len(expected))
            with SyncClient(url, namespace=NAMESPACE) as client:

                def watch() -> None:
                    nonlocal killed
                    charged = r.hlen(CHARGES_KEY)
                    progress.update(charging, completed=charged)
                    if not killed and charged > len(expected) // 3:
                        workers["billing-a"].send_signal(signal.SIGKILL)
                        killed = True
                        progress.console.print(
                            "[red]SIGKILL billing-a[/] while it holds unacknowledged events; "
                            "billing-b claims them after the 3 s visibility timeout"
                        )

                for i in range(0, len(orders), 100):
                    client.send_many(PLACE_ORDER, orders[i : i + 100], key=lambda o: o.customer)
                    progress.update(placing, advance=len(orders[i : i + 100]))
                    time.sleep(0.05)  # a steady stream, so the kill lands mid-flow
                    watch()
            deadline = time.monotonic() + 120
            while r.hlen(CHARGES_KEY) < len(expected) and time.monotonic() < deadline:
                watch()
                time.sleep(0.1)
            watch()
        _wait(
            lambda: sum(1 for _ in r.scan_iter(f"{NAMESPACE}:{{orders.placed:*}}:g:billing:dlq")) > 0 or not declined,
            30,
            "dead letters",
        )
        time.sleep(0.5)

        charges = {k.decode(): int(v) for k, v in r.hgetall(CHARGES_KEY).items()}
        revenue = sum(int(v) for v in r.hvals(REVENUE_KEY))
        states, dead = _report(url)
        lost = [o for o in expected if o not in charges]
        doubled = [o for o, c in charges.items() if c != 1]
        wrongly = [o for o in charges if o in declined]
        dead_orders = len(dead)

        table = Table(title="outcome")
        table.add_column("check")
        table.add_column("value", justify="right")
        table.add_column("ok")
        checks = [
            ("orders placed", len(orders), True),
            ("good orders charged", f"{len(charges)} / {len(expected)}", not lost),
            ("charged more than once", len(doubled), not doubled),
            ("declined cards charged", len(wrongly), not wrongly),
            ("revenue matches the orders", f"{revenue} cents", revenue == sum(expected.values())),
            ("declined orders in billing's DLQ", f"{dead_orders} / {len(declined)}", dead_orders == len(declined)),
            ("billing worker killed mid-stream", "yes" if killed else "no", killed),
        ]
        for name, value, ok in checks:
            table.add_row(name, str(value), "[green]yes[/]" if ok else "[red]NO[/]")
        console.print(table)
        if dead:
            d = dead[0]
            console.print(
                f"a dead letter: [bold]{d.ref}[/]\n  reason: {d.reason}\n  attempts: {d.attempts}, "
                f"handler: {d.handler}, error type: {d.error_type}"
            )
        status = Table(title=f"framework status --namespace {NAMESPACE}")
        for col in ("destination", "kind", "parts", "depth", "group", "pending", "lag", "dlq"):
            status.add_column(col)
        for s in states:
            for g in s.to_json()["groups"] or [None]:
                status.add_row(
                    s.spec.name,
                    "queue" if s.spec.kind == "command" else "topic",
                    str(s.spec.partitions),
                    str(s.depth),
                    *(map(str, (g["group"], g["pending"], g["lag"], g["dead_letters"])) if g else ("-", "", "", "")),
                )
        console.print(status)
    finally:
        for proc in workers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in workers.items():
            try:
                code = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            if name != "billing-a" and code != 0:
                console.print(f"[red]{name} exited with {code}[/] (see {logs / (name + '.log')})")
    ok = all(c[2] for c in checks)
    console.print("[bold green]all checks passed[/]" if ok else "[bold red]some checks failed[/]")
    console.print(
        f"next: `framework dlq list --namespace {NAMESPACE}`, `framework status --namespace {NAMESPACE}`"
        + (", `framework server stop` to stop the embedded Valkey" if embedded else "")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
