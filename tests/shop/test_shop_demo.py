"""``make demo`` as CI runs it: headless (no terminal, no stdin), a small shop, Spark included; its
ledger must add up, and the faults must have been injected and reported."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.fault
@pytest.mark.timeout(600)
def test_the_demo_runs_headless_and_its_ledger_adds_up(worker_env: dict[str, str], namespace: str) -> None:
    env = {**worker_env, "FRAMEWORK_DEMO_NAMESPACE": namespace, "CI": "true"}
    demo = subprocess.Popen(
        [sys.executable, "-m", "example_services.demo", "--orders", "150"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its workers, relay, API and Spark are in its process group
    )
    try:
        stdout, stderr = demo.communicate(timeout=480)
    except subprocess.TimeoutExpired:
        os.killpg(demo.pid, signal.SIGKILL)  # nothing of it outlives the test
        demo.communicate()
        raise
    out = subprocess.CompletedProcess(demo.args, demo.returncode, stdout, stderr)
    text = out.stdout
    assert out.returncode == 0, text[-4000:] + out.stderr[-3000:]
    assert "the ledger adds up" in text
    ledger = text[text.index("ledger") :]
    for check in (
        "every order shipped, declined or cancelled",
        "no card charged twice",
        "stock never negative",
        "Spark's revenue = captured payments",
        "invalid cards in billing's DLQ",
    ):
        row = next(line for line in ledger.splitlines() if check in line)
        assert row.rstrip(" │").endswith("yes"), row
    assert "NO " not in ledger
    assert "SIGKILL billing-2" in text and "SIGSTOP inventory-2" in text
    rows = {m[0]: [int(n) for n in m[1:]] for m in re.findall(r"│ (\S+) +│ +(\d+) │ +(\d+) │ +(\d+) │ +(\d+) │", text)}
    assert {"billing-1", "inventory-1", "inventory-2"} <= set(rows), text[-6000:]
    took_over, _, leases_lost, _ = (sum(col) for col in zip(rows["inventory-1"], rows["inventory-2"], strict=True))
    assert took_over + leases_lost > 0, f"the pause left no trace in the workers' logs: {rows}"
    assert "Spark: revenue per minute" in text and "/events (per topic and date" in text
    assert re.search(r"^  \S*framework status --namespace ", text, flags=re.M)


def test_a_wrong_database_url_is_one_line() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "example_services.demo", "--database-url", "sqlite:///x.db", "--no-spark"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "--database-url must be a PostgreSQL URL" in out.stdout
