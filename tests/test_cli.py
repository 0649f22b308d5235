"""The ``framework`` command against a real server: status, send/publish, dlq, errors, server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from tests.conftest import run_cli


def test_publish_send_and_status_json(worker_env: dict[str, str]) -> None:
    out = run_cli("publish", "orders.placed", '{"order_id": "o-1"}', "--key", "o-1", "--create", env=worker_env)
    assert out.returncode == 0, out.stderr
    message_id = out.stdout.strip()
    assert len(message_id) == 36
    assert run_cli("send", "billing.refund", '{"order_id": "o-1"}', "--create", env=worker_env).returncode == 0
    status = run_cli("status", "--json", env=worker_env)
    assert status.returncode == 0, status.stderr
    data = {d["name"]: d for d in json.loads(status.stdout)}
    assert data["orders.placed"]["kind"] == "event" and data["orders.placed"]["depth"] == 1
    assert data["billing.refund"]["kind"] == "command"
    table = run_cli("status", env=worker_env)
    assert "orders.placed" in table.stdout and "topic" in table.stdout


def test_bad_arguments_get_one_line_explanations(worker_env: dict[str, str]) -> None:
    cases = [
        (["send", "q", "{not json"], "payload is not valid JSON"),
        (["run", "no_such_module:svc"], "cannot import 'no_such_module'"),
        (["run", "faultapp:nothing"], "has no attribute 'nothing'; services there:"),
        (["run", "faultapp:worker", "--concurrency", "0"], "must be at least 1"),
        (["run", "faultapp:worker", "--visibility-timeout", "soon"], "expected seconds"),
        (["status", "no.such.destination"], "unknown destination(s): no.such.destination"),
        (["dlq", "show", "nope"], "no dead letter 'nope'"),
        (["dlq", "purge", "--all"], "without confirmation: pass --yes"),
        (["dlq", "redrive"], "say which dead letters"),
        (["dlq", "list", "--limit", "0"], "must be at least 1"),
        (["dlq", "redrive", "--all", "--rate", "-5"], "must be more than zero"),
        (["run", "faultapp:worker", "--inbox-window", "-1"], "must not be negative"),
    ]
    for args, message in cases:
        out = run_cli(*args, env=worker_env)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert message in out.stderr, (args, out.stderr)
        assert "Traceback" not in out.stderr
        assert len(out.stderr.strip().splitlines()) <= 2, out.stderr


def test_an_unreachable_server_says_how_to_start_one(worker_env: dict[str, str]) -> None:
    out = run_cli("status", env={**worker_env, "REDIS_URL": "redis://127.0.0.1:9/0"})
    assert out.returncode == 1
    assert "cannot reach the broker at redis://127.0.0.1:9/0" in out.stderr and "redis-server" in out.stderr
    out = run_cli("status", "--redis-url", "http://x", env=worker_env)
    assert out.returncode == 1 and "expected redis://" in out.stderr


def test_dlq_commands_list_show_redrive_and_purge(worker_env: dict[str, str], redis_url: str, namespace: str) -> None:
    for n in range(3):
        assert run_cli("send", "poison.jobs", json.dumps({"n": n}), "--create", env=worker_env).returncode == 0
    worker = subprocess.Popen(
        [sys.executable, "-m", "framework", "run", "faultapp:poison"],
        env=worker_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        r = redis.Redis.from_url(redis_url)
        deadline = time.monotonic() + 30
        dlq = f"{namespace}:{{poison.jobs:0}}:g:poison:dlq"
        while r.xlen(dlq) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
    listed = json.loads(run_cli("dlq", "list", "--json", env=worker_env).stdout)
    assert len(listed) == 3 and {d["group"] for d in listed} == {"poison"}
    # the worker stopped just now (--force: it counts as alive for 2 minutes); without --yes: refused
    keep = run_cli("unsubscribe", "poison.jobs", "--group", "poison", "--force", env=worker_env)
    assert keep.returncode == 2 and "holds 3 dead letters" in keep.stderr, keep.stderr  # not deleted silently
    assert all(d["error_type"] == "builtins.ValueError" for d in listed)
    shown = run_cli("dlq", "show", listed[0]["message_id"], env=worker_env)
    assert shown.returncode == 0 and "rejected" in shown.stdout and "traceback" in shown.stdout
    assert "redrove 1" in run_cli("dlq", "redrive", listed[0]["ref"], env=worker_env).stdout
    assert r.xlen(f"{namespace}:{{poison.jobs:0}}:g:poison:redeliver") == 1
    assert "purged 2" in run_cli("dlq", "purge", "--group", "poison", "--yes", env=worker_env).stdout
    assert run_cli("dlq", "list", env=worker_env).stdout.strip() == "no dead letters"


def test_python_dash_m_framework_is_the_same_command(worker_env: dict[str, str]) -> None:
    direct = subprocess.run(
        [str(Path(sys.executable).parent / "framework"), "--help"], capture_output=True, text=True, env=worker_env
    )
    module = run_cli("--help", env=worker_env)
    assert direct.returncode == module.returncode == 0
    assert direct.stdout.replace("framework", "") == module.stdout.replace("framework", "")
    for sub in ("run", "status", "send", "publish", "server", "dlq", "unsubscribe", "delete"):
        assert sub in module.stdout


def test_embedded_server_commands(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["FRAMEWORK_HOME"] = str(tmp_path)
    try:
        assert run_cli("server", "status", env=env).returncode == 3
        started = run_cli("server", "start", env=env)
        assert started.returncode == 0 and "embedded Valkey running at redis://127.0.0.1:" in started.stdout
        assert "running: redis://" in run_cli("server", "status", env=env).stdout
        sent = run_cli("send", "q", "{}", "--create", env=env)  # uses the embedded server without REDIS_URL
        assert sent.returncode == 0, sent.stderr
    finally:
        assert run_cli("server", "stop", env=env).stdout.strip() == "stopped"
    assert run_cli("server", "status", env=env).returncode == 3


def test_an_import_failure_names_the_users_line_not_the_frameworks(tmp_path: Path, worker_env: dict[str, str]) -> None:
    # The error is raised inside framework/retries.py, called from line 3 of the user's module.
    (tmp_path / "badpolicy.py").write_text(
        "from framework import RetryPolicy\n\nPOLICY = RetryPolicy(max_attempts=0)\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "framework", "run", "badpolicy"],
        env={**worker_env, "PYTHONPATH": os.pathsep.join(sys.path)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert "cannot import 'badpolicy': ValueError at badpolicy.py:3:" in out.stderr, out.stderr


_WITHOUT_SQL = (
    "import sys\n"
    "for name in ('sqlalchemy', 'psycopg', 'aiosqlite'):\n"
    "    sys.modules[name] = None  # as on the core install, without the sql extra\n"
    "from framework.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


@pytest.mark.parametrize(
    "args",
    [
        ["outbox", "relay", "--once"],
        ["outbox", "migrate"],
        ["outbox", "ddl"],
        ["outbox", "status"],
        ["outbox", "retry", "--all"],
        ["outbox", "list"],
        ["outbox", "show", "some-id"],
        ["outbox", "discard", "--all", "--yes"],
    ],
)
def test_outbox_commands_name_the_sql_extra_on_the_core_install(args: list[str], worker_env: dict[str, str]) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _WITHOUT_SQL, *args], env=worker_env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"framework outbox {args[1]}: the outbox needs the SQL extra (sqlalchemy is missing): "
        "pip install 'framework[sql]'"
    ]


def test_the_other_commands_work_on_the_core_install(worker_env: dict[str, str]) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _WITHOUT_SQL, "status", "--json"], env=worker_env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []
