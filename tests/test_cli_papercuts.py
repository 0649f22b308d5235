"""The CLI as a new user meets it (issue 37): peek, consistent durations, typos named, pipes, server.

Every test runs ``python -m framework`` against the session's real embedded Valkey.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import redis

from broker.redis import RedisBroker
from tests.conftest import run_cli
from tests.workers import Workers, wait_for, whole_lines


def _ok(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    out = run_cli(*args, env=env)
    assert out.returncode == 0, (args, out.stdout, out.stderr)
    return out


# -- peek --------------------------------------------------------------------------------------------


def test_peek_shows_stored_messages_oldest_first_with_secrets_redacted(worker_env: dict[str, str]) -> None:
    body = {"order_id": "o-1", "card_number": "4111111111111111", "nested": {"Password": "hunter2"}}
    first = _ok("publish", "peek.orders", json.dumps(body), "--create", "--key", "o-1", env=worker_env).stdout.strip()
    second = _ok("publish", "peek.orders", '{"order_id": "o-2"}', env=worker_env).stdout.strip()

    rows = json.loads(_ok("peek", "peek.orders", "--json", env=worker_env).stdout)
    assert [r["message_id"] for r in rows] == [first, second]
    shown = json.loads(rows[0]["body"])
    assert shown == {"order_id": "o-1", "card_number": "[redacted]", "nested": {"Password": "[redacted]"}}
    assert rows[0]["key"] == "o-1" and rows[0]["partition"] == 0
    table = _ok("peek", "peek.orders", env=worker_env).stdout
    assert first in table and second in table and "4111" not in table and "hunter2" not in table

    # --limit, --from an entry id (inclusive) and --from a time after both: read-only, nothing consumed
    assert [
        r["message_id"] for r in json.loads(_ok("peek", "peek.orders", "--limit", "1", "--json", env=worker_env).stdout)
    ] == [first]
    later = json.loads(_ok("peek", "peek.orders", "--from", rows[1]["entry_id"], "--json", env=worker_env).stdout)
    assert [r["message_id"] for r in later] == [second]
    future = _ok("peek", "peek.orders", "--from", "2100-01-01T00:00:00", env=worker_env).stdout
    assert "no messages stored" in future
    recent = json.loads(_ok("peek", "peek.orders", "--from", "10m", "--json", env=worker_env).stdout)
    assert len(recent) == 2
    assert len(json.loads(_ok("peek", "peek.orders", "--json", env=worker_env).stdout)) == 2


@pytest.mark.anyio
async def test_peek_merges_partitions_and_selects_one(worker_env: dict[str, str], broker: RedisBroker) -> None:
    from framework import Client, Topic

    topic = Topic("peek.parts", partitions=4)
    async with Client(broker=broker) as client:
        ids = [await client.publish(topic, {"n": n}, key=f"k-{n}") for n in range(12)]
    rows = json.loads(_ok("peek", "peek.parts", "--json", "--limit", "100", env=worker_env).stdout)
    assert sorted(r["message_id"] for r in rows) == sorted(ids)
    assert [r["entry_id"] for r in rows] == sorted(
        (r["entry_id"] for r in rows), key=lambda e: tuple(map(int, e.split("-")))
    )
    assert len({r["partition"] for r in rows}) > 1
    one = json.loads(_ok("peek", "peek.parts", "--partition", "2", "--json", "--limit", "100", env=worker_env).stdout)
    assert one and {r["partition"] for r in one} == {2}
    assert [r["message_id"] for r in one] == [r["message_id"] for r in rows if r["partition"] == 2]


def test_peek_refuses_unknown_names_and_bad_options(worker_env: dict[str, str]) -> None:
    _ok("send", "peek.refunds", "{}", "--create", env=worker_env)
    out = run_cli("peek", "peek.refnuds", env=worker_env)
    assert out.returncode == 2
    assert "no such destination 'peek.refnuds' (did you mean 'peek.refunds'?)" in out.stderr
    out = run_cli("peek", "peek.refunds", "--partition", "3", env=worker_env)
    assert out.returncode == 2 and "--partition is 0 to 0, not 3" in out.stderr
    out = run_cli("peek", "peek.refunds", "--from", "yesterday", env=worker_env)
    assert out.returncode == 2 and "expected an entry id" in out.stderr


def test_peek_on_rabbitmq_says_there_is_no_log(rabbitmq_url: str, worker_env: dict[str, str]) -> None:
    env = {**worker_env, "BROKER_URL": rabbitmq_url}
    env.pop("REDIS_URL", None)
    _ok("send", "peek.rabbit", "{}", "--create", env=env)
    out = _ok("peek", "peek.rabbit", env=env)
    assert "keeps no log of 'peek.rabbit'" in out.stdout and len(out.stdout.strip().splitlines()) == 1


# -- consistency -------------------------------------------------------------------------------------


def test_delay_takes_the_same_durations_as_every_option(worker_env: dict[str, str]) -> None:
    _ok("send", "later.jobs", "{}", "--create", "--delay", "10m", env=worker_env)
    listed = json.loads(_ok("schedule", "list", "--json", env=worker_env).stdout)
    due = [m for m in listed if m["destination"] == "later.jobs"]
    assert len(due) == 1
    out = run_cli("send", "later.jobs", "{}", "--delay", "soon", env=worker_env)
    assert out.returncode == 2 and "expected seconds like 30, 2.5s, 10m" in out.stderr


def test_dlq_commands_refuse_a_destination_or_group_that_does_not_exist(worker_env: dict[str, str]) -> None:
    _ok("send", "dlqcheck.jobs", "{}", "--create", env=worker_env)
    for args in (
        ["redrive", "--destination", "nosuch"],
        ["purge", "--destination", "nosuch", "--yes"],
        ["list", "--destination", "nosuch"],
    ):
        out = run_cli("dlq", *args, env=worker_env)
        assert out.returncode == 2, (args, out.stdout)
        assert "no such destination 'nosuch'" in out.stderr and "redrove" not in out.stdout
    out = run_cli("dlq", "redrive", "--destination", "dlqcheck.jbos", env=worker_env)
    assert "(did you mean 'dlqcheck.jobs'?)" in out.stderr
    out = run_cli("dlq", "redrive", "--group", "nobody", env=worker_env)
    assert out.returncode == 2 and "no group 'nobody' subscribed" in out.stderr


def test_status_in_an_empty_namespace_names_the_namespaces_that_exist(
    worker_env: dict[str, str], namespace: str
) -> None:
    _ok("send", "hint.jobs", "{}", "--create", env=worker_env)
    out = _ok("status", "--namespace", namespace + "-typo", env=worker_env)
    assert f"namespace '{namespace}-typo' has no destinations declared yet" in out.stdout
    assert namespace in out.stdout.split("server:", 1)[1] and "--namespace" in out.stdout


def test_run_help_says_a_module_alone_runs_every_service(worker_env: dict[str, str]) -> None:
    out = _ok("run", "--help", env=worker_env).stdout
    assert "MODULE alone runs every Service" in " ".join(out.split())


def test_output_into_a_closed_pipe_ends_quietly(worker_env: dict[str, str]) -> None:
    _ok("send", "pipe.jobs", "{}", "--create", env=worker_env)
    for args in (["peek", "pipe.jobs"], ["dlq", "list", "--json"], ["status"]):
        read, write = os.pipe()
        os.close(read)  # `| head` that has already exited: every write fails with EPIPE
        try:
            out = subprocess.run(
                [sys.executable, "-m", "framework", *args],
                env=worker_env,
                stdout=write,
                stderr=subprocess.PIPE,
                text=True,
            )
        finally:
            os.close(write)
        # 141 as a command stopped by SIGPIPE; tables (rich) end with 1, quietly too
        assert out.returncode == (1 if args[0] in ("peek", "status") else 141), (args, out.stderr)
        assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr


# -- server ------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_server_status_json_and_start_on_a_port(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "BROKER_URL")}
    env.update(FRAMEWORK_HOME=str(tmp_path), PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    stopped = run_cli("server", "status", "--json", env=env)
    assert stopped.returncode == 3 and json.loads(stopped.stdout)["running"] is False
    port, other = _free_port(), _free_port()
    try:
        _ok("server", "start", "--port", str(port), env=env)
        st = json.loads(_ok("server", "status", "--json", env=env).stdout)
        assert st["running"] is True and st["port"] == port and st["pid"] > 0
        assert st["url"] == f"redis://:***@127.0.0.1:{port}/0" and st["password_file"].endswith("password")
        again = run_cli("server", "start", "--port", str(other), env=env)
        assert again.returncode == 2
        assert f"already runs on port {port}" in again.stderr and f"--port {other} not applied" in again.stderr
        _ok("server", "start", "--port", str(port), env=env)  # the port it runs on: fine
    finally:
        run_cli("server", "stop", env=env)
    deadline = time.monotonic() + 10
    while run_cli("server", "status", env=env).returncode != 3 and time.monotonic() < deadline:
        time.sleep(0.1)


def test_a_processed_message_logs_a_debug_line(workers: Workers, worker_env: dict[str, str]) -> None:
    workers.start("faultapp:worker", "dbg", "--log-level", "debug")
    wait_for(lambda: "acquired partitions" in workers.log("dbg"), 30, "the worker to start")
    message_id = _ok("send", "jobs", '{"n": "d-1"}', env=worker_env).stdout.strip()

    def settled() -> list[dict[str, object]]:
        lines = [json.loads(x) for x in whole_lines(workers.log("dbg")) if x.startswith("{")]
        return [x for x in lines if x.get("event") == "message settled" and x.get("message_id") == message_id]

    wait_for(settled, 30, "the debug line of the processed message")
    [line] = settled()
    assert line["level"] == "debug" and line["outcome"] == "success" and line["handler"] == "job"
    workers.start("faultapp:worker", "quiet")  # at the default level (info): no line per message
    wait_for(
        lambda: "acquired partitions" in workers.log("quiet") or "runtime started" in workers.log("quiet"), 30, "start"
    )
    assert "message settled" not in workers.log("quiet")


# -- the client: typos in destination names ------------------------------------------------------------


@pytest.mark.anyio
async def test_client_refuses_a_typo_of_a_declared_name_and_creates_on_purpose(broker: RedisBroker) -> None:
    from framework import Client, NewDestinationWarning, Queue, UnknownDestination

    await broker.declare(Queue("refunds.issue").spec())
    async with Client(broker=broker) as client:
        with pytest.raises(UnknownDestination) as caught:
            await client.send("refunds.isue", {"order_id": "o-1"})
        assert "unknown queue 'refunds.isue' (did you mean 'refunds.issue'?)" in str(caught.value)
        assert "create=True" in str(caught.value)
        with pytest.raises(UnknownDestination):
            await client.publish("refunds.issues", {"x": 1})  # a topic named like the queue: a typo too
        with pytest.raises(UnknownDestination):
            async with client.batch() as batch:
                batch.send("refunds.issue", {"ok": 1})
                batch.send("refunds.isue", {"typo": 1})
        assert await broker.get_destination("refunds.isue") is None  # nothing created
        assert await client.send("refunds.issue", {"order_id": "o-1"})  # the declared name: fine
        assert await client.send("refunds.isue", {"order_id": "o-1"}, create=True)  # on purpose
        assert await broker.get_destination("refunds.isue") is not None
        assert await client.send("refunds.isue", {"again": 1})  # declared now
        # no near match: created, with one warning saying nobody consumes it yet
        with pytest.warns(
            NewDestinationWarning, match="creating topic 'audit.trail' on first use: nothing consumes it"
        ):
            await client.publish("audit.trail", {"n": 1})
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # checked once per client: no second warning
            await client.publish("audit.trail", {"n": 2})
        assert await client.send(Queue("refunds.issu"), {"n": 1})  # a Queue object creates on purpose
        with pytest.warns(NewDestinationWarning):  # numbered siblings are not typos: created
            assert await client.publish("audit.trail2", {"n": 1})
        await client.publish("orders.us.placed", {"n": 1}, create=True)
        with pytest.warns(NewDestinationWarning):  # a sibling for a pattern subscription ("orders.*.placed")
            assert await client.publish("orders.eu.placed", {"n": 1})


# -- the README's Quick start, as written -------------------------------------------------------------


def test_the_quick_start_shows_what_the_handler_wrote_once(tmp_path: Path) -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1]
    (tmp_path / "shop.py").write_text(quick.split("```python\n", 1)[1].split("```", 1)[0])
    lines = quick.split("```sh\n", 1)[1].split("```", 1)[0].splitlines()
    commands = [c for c in (line.split("  #")[0].strip() for line in lines) if not c.startswith("source ")]
    assert commands[0] == "framework run shop:billing &" and commands[-2] == "framework peek payments.captured"
    # its own embedded Valkey: the example writes "revenue" outside any namespace
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "BROKER_URL", "FRAMEWORK_NAMESPACE")}
    root = str(Path(__file__).resolve().parents[1])
    env.update(FRAMEWORK_HOME=str(tmp_path / ".framework"), FRAMEWORK_LOG_FORMAT="json", PYTHONPATH=root)
    worker = subprocess.Popen(
        [sys.executable, "-m", "framework", *commands[0].split()[1:-1]],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "worker.log", "wb"),  # noqa: SIM115 - closed with the process
    )
    try:
        wait_for(lambda: "runtime started" in (tmp_path / "worker.log").read_text(), 60, "the billing service")
        import shlex

        for line in commands[1:3]:  # the two publishes of one message id
            out = subprocess.run(
                [sys.executable, "-m", "framework", *shlex.split(line)[1:]],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
            )
            assert out.returncode == 0, (line, out.stderr)

        def captured() -> list[dict[str, object]]:
            out = subprocess.run(
                [sys.executable, "-m", "framework", "peek", "payments.captured", "--json"],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
            )
            return json.loads(out.stdout) if out.returncode == 0 else []

        wait_for(captured, 30, "the handler's event")
        time.sleep(1.0)  # the copy has been delivered too by now: still one event
        events = captured()
        assert [json.loads(e["body"]) for e in events] == [{"order_id": "o-1"}]
        table = subprocess.run(
            [sys.executable, "-m", "framework", "peek", "payments.captured"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
        )
        assert "o-1" in table.stdout and "1 message(s)" in table.stdout
    finally:
        worker.terminate()
        worker.wait(timeout=30)
        subprocess.run([sys.executable, "-m", "framework", "server", "stop"], env=env, capture_output=True)


@pytest.mark.anyio
async def test_dlq_show_redacts_secret_fields_as_peek_does(
    broker: RedisBroker, worker_env: dict[str, str], redis_url: str, namespace: str
) -> None:
    from broker import DestinationSpec

    await broker.subscribe(DestinationSpec(name="redact.q", kind="command"), "g1")
    r = redis.Redis.from_url(redis_url)
    body = json.dumps({"order_id": "o-9", "card_number": "4111", "auth": {"token": "t0k"}})
    r.xadd(f"{namespace}:{{redact.q:0}}:g:g1:dlq", {"id": "dead-1", "type": "t", "body": body, "dlq-reason": "test"})
    r.close()
    shown = json.loads(_ok("dlq", "show", "dead-1", "--json", env=worker_env).stdout)
    assert json.loads(shown["body"]) == {
        "order_id": "o-9",
        "card_number": "[redacted]",
        "auth": {"token": "[redacted]"},
    }
    text = _ok("dlq", "show", "dead-1", env=worker_env).stdout
    assert "4111" not in text and "t0k" not in text and "o-9" in text
